"""The GPU harness (scripts/gpu.py) on CPU: which steps run, their time bounds, their verdict
lines, and SKIP with the reason where there is no CUDA device. The steps' GPU commands
themselves run only on a GPU machine (docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("moe_ep_gpu_harness", ROOT / "scripts" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu
_spec.loader.exec_module(gpu)

VERDICT = re.compile(r"^(build|test|conformance|sanitize|bench|fake) (PASS|FAIL|SKIP) \d+\.\d s: .+$")
NO_GPU = (0, (), "no CUDA device: nvidia-smi not found")
ONE_H200 = (1, ("NVIDIA H200",), "")


def _ctx(tmp_path: Path, gpus: int = 1, **kw) -> "gpu.Context":
    kw.setdefault("env", {"_SITE": ""})  # no wheels to install
    return gpu.Context(root=ROOT, out=tmp_path, python=sys.executable, gpus=gpus, gpu_names=("NVIDIA H200",) * gpus,
                       gpu_problem="" if gpus else NO_GPU[2], **kw)


def _step(*commands: "gpu.Command", needs_gpu: bool = False) -> "gpu.Step":
    return gpu.Step("fake", lambda ctx: list(commands), needs_gpu=needs_gpu)


def _py(code: str) -> tuple:
    return (sys.executable, "-c", code)


def test_step_selection_keeps_the_harness_order_and_rejects_unknown_names() -> None:
    assert gpu.select_steps([]) == ["build", "test", "conformance", "sanitize", "bench"]
    assert gpu.select_steps(["bench", "build", "bench"]) == ["build", "bench"]
    with pytest.raises(ValueError, match="unknown step tests: the steps are build, test"):
        gpu.select_steps(["tests"])


def test_budgets_default_by_variant_and_are_overridden_for_all_or_one_step() -> None:
    full = gpu.parse_timeouts([], ["build", "test"], quick=False)
    quick = gpu.parse_timeouts([], ["build", "test"], quick=True)
    assert full == {"build": 900.0, "test": 1500.0} and quick == {"build": 45.0, "test": 120.0}
    assert gpu.parse_timeouts(["30", "test=7"], ["build", "test"], quick=False) == {"build": 30.0, "test": 7.0}
    for bad, message in (("x", "SECONDS or STEP=SECONDS"), ("0", "positive"), ("tests=3", "unknown step 'tests'")):
        with pytest.raises(ValueError, match=message):
            gpu.parse_timeouts([bad], ["test"], quick=False)


def test_quick_variant_of_test_and_conformance_is_short_and_runs_on_the_gpu() -> None:
    budgets = gpu.parse_timeouts([], list(gpu.STEPS), quick=True)
    # measured on an H100 (2026-12-06): build 21 s, test 70 s, conformance 31 s
    assert budgets["build"] + budgets["test"] + budgets["conformance"] <= 240
    ctx = _ctx(Path("/tmp"), quick=True)
    (tests,) = gpu.test_commands(ctx)
    assert "-k" in tests.argv and "tests/test_native_cuda.py" in tests.argv
    conformance = gpu.conformance_commands(ctx)
    assert [c.name for c in conformance] == ["cuda-nccl-ep1", "cuda-nccl-shared-ep2"]
    assert all("--quick" in c.argv and "-k" in c.argv for c in conformance)
    shared = conformance[1]
    assert "cuda-shared" in shared.argv and shared.env["MOE_EP_CUDA_NCCL_EXCHANGE"] == "device"


def test_every_step_skips_with_the_reason_without_a_cuda_device(tmp_path) -> None:
    ctx = _ctx(tmp_path, gpus=0)
    for name in gpu.STEPS:
        v = gpu.run_step(gpu.REGISTRY[name], ctx, 60.0)
        assert (v.status, v.reason) == ("SKIP", "no CUDA device: nvidia-smi not found"), name
        assert VERDICT.match(v.line())
    assert list(tmp_path.iterdir()) == []  # nothing ran, no log written


def test_build_skips_without_nvcc_and_without_a_carried_build(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    monkeypatch.setattr(gpu, "carried", lambda ctx, name: None)
    v = gpu.run_step(gpu.REGISTRY["build"], _ctx(tmp_path), 60.0)
    assert v.status == "SKIP" and "nvcc not found and no build carried in .devbuild/" in v.reason


def test_a_command_that_passes_gives_pass_with_its_summary_and_a_log(tmp_path) -> None:
    step = _step(gpu.Command("one", _py("print('noise'); print('3 passed, 1 skipped in 0.5s')")))
    v = gpu.run_step(step, _ctx(tmp_path), 60.0)
    assert v.status == "PASS" and v.reason == "one: 3 passed, 1 skipped in 0.5s"
    assert VERDICT.match(v.line())
    log = (tmp_path / "fake-one.log").read_text()
    assert log.startswith("$ ") and "noise" in log


def test_a_failing_command_or_tests_that_all_skipped_give_fail(tmp_path) -> None:
    failing = _step(gpu.Command("ok", _py("print('fine')")),
                    gpu.Command("bad", _py("import sys; print('1 failed in 0.1s'); sys.exit(3)")))
    v = gpu.run_step(failing, _ctx(tmp_path), 60.0)
    assert v.status == "FAIL" and "bad rc=3: 1 failed in 0.1s" in v.reason and "ok: fine" in v.reason
    skipped = _step(gpu.Command("cuda", _py("print('12 skipped in 0.2s')")))
    v = gpu.run_step(skipped, _ctx(tmp_path), 60.0)
    assert v.status == "FAIL" and "every test skipped" in v.reason


def test_a_command_that_overruns_the_step_budget_is_killed_and_fails(tmp_path) -> None:
    marker = tmp_path / "child-alive"
    # the sleeper's child would write the marker after 4 s: the whole process group must die
    child = f"import time, pathlib; time.sleep(4); pathlib.Path({str(marker)!r}).write_text('x')"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    step = _step(gpu.Command("sleeper", _py(code)), gpu.Command("after", _py("print('never')")))
    t0 = time.monotonic()
    v = gpu.run_step(step, _ctx(tmp_path), 1.5)
    assert time.monotonic() - t0 < 15
    assert v.status == "FAIL" and "sleeper timed out after" in v.reason
    assert "budget of 2 s spent; not run: after" in v.reason
    time.sleep(4)
    assert not marker.exists()
    assert "timed out after" in (tmp_path / "fake-sleeper.log").read_text()


def test_commands_that_cannot_run_here_are_skipped_with_their_reason(tmp_path) -> None:
    step = _step(gpu.Command("sanitizer", _py("print('x')"), needs=lambda: "compute-sanitizer not found"))
    v = gpu.run_step(step, _ctx(tmp_path), 60.0)
    assert (v.status, v.reason) == ("SKIP", "sanitizer skipped (compute-sanitizer not found)")
    mixed = _step(gpu.Command("sanitizer", _py("print('x')"), needs=lambda: "compute-sanitizer not found"),
                  gpu.Command("tests", _py("print('2 passed in 1s')")))
    v = gpu.run_step(mixed, _ctx(tmp_path), 60.0)
    assert v.status == "PASS" and v.reason == "sanitizer skipped (compute-sanitizer not found); tests: 2 passed in 1s"


def test_bench_compares_with_the_cards_baseline_or_says_there_is_none(tmp_path) -> None:
    assert gpu.default_baseline(ROOT, ("NVIDIA H200",)) == ROOT / "bench" / "baselines" / "h200.json"
    assert gpu.default_baseline(ROOT, ("NVIDIA H100 80GB HBM3",)) == ROOT / "bench" / "baselines" / "h100.json"
    assert gpu.default_baseline(ROOT, ("NVIDIA A100",)) is None
    bench, *training, compare = gpu.bench_commands(_ctx(tmp_path, baseline=None))
    assert "--hidden" in bench.argv and "7168" in bench.argv and "--compare" not in bench.argv
    # the training rows: the bf16-operand backward of the native backends and the pure jax one
    assert [c.name for c in training] == ["cuda-nccl-bf16-backward", "jax-ffi-bf16-backward", "jax-bf16-backward"]
    assert all(c.argv[c.argv.index("--backward-operand-format") + 1] == "bf16" for c in training)
    assert compare.needs().startswith("no baseline for this card (NVIDIA H200)")
    # a baseline made of two runs: the DeepSeek-V3 run compared with it, then each run's command again
    baseline = tmp_path / "h200.json"
    baseline.write_text(json.dumps({"schema": "moe-ep-bench-baseline/1", "rows": [], "sources": [
        {"file": "a.json", "command": "moe-ep bench --device cuda --backend jax-ffi --tokens 4096 --op forward"},
        {"file": "b.json", "command": "moe-ep bench --device cuda --backend cuda-nccl --op dispatch"}]}))
    cmds = gpu.bench_commands(_ctx(tmp_path, baseline=baseline))
    assert [c.name for c in cmds] == ["cuda-nccl", "cuda-nccl-bf16-backward", "jax-ffi-bf16-backward",
                                      "jax-bf16-backward", "compare-1", "compare-2"]
    compared = [c for c in cmds if "bf16-backward" not in c.name]
    assert all(c.argv[c.argv.index("--compare") + 1] == str(baseline) for c in compared)
    assert cmds[4].argv[1:8] == ("-m", "moe_ep_spec.cli", "bench", "--device", "cuda", "--backend", "jax-ffi")
    (quick,) = gpu.bench_commands(_ctx(tmp_path, baseline=baseline, quick=True))
    assert "--compare" in quick.argv and quick.argv[quick.argv.index("--tokens") + 1] == "128"


def test_commands_get_the_wheels_tests_and_a_carried_library_on_their_paths(tmp_path, monkeypatch) -> None:
    ctx = _ctx(tmp_path, env={"_SITE": "/site", "EXTRA": "1"})
    monkeypatch.delenv("MOE_EP_NATIVE_LIBRARY", raising=False)
    monkeypatch.setattr(gpu, "carried", lambda ctx, name: None)
    env = gpu.child_env(ctx, {"MOE_EP_CUDA_NCCL_EXCHANGE": "device"})
    paths = env["PYTHONPATH"].split(":")
    assert paths[:2] == ["/site", str(ROOT / "tests")] and "MOE_EP_NATIVE_LIBRARY" not in env
    assert env["EXTRA"] == "1" and env["MOE_EP_CUDA_NCCL_EXCHANGE"] == "device" and "_SITE" not in env
    lib = tmp_path / "libmoe_ep_native.so"
    monkeypatch.setattr(gpu, "carried", lambda ctx, name: lib if name == lib.name else None)
    env = gpu.child_env(ctx)
    assert env["PYTHONPATH"].split(":")[:3] == ["/site", str(ROOT / "backends" / "native"), str(ROOT / "tests")]
    assert env["MOE_EP_NATIVE_LIBRARY"] == str(lib) and env["NCCL_SOCKET_IFNAME"]


def test_main_without_a_gpu_writes_verdicts_and_a_summary(tmp_path, capsys) -> None:
    rc = gpu.main(["--out", str(tmp_path), "--quick"], probe=lambda: NO_GPU)
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    verdicts = (tmp_path / "verdicts.txt").read_text().splitlines()
    assert [v.split()[0] for v in verdicts] == list(gpu.STEPS) and all(VERDICT.match(v) for v in verdicts)
    assert verdicts == out[1:-1] and out[-1].startswith("summary: 0 PASS, 0 FAIL, 5 SKIP")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quick"] is True and [v["status"] for v in summary["verdicts"]] == ["SKIP"] * 5


def test_main_dry_run_lists_each_steps_commands_and_budget(tmp_path, capsys) -> None:
    assert gpu.main(["--out", str(tmp_path), "--dry-run", "bench", "test"], probe=lambda: ONE_H200) == 0
    out = capsys.readouterr().out
    assert out.index("[test] budget 1500 s") < out.index("[bench] budget 1800 s")
    assert "--compare " + str(ROOT / "bench" / "baselines" / "h200.json") in out
    assert not (tmp_path / "verdicts.txt").exists()


def test_the_script_runs_as_a_command_and_rejects_an_unknown_step(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu.py"), "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown step nope" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "build, test, conformance, sanitize, bench" in proc.stdout


def test_the_commit_is_the_checkouts_own_not_that_of_a_checkout_around_a_snapshot(tmp_path) -> None:
    """A snapshot (git archive HEAD) unpacked inside the checkout is not at the checkout's
    HEAD: its summary says "unknown" rather than a commit it may not be."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert re.fullmatch(r"[0-9a-f]{7,40}", gpu.commit(ROOT))
    assert gpu.commit(ROOT / "docs") == "unknown"
    assert gpu.commit(tmp_path) == "unknown"
