"""The ``moe-ep`` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import List, Sequence

import numpy as np
import pytest

import moe_ep_spec
from moe_ep_spec import ForwardResult, MoeEpConfig, RankInputs
from moe_ep_spec.cli import main


def test_backends_table_lists_reference(capsys: pytest.CaptureFixture) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("reference"))
    assert "yes" in line and "moe-ep-spec" in line and "launch=world" in line


def test_backends_json(capsys: pytest.CaptureFixture) -> None:
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ref = next(b for b in data["backends"] if b["name"] == "reference")
    assert ref["available"] is True
    assert ref["capabilities"]["formats"] == ["bf16", "mxfp8", "nvfp4"]
    assert data["plugin_failures"] == []


def test_run_two_rank_mxfp8_layer_passes(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--ep-size", "2", "--format", "mxfp8", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "output=mxfp8" in out and "ep_size=2" in out
    assert "rank 1 grad_fc2_weight" in out
    assert out.strip().endswith("PASS: within the spec's tolerance")


def test_run_json_report(capsys: pytest.CaptureFixture) -> None:
    code = main(["run", "--ep-size", "4", "--tokens", "4", "--format", "nvfp4", "--input-format", "mxfp8", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert report["config"]["num_ranks"] == 4 and report["config"]["output_format"] == "nvfp4"
    assert len(report["checks"]) == 4 + 4 * 4
    assert all(c["error_over_budget"] == 0.0 for c in report["checks"])


def test_run_unknown_backend_suggests(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--backend", "referense"]) == 2
    err = capsys.readouterr().err
    assert "no MoeEp backend named 'referense'" in err and "Did you mean 'reference'?" in err


def test_run_bad_config_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--experts", "6", "--ep-size", "4"]) == 2
    assert "num_experts must be divisible by num_ranks = 4; got num_experts = 6" in capsys.readouterr().err


class _ScaledOutput(moe_ep_spec.MoeEpBackend):
    """A wrong backend: the reference's bf16 output times 1.02."""

    name = "test-scaled-output"
    capabilities = moe_ep_spec.Capabilities(formats=frozenset({moe_ep_spec.MoeFormat.BF16}), backward=False)

    def forward(self, config: MoeEpConfig, inputs: Sequence[RankInputs]) -> List[ForwardResult]:
        ref = moe_ep_spec.get_backend("reference").forward(config, inputs)
        return [
            ForwardResult(moe_ep_spec.round_to_bf16(r.output.astype(np.float64) * 1.02)) for r in ref
        ]


def test_run_detects_a_wrong_backend(capsys: pytest.CaptureFixture) -> None:
    registry = moe_ep_spec.get_registry()
    registry.register(_ScaledOutput())
    try:
        code = main(["run", "--backend", "test-scaled-output", "--no-backward", "--tokens", "8"])
    finally:
        registry.unregister("test-scaled-output")
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL rank 0 output: worst element" in out
    assert out.strip().endswith("FAIL: outside the spec's tolerance")


def test_run_refuses_what_the_backend_does_not_declare(capsys: pytest.CaptureFixture) -> None:
    registry = moe_ep_spec.get_registry()
    registry.register(_ScaledOutput())
    try:
        code = main(["run", "--backend", "test-scaled-output", "--tokens", "8"])  # wants backward
    finally:
        registry.unregister("test-scaled-output")
    assert code == 2
    assert "cannot run this layer: capability: backward not supported" in capsys.readouterr().err


def test_console_script_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep_spec.cli", "run", "--tokens", "4", "--no-backward"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PASS" in proc.stdout


def test_run_drives_a_process_per_rank_backend(capsys: pytest.CaptureFixture) -> None:
    from rank_backends import LoopbackReference

    registry = moe_ep_spec.get_registry()
    registry.register(LoopbackReference())
    try:
        code = main(["run", "--backend", "loopback-reference", "--tokens", "4", "--timeout", "120"])
    finally:
        registry.unregister("loopback-reference")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "backend loopback-reference" in out and "PASS" in out


# ------------------------------------------------------------------ what a new user meets


def _run_help() -> str:
    from moe_ep_spec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["run"]


def test_bare_moe_ep_prints_the_help(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moe-ep") and "backends" in out and "run" in out


def test_run_help_describes_every_option_with_its_default() -> None:
    run = _run_help()
    assert run.description and "reference" in run.description
    for action in run._actions:
        if action.dest == "help":
            continue
        text = action.help or ""
        assert "default" in text, f"{action.option_strings}: no default in {text!r}"
        words = text.split("(")[0].strip().lower()
        for opt in action.option_strings:
            assert words != opt.lstrip("-").replace("-", " "), f"{opt}: the help only repeats the name"
        if "apply_topk_in_fc1" in text:  # an internal name only next to words a user reads
            assert text.index("apply_topk_in_fc1") > 20


def test_tokens_zero_names_the_option(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "moe-ep run: error: argument --tokens: must be an integer >= 1; got 0" in err
    assert "max_tokens_per_rank" not in err


# ----------------------------------------------------------------- one voice for every command's mistakes


def _usage_error(argv: List[str], capsys: pytest.CaptureFixture) -> List[str]:
    """The stderr lines of a command line mistake, after checking its exit status (2) and that stdout is empty."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.splitlines()


@pytest.mark.parametrize("command", ["run", "backends", "conformance", "bench"])
def test_an_unknown_option_shows_the_subcommands_usage_and_help(command: str, capsys: pytest.CaptureFixture) -> None:
    lines = _usage_error([command, "--format-of-nothing", "x"], capsys)
    assert lines[0].startswith(f"usage: moe-ep {command} ")
    assert f"moe-ep {command}: error: unrecognized arguments: --format-of-nothing x" in lines
    assert lines[-1] == f"see `moe-ep {command} --help` for its options"


@pytest.mark.parametrize("command", ["run", "conformance", "bench"])
def test_ep_size_zero_is_worded_the_same_by_every_command(command: str, capsys: pytest.CaptureFixture) -> None:
    lines = _usage_error([command, "--ep-size", "0"], capsys)
    assert f"moe-ep {command}: error: argument --ep-size: must be an integer >= 1; got 0" in lines
    assert lines[-1] == f"see `moe-ep {command} --help` for its options"


def test_conformance_usage_mistakes_exit_2_with_one_sentence(tmp_path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nope.txt"
    assert _usage_error(["conformance", "--xfail-file", str(missing)], capsys) == [
        f"moe-ep: error: --xfail-file {missing}: the file does not exist"]
    assert _usage_error(["conformance", "--tolerance-file", str(tmp_path)], capsys) == [
        f"moe-ep: error: --tolerance-file {tmp_path}: the file is a directory, not a file"]
    bad = tmp_path / "xf.txt"
    bad.write_text("two patterns here\n")
    (line,) = _usage_error(["conformance", "--xfail-file", str(bad)], capsys)
    assert line.startswith("moe-ep: error: ") and "an expected-failure entry is one test-id pattern" in line
    report = tmp_path / "missing" / "r.json"
    assert _usage_error(["conformance", "--report-json", str(report)], capsys) == [
        f"moe-ep: error: --report-json {report}: cannot write the report there: the directory {report.parent} "
        "does not exist"]
    assert _usage_error(["conformance", "--ep-size", "7"], capsys)[0].startswith(
        "moe-ep: error: --ep-size 7: the full table has no case with that EP size")


def test_conformance_k_that_selects_nothing_says_so(capsys: pytest.CaptureFixture) -> None:
    assert main(["conformance", "--backend", "reference", "--quick", "-k", "no_such_words_anywhere"]) == 2
    lines = capsys.readouterr().err.splitlines()  # stdout: pytest's header
    assert lines[-1].startswith("moe-ep: error: -k 'no_such_words_anywhere' selects no case of the quick table "
                                "(backends: reference)")


def test_an_unavailable_backend_is_refused_before_any_work(capsys: pytest.CaptureFixture) -> None:
    """As fast as `moe-ep backends`: the quick availability check first, no framework import, no suite."""

    class _Absent(moe_ep_spec.MoeEpBackend):
        name = "test-absent"
        capabilities = moe_ep_spec.Capabilities()

        def quick_availability(self) -> moe_ep_spec.Availability:
            return moe_ep_spec.Availability(False, "its library is not installed")

        def availability(self) -> moe_ep_spec.Availability:  # the slow check: never reached
            raise AssertionError("the full availability check ran")

    registry = moe_ep_spec.get_registry()
    registry.register(_Absent())
    try:
        for argv in (["conformance", "--backend", "test-absent"], ["run", "--backend", "test-absent"]):
            assert _usage_error(argv, capsys) == [
                "moe-ep: error: MoeEp backend 'test-absent' is not available: its library is not installed"]
    finally:
        registry.unregister("test-absent")


def test_the_help_states_every_exit_status(capsys: pytest.CaptureFixture) -> None:
    from moe_ep_spec.cli import EXIT_CODES

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for code in EXIT_CODES:
        assert f"{code} " in text
    for command in ("conformance", "bench"):
        assert main([command, "--help"]) == 0
        assert "Exit status: 0 " in " ".join(capsys.readouterr().out.split())


def test_backends_shows_input_formats(capsys: pytest.CaptureFixture) -> None:
    class _Bf16Only(moe_ep_spec.MoeEpBackend):
        name = "test-bf16-only"
        capabilities = moe_ep_spec.Capabilities(formats=frozenset({moe_ep_spec.MoeFormat.BF16}),
                                                input_formats=frozenset({moe_ep_spec.MoeFormat.BF16}))

    registry = moe_ep_spec.get_registry()
    registry.register(_Bf16Only())
    try:
        assert main(["backends"]) == 0
    finally:
        registry.unregister("test-bf16-only")
    out = capsys.readouterr().out
    assert "fmt=bf16 in=bf16" in next(line for line in out.splitlines() if line.startswith("test-bf16-only"))
    assert "fmt=all in=all" in next(line for line in out.splitlines() if line.startswith("reference"))


def test_conformance_summary_calls_an_error_of_one_budget_a_code_step() -> None:
    from moe_ep_conformance.cases import Case
    from moe_ep_conformance.report import Record, Report
    from moe_ep_conformance.runner import CaseResult, Check

    def record(case: Case, *ratios: float) -> Record:
        checks = [Check(f"rank {i} output", True, r) for i, r in enumerate(ratios)]
        return Record(CaseResult(case.test_id("demo"), "demo", case, "passed", ratio=max(ratios), checks=checks),
                      "passed")

    step, other = Case("forward", 2, 2, 8), Case("forward", 2, 2, 16)
    report = Report(backends={"demo": {"version": "1"}},
                    records=[record(step, 1.0, 0.25), record(other, 0.42), record(Case("forward", 2, 1, 8), 0.0)])
    line = report.summary_line("demo")
    assert "worst passing error/budget 1 (" + step.test_id("demo") in line
    assert (f": 1 step: an allowed neighbouring code; worst other error/budget 0.42 ({other.test_id('demo')}, "
            "check 'rank 0 output')") in line
    details = report.to_json()["details"]["demo"]
    assert details["worst_passing"]["code_step"] is True
    assert details["worst_below_a_step"] == {"id": other.test_id("demo"), "check": "rank 0 output",
                                             "error_over_budget": 0.42}
    assert "Worst error/budget of a passing case: 1 step: an allowed neighbouring code; worst other" in report.to_markdown()
    below = Report(backends={"demo": {}}, records=[record(other, 0.42)])
    assert "worst passing error/budget 0.42 (" in below.summary_line("demo") and "step" not in below.summary_line("demo")


def test_config_errors_name_the_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--experts", "6", "--ep-size", "4"]) == 2
    assert "(set by --experts, --ep-size)" in capsys.readouterr().err


@pytest.mark.parametrize("command, install", [("bench", "pip install ./bench"), ("conformance", "pip install ./conformance")])
def test_a_missing_add_on_command_says_what_to_install(
    command: str, install: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import moe_ep_spec.cli as cli

    monkeypatch.setattr(cli.metadata, "entry_points", lambda group: [])
    assert main([command, "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-ep: error: 'moe-ep {command}' comes with the moe-ep-{command} distribution")
    assert install in err
    assert main([]) == 0  # the help lists it, with the same hint
    assert f"not installed: {install}" in " ".join(capsys.readouterr().out.split())


def test_run_json_into_a_closed_pipe_is_quiet() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_ep_spec.cli", "run", "--json", "--tokens", "4", "--no-backward"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head` exiting before the report is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_forward_only_backend_gets_an_error_with_a_hint(capsys: pytest.CaptureFixture) -> None:
    registry = moe_ep_spec.get_registry()
    registry.register(_ScaledOutput())
    try:
        code = main(["run", "--backend", "test-scaled-output", "--tokens", "8"])
    finally:
        registry.unregister("test-scaled-output")
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("moe-ep: error: backend 'test-scaled-output' cannot run this layer") and "--no-backward" in err


def test_backends_lists_fast_without_torch_or_jax() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); from moe_ep_spec.cli import main; rc = main(['backends']); "
        "print('elapsed', time.perf_counter() - t); print('heavy', sorted({'torch', 'jax'} & set(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "heavy []" in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    table = lines[: lines.index("")]
    assert max(len(line) for line in table) <= 100, table
    if "not available here:" in proc.stdout:  # the reasons sit under the table, not in it
        assert all(len(row.split()) >= 4 for row in table)


def test_backends_check_asks_in_full(capsys: pytest.CaptureFixture) -> None:
    assert main(["backends", "--check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["checked"] is True
    assert next(b for b in data["backends"] if b["name"] == "reference")["available"] is True


def test_load_plugins_entry_matching_nothing_fails_the_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(__import__("os").environ, MOE_EP_LOAD_PLUGINS="reference,nosuch")
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep_spec.cli", "backends"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2
    assert "moe-ep: error: MOE_EP_LOAD_PLUGINS names 'nosuch'" in proc.stderr and "reference (moe-ep-spec)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ratio_format_never_rounds_a_value_below_one_up_to_one() -> None:
    from moe_ep_conformance.report import format_ratio

    assert format_ratio(0.456) == "0.456"
    assert format_ratio(0.9999769931350734) == "0.99998"
    assert format_ratio(0.9995) == "0.9995"
    assert format_ratio(1.0) == "1"
    assert format_ratio(0.0) == "0"
