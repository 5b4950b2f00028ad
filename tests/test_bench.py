"""``moe-ep bench`` (the bench/ distribution): CPU smoke runs of the harness.

A ``--quick`` run on the reference and, when installed, the torch backend at EP
1 and 2 (gloo on loopback), with the JSON report's schema, its numbers, its
table and its plots checked; one run of the other drivers at tiny sizes
(``cuda-nccl`` on CPU through MOE_EP_CUDA_NCCL_ON_CPU=1, ``jax`` and ``jax-ffi``
on two virtual CPU devices) with the grouped_gemm and weight_read rooflines;
plus the parts that need no run. When moe-ep-bench is not installed, bench/ is
put on sys.path (the spawned rank processes inherit it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest

import moe_ep_spec
from moe_ep_spec.backend import Capabilities, Launch

ROOT = Path(__file__).resolve().parents[1]
try:
    import moe_ep_bench  # noqa: F401
except ImportError:  # not installed: use the checkout
    sys.path.insert(0, str(ROOT / "bench"))

from moe_ep_bench import cli as bench_cli  # noqa: E402
from moe_ep_bench.drivers.world import world_cases  # noqa: E402
from moe_ep_bench.model import BenchSettings, auto_experts, make_routing, row_bytes, weight_bytes  # noqa: E402
from moe_ep_bench.results import BASELINES, RATIO_KEYS, SCHEMA, STATUSES, Row, add_ratios, format_table, sig  # noqa: E402



def _have_torch() -> bool:
    try:
        return moe_ep_spec.get_backend("torch").is_available()
    except moe_ep_spec.MoeEpError:
        return False


HAVE_TORCH = _have_torch()
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
ROW_KEYS = {"backend", "kind", "op", "tokens", "format", "status", "reason", "median_ms", "min_ms", "max_ms", "p25_ms",
            "p75_ms", "gbps", "ratios", "bytes", "samples_ms", "label", "variant", "ep_size", "device"}
#: Names the baselines had before they got one name each: none may appear anywhere.
OLD_NAMES = ("nccl", "gloo", "peer-copy", "d2d-copy", "memcpy", "grouped-gemm", "matmul", "vs_nccl", "vs_peer",
             "vs_peer_copy", "vs_roofline", "a2a")


def _positive_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# Runs the bench and says whether the parent process imported torch (it must not: the
# rank processes do).
_MAIN = (
    "import sys\n"
    "from moe_ep_bench.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('parent imported torch:', 'torch' in sys.modules)\n"
    "sys.exit(code)\n"
)


@pytest.fixture(scope="module", params=[1, 2], ids=["ep1", "ep2"])
def quick_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tuple[int, Dict[str, Any], Path, str, str]:
    ep = request.param
    out = tmp_path_factory.mktemp(f"bench-ep{ep}")
    backends = ["--backend", "reference"] + (["--backend", "torch"] if HAVE_TORCH else [])
    argv = ["--quick", "--ep-size", str(ep), "--json", str(out / "bench.json"), "--plot-dir", str(out / "plots"),
            "--timeout", "120", "--wide", "--progress", "lines"] + backends
    proc = subprocess.run(
        [sys.executable, "-c", _MAIN, *argv],
        capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "bench.json").read_text())
    return ep, report, out, proc.stdout, proc.stderr


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench")] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def test_quick_run_report_schema(quick_run) -> None:
    ep, report, _, _, _ = quick_run
    assert report["schema"] == SCHEMA
    assert report["settings"]["ep_size"] == ep and report["settings"]["device"] == "cpu"
    assert report["command"].startswith("moe-ep bench --device cpu --ep-size")
    assert report["rows"], "no rows"
    for row in report["rows"]:
        assert ROW_KEYS <= set(row), sorted(ROW_KEYS - set(row))
        assert row["status"] in STATUSES
        assert isinstance(row["ratios"], dict)
        if row["status"] != "ok":
            assert row["reason"]
            continue
        assert _positive_finite(row["median_ms"]), row
        assert len(row["samples_ms"]) == report["settings"]["repeats"]
        assert row["min_ms"] <= row["p25_ms"] <= row["median_ms"] <= row["p75_ms"] <= row["max_ms"], row
        for key, value in row["ratios"].items():
            assert key in RATIO_KEYS
            assert _positive_finite(value), (key, row)
        if row["op"] in ("dispatch", "combine") or row["kind"] == "backend":
            assert _positive_finite(row["gbps"]), row


def test_quick_run_measures_every_backend_and_baseline(quick_run) -> None:
    ep, report, _, _, _ = quick_run
    ok = {(r["backend"], r["op"], r["format"], r["tokens"]) for r in report["rows"] if r["status"] == "ok"}
    tokens, formats = report["settings"]["tokens"], report["settings"]["formats"]
    assert tokens == [8, 32] and formats == ["bf16", "mxfp8"]
    for t in tokens:
        for fmt in formats:
            for op in ("dispatch", "combine", "forward", "forward_backward"):
                assert ("reference", op, fmt, t) in ok
            if HAVE_TORCH:
                for op in ("dispatch", "combine", "forward"):
                    assert ("torch", op, fmt, t) in ok
                for base in ("all_to_all", "copy"):
                    assert (base, "dispatch", fmt, t) in ok and (base, "combine", fmt, t) in ok
                assert ("grouped_gemm", "forward", fmt, t) in ok and ("grouped_gemm", "forward_backward", fmt, t) in ok
                assert ("weight_read", "forward", fmt, t) in ok
        if HAVE_TORCH:
            # bf16 through autograd, mxfp8 through the explicit API (forward with its stash, then backward)
            assert ("torch", "forward_backward", "bf16", t) in ok and ("torch", "forward_backward", "mxfp8", t) in ok
            label = next(r["label"] for r in report["rows"] if r["backend"] == "torch" and r["format"] == "mxfp8"
                         and r["op"] == "forward_backward" and r["tokens"] == t)
            assert "moe_ep_forward_with_stash then moe_ep_backward" in label, label
    if HAVE_TORCH:
        torch_rows = [r for r in report["rows"] if r["backend"] == "torch" and r["status"] == "ok"]
        want = {"dispatch": {"vs_all_to_all", "vs_copy"}, "combine": {"vs_all_to_all", "vs_copy"},
                "forward": {"vs_all_to_all", "vs_grouped_gemm", "vs_weight_read"},
                "forward_backward": {"vs_all_to_all", "vs_grouped_gemm"}}
        for r in torch_rows:
            assert set(r["ratios"]) == want[r["op"]], r
        assert report["environment"]["torch"]


def test_quick_run_counts_the_bytes_of_the_token_rows(quick_run) -> None:
    _, report, _, _, _ = quick_run
    s = report["settings"]
    h, k = s["hidden"], s["topk"]
    for r in report["rows"]:
        if r["op"] == "dispatch" and r["status"] == "ok":
            # K distinct experts per token: every rank sends T*K routes, so receives T*K on average
            assert r["bytes"] == pytest.approx(r["tokens"] * k * row_bytes(r["format"], h))
            assert r["gbps"] == pytest.approx(r["bytes"] / (r["median_ms"] / 1e3) / 1e9)


def test_quick_run_prints_a_table_and_progress(quick_run) -> None:
    ep, _, _, stdout, stderr = quick_run
    assert f"moe-ep bench: device=cpu ep_size={ep}" in stdout
    header = next(line for line in stdout.splitlines() if line.startswith("backend"))
    for col in ("median ms", "min-max ms", "GB/s", "TFLOP/s"):
        assert col in header
    if HAVE_TORCH:
        for col in RATIO_KEYS:
            assert col in header
    assert any(line.startswith("reference  ") and " dispatch " in line for line in stdout.splitlines())
    assert "[1/" in stderr or "%|" in stderr  # the plain counter or tqdm
    assert "parent imported torch: False" in stdout


def test_quick_run_times_training_through_the_module(quick_run) -> None:
    """forward+backward of bf16 layers through MoeEpLayer as a user calls it: an extra row of the
    torch-based backends (variant MoeEpLayer); every forward_backward row of a backend says its mode."""
    _, report, _, _, _ = quick_run
    if not HAVE_TORCH:
        pytest.skip("the torch backend is not available")
    module = [r for r in report["rows"] if r["variant"] == "MoeEpLayer"]
    assert {(r["backend"], r["op"], r["format"]) for r in module} == {("torch", "forward_backward", "bf16")}
    assert all(r["status"] == "ok" and "MoeEpLayer(config, backend='torch')" in r["label"] for r in module), module
    fb = [r for r in report["rows"] if r["op"] == "forward_backward" and r["kind"] == "backend"]
    assert fb and all(r["backward_operand_format"] == "none" for r in fb)
    assert all(r["backward_operand_format"] == "" for r in report["rows"] if r["op"] != "forward_backward")


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_quick_run_writes_png_plots(quick_run) -> None:
    ep, report, out, _, _ = quick_run
    paths = [Path(p) for p in report["plots"]]
    assert sorted(p.name for p in paths) == [f"cpu-ep{ep}-bandwidth.png", f"cpu-ep{ep}-latency.png"]
    for p in paths:
        assert p.parent == out / "plots"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_backend_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    assert bench_cli.main(["--quick", "--backend", "no-such-backend"]) == 2
    err = capsys.readouterr().err
    assert "moe-ep: error:" in err and "no MoeEp backend named 'no-such-backend'" in err


def test_bad_shape_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    assert bench_cli.main(["--quick", "--backend", "reference", "--hidden", "48", "--format", "mxfp8"]) == 2
    assert "hidden must be a multiple of 32" in capsys.readouterr().err


class _NoDriver(moe_ep_spec.MoeEpBackend):
    name = "test-bench-no-driver"
    capabilities = Capabilities(launch=Launch.PROCESS_PER_RANK)


_SMALL = ["--quick", "--ep-size", "1", "--op", "dispatch", "--format", "bf16", "--tokens", "8", "--no-baselines",
          "--repeats", "1", "--warmup", "0", "--input-sets", "1"]


def test_backend_without_a_driver_is_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    registry = moe_ep_spec.get_registry()
    nodriver = _NoDriver()
    registry.register(nodriver)
    _only_reference_and(nodriver, monkeypatch)
    try:
        code = bench_cli.main(_SMALL + ["--backend", "reference", "--backend", _NoDriver.name,
                                        "--json", str(tmp_path / "b.json")])
        err = capsys.readouterr().err
        # the default run leaves it out and says so
        left = bench_cli.main(_SMALL + ["--no-progress"])
        out = capsys.readouterr().out
    finally:
        registry.unregister(_NoDriver.name)
    assert code == 2 and not (tmp_path / "b.json").exists()
    assert err.startswith(f"moe-ep: error: --backend {_NoDriver.name}: the bench has no driver for this backend")
    assert "moe_ep_bench.drivers" in err
    assert left == 0
    assert "left out of this run" in out and f"{_NoDriver.name} (no bench driver)" in " ".join(out.split())


class _Absent(moe_ep_spec.MoeEpBackend):
    name = "test-bench-absent"
    capabilities = Capabilities()

    def quick_availability(self) -> moe_ep_spec.Availability:
        return moe_ep_spec.Availability(False, "its library is not installed")

    def availability(self) -> moe_ep_spec.Availability:  # the slow check: never reached
        raise AssertionError("the full availability check ran")


def _only_reference_and(backend: moe_ep_spec.MoeEpBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default run's backends: the reference and ``backend`` (not every installed one: quick)."""
    registry = moe_ep_spec.get_registry()
    reference = registry.get_backend("reference")
    monkeypatch.setattr(registry, "list_backends", lambda: [reference, backend])


def test_an_unavailable_backend_is_refused_by_its_quick_check(capsys: pytest.CaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    registry = moe_ep_spec.get_registry()
    absent = _Absent()
    registry.register(absent)
    _only_reference_and(absent, monkeypatch)
    try:
        code = bench_cli.main(_SMALL + ["--backend", _Absent.name])
        err = capsys.readouterr().err
        assert bench_cli.main(_SMALL + ["--no-progress"]) == 0  # the default run leaves it out, saying why
        out = " ".join(capsys.readouterr().out.split())
    finally:
        registry.unregister(_Absent.name)
    assert code == 2
    assert err == f"moe-ep: error: MoeEp backend '{_Absent.name}' is not available: its library is not installed\n"
    assert f"{_Absent.name} (not available here: its library is not installed)" in out


def test_plots_without_matplotlib_are_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code = bench_cli.main(_SMALL + ["--backend", "reference", "--plot-dir", str(tmp_path / "plots")])
    err = capsys.readouterr().err
    assert code == 2 and "--plot-dir" in err and "need matplotlib" in err and err.startswith("moe-ep: error:")


def test_a_report_in_a_missing_folder_is_refused_as_conformance_refuses_it(capsys: pytest.CaptureFixture,
                                                                           tmp_path: Path) -> None:
    path = tmp_path / "missing" / "b.json"
    assert bench_cli.main(_SMALL + ["--backend", "reference", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"moe-ep: error: --json {path}: cannot write the report there: the directory {path.parent} does not exist\n"
    from moe_ep_conformance.usage import check_report_path

    with pytest.raises(moe_ep_spec.MoeEpError) as exc:
        check_report_path("--json", str(path))
    assert f"moe-ep: error: {exc.value}\n" == err  # one wording for both commands


def test_default_table_fits_100_columns_and_progress_is_quiet_off_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code = bench_cli.main(["--quick", "--ep-size", "1", "--backend", "reference", "--tokens", "8", "--repeats", "1",
                           "--warmup", "0", "--input-sets", "1", "--no-baselines", "--json", str(tmp_path / "b.json")])
    captured = capsys.readouterr()
    assert code == 0
    lines = captured.out.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    for op in ("dispatch", "combine", "forward", "forward_backward (backward_operand_format none)"):
        assert op in lines
    long = Row(backend="jax", kind="backend", op="dispatch", tokens=8, format="bf16", ep_size=1, device="cpu",
               status="skipped", reason="skipped: " + "a long reason " * 20)
    assert max(len(line) for line in format_table([long]).splitlines()) <= 100
    # not a terminal: one line at the start, then at most one every 30 s (and the last), never one per measurement
    total = len(json.loads((tmp_path / "b.json").read_text())["rows"])
    progress = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert "progress every 30 s" in captured.err and 1 <= len(progress) < total, captured.err


def test_wide_table_has_every_column(capsys: pytest.CaptureFixture) -> None:
    assert bench_cli.main(_SMALL + ["--backend", "reference", "--wide", "--no-progress"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("backend "))
    assert re.split(r"\s{2,}", header)[:8] == ["backend", "op", "format", "tokens", "median ms", "min-max ms", "GB/s",
                                               "TFLOP/s"]


def test_backward_operand_format_reaches_the_config_and_the_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--quick", "--ep-size", "1", "--backend", "reference", "--tokens", "8", "--format", "bf16", "--op",
            "forward_backward", "--repeats", "1", "--warmup", "0", "--input-sets", "1", "--no-baselines",
            "--no-progress", "--backward-operand-format", "bf16", "--json", str(tmp_path / "b.json")]
    assert bench_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "forward_backward (backward_operand_format bf16)" in out
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["settings"]["backward_operand_format"] == "bf16"
    assert "--backward-operand-format bf16" in report["command"]
    (row,) = report["rows"]
    assert row["backward_operand_format"] == "bf16" and row["status"] == "ok"
    s = BenchSettings(device="cpu", ep_size=1, hidden=64, intermediate=32, experts=8, topk=2, tokens=(8,),
                      formats=("bf16",), backward_operand_format="bf16")
    assert s.config("bf16").backward_operand_format is not None


# ----------------------------------------------------------------------------- --compare


def _report(rows, device="cuda", gpu="NVIDIA H200", **settings):
    base = {"device": device, "ep_size": 1, "hidden": 7168, "intermediate": 2048, "experts": 32, "topk": 8,
            "intermediate_format": "bf16", "cuda_nccl_mode": "device", "exchange_mode": "throughput"}
    base.update(settings)
    return {"schema": SCHEMA, "settings": base, "environment": {"gpus": [{"index": 0, "name": gpu}]},
            "rows": [{"backend": b, "kind": k, "variant": "", "op": op, "format": f, "tokens": t, "status": "ok",
                      "median_ms": ms, "ep_size": 1, "device": device} for b, k, op, f, t, ms in rows]}


def _write(path: Path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def test_compare_fails_a_slower_row_and_reports_unmatched_ones(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from moe_ep_bench import compare as C

    base = _write(tmp_path / "base.json", _report([
        ("cuda-nccl", "backend", "forward", "bf16", 128, 1.0), ("cuda-nccl", "backend", "forward", "bf16", 4096, 5.0),
        ("grouped_gemm", "baseline", "forward", "bf16", 4096, 4.0), ("cuda-nccl", "backend", "dispatch", "bf16", 128, 0.02)]))
    slow = _write(tmp_path / "slow.json", _report([
        ("cuda-nccl", "backend", "forward", "bf16", 128, 1.05), ("cuda-nccl", "backend", "forward", "bf16", 4096, 5.6),
        ("grouped_gemm", "baseline", "forward", "bf16", 4096, 5.0), ("cuda-nccl", "backend", "forward", "mxfp8", 128, 1.0)]))
    assert C.main([slow, base]) == 1
    raw = capsys.readouterr().out
    assert max(len(line) for line in raw.splitlines()) <= 100
    out = raw.replace("\n  ", " ")  # the prose lines unwrapped
    assert "SLOWER by 12%" in out and "compare: FAIL: 1 row(s)" in out and "cuda-nccl forward bf16 4096 (1.12)" in out
    assert "not in the baseline: cuda-nccl forward mxfp8 128" in out
    assert "in the baseline but not measured here: 1 rows" in out
    assert "baselines of the run, time / baseline time (not judged): grouped_gemm forward bf16 4096 1.25" in out
    # within the tolerance: 0; a wider tolerance lets the 12 % through
    assert C.main([slow, base, "--tolerance", "0.15"]) == 0
    assert "compare: ok: 3 rows matched" in " ".join(capsys.readouterr().out.split())
    # --tolerance 0 is allowed (any slower row fails), as in moe-ep bench
    assert C.main([slow, base, "--tolerance", "0"]) == 1
    capsys.readouterr()
    # another GPU, or another mode, is another row
    other = _write(tmp_path / "h100.json", _report([("cuda-nccl", "backend", "forward", "bf16", 128, 9.0)], gpu="NVIDIA H100"))
    assert C.main([other, base]) == 0
    assert "no row matched the baseline (gpu NVIDIA H100 here, NVIDIA H200 in the baseline)" in " ".join(
        capsys.readouterr().out.split())


def test_compare_after_a_run_and_a_baseline_made_from_reports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from moe_ep_bench import compare as C

    run = tmp_path / "run.json"
    argv = _SMALL + ["--backend", "reference", "--no-progress", "--json", str(run)]
    assert bench_cli.main(argv) == 0
    doc = json.loads(run.read_text())
    (row,) = doc["rows"]
    # The baseline a million times faster: slower; a million times slower: fine. (The run
    # being compared is a second run of a sub-millisecond op: on a loaded CI machine it can
    # be ten times faster than the first, so a margin of 10 failed there.)
    for factor, code in ((1e-6, 1), (1e6, 0)):
        row["median_ms"] = json.loads(run.read_text())["rows"][0]["median_ms"] * factor
        made = tmp_path / f"baseline-{code}.json"
        assert C.main(["--make-baseline", str(made), _write(tmp_path / f"src-{code}.json", doc)]) == 0
        capsys.readouterr()
        assert json.loads(made.read_text())["schema"] == C.BASELINE_SCHEMA
        assert bench_cli.main(argv + ["--compare", str(made)]) == code
        out = capsys.readouterr().out
        assert ("compare: FAIL" in out) == (code == 1) and "reference  dispatch  bf16" in out
    capsys.readouterr()
    assert bench_cli.main(argv + ["--compare", str(tmp_path / "nope.json")]) == 2
    assert "--compare" in capsys.readouterr().err


def test_the_h200_baseline_reads_and_matches_its_own_rows() -> None:
    from moe_ep_bench import compare as C

    rows = C.load(str(ROOT / "bench" / "baselines" / "h200.json"))
    assert rows and all(e.ident["gpu"] == "NVIDIA H200" and e.ident["hidden"] == 7168 for e in rows)
    keys = {(e.ident["backend"], e.ident["op"], e.ident["format"], e.ident["tokens"]) for e in rows}
    for fmt in ("bf16", "mxfp8", "nvfp4"):
        for t in (128, 4096):
            assert ("cuda-nccl", "forward", fmt, t) in keys and ("cuda-nccl", "forward_backward", fmt, t) in keys
    assert C.compare(rows, rows).ok and C.compare(rows, rows).matched == len(rows)


def test_the_h100_baseline_reads_and_holds_the_training_rows_of_both_backward_modes() -> None:
    from moe_ep_bench import compare as C

    rows = C.load(str(ROOT / "bench" / "baselines" / "h100.json"))
    assert rows and all(e.ident["gpu"] == "NVIDIA H100 80GB HBM3" and e.ident["hidden"] == 7168 for e in rows)
    training = {(e.ident["backend"], e.ident["tokens"]) for e in rows if e.ident["op"] == "forward_backward"}
    assert {("cuda-nccl", 4096), ("jax-ffi", 4096), ("jax", 128), ("jax", 4096)} <= training
    assert C.compare(rows, rows).ok and C.compare(rows, rows).matched == len(rows)


@pytest.mark.skipif(not HAVE_TORCH, reason="the torch backend is not available")
def test_a_rank_past_the_timeout_stops_the_run(tmp_path: Path) -> None:
    # The rank processes cannot even import torch within 0.2 s: every measurement is reported, none hangs.
    code = bench_cli.main([
        "--quick", "--ep-size", "2", "--backend", "torch", "--op", "dispatch", "--format", "bf16", "--tokens", "8",
        "--timeout", "0.2", "--no-progress", "--json", str(tmp_path / "t.json"),
    ])
    assert code == 1
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert rows and all(r["status"] == "error" and "timeout" in r["reason"] for r in rows), rows


def test_world_backend_skips_deepseek_sizes() -> None:
    s = BenchSettings(device="cuda", ep_size=2, hidden=7168, intermediate=2048, experts=256, topk=8,
                      tokens=(128, 4096), formats=("bf16",))
    rows = world_cases(moe_ep_spec.get_backend("reference"), s)
    assert rows and all(r.status == "skipped" and r.reason.startswith("skipped: too slow for this size") for r in rows)
    slow = BenchSettings(**{**s.__dict__, "include_slow": True})
    assert all(r.status == "ok" for r in world_cases(moe_ep_spec.get_backend("reference"), slow))


def test_defaults_and_counted_quantities() -> None:
    # DeepSeek-V3 shape: 128 local experts fit 80 GB, so EP 1 runs 128 experts and EP 2 runs 256
    assert auto_experts(1, 7168, 2048, 8, 80.0) == 128
    assert auto_experts(2, 7168, 2048, 8, 80.0) == 256
    assert auto_experts(8, 7168, 2048, 8, 80.0) == 256
    assert row_bytes("bf16", 7168) == 14336 and row_bytes("mxfp8", 7168) == 7168 + 224
    s = BenchSettings(device="cpu", ep_size=2, hidden=64, intermediate=32, experts=8, topk=2, tokens=(16,),
                      formats=("bf16",), input_sets=3)
    routing = make_routing(s, 16)
    assert routing.num_sets == 3
    for st in range(3):
        assert sum(routing.send_rows(st, 0)) == 16 * 2
        assert sum(routing.expert_rows(st, 1)) == sum(routing.recv_rows(st, 1))
    again = make_routing(s, 16)
    assert all((a == b).all() for x, y in zip(routing.topk_idx, again.topk_idx) for a, b in zip(x, y))


def test_ratios_are_baseline_time_over_time() -> None:
    def row(backend: str, op: str, ms: float, kind: str = "backend") -> Row:
        return Row(backend=backend, kind=kind, op=op, tokens=8, format="bf16", ep_size=2, device="cuda").set_times([ms])

    rows = [row("torch", "dispatch", 4.0), row("all_to_all", "dispatch", 1.0, "baseline"),
            row("copy", "dispatch", 0.5, "baseline"), row("all_to_all", "combine", 2.0, "baseline"),
            row("torch", "forward", 10.0), row("grouped_gemm", "forward", 5.0, "baseline"),
            row("weight_read", "forward", 2.0, "baseline"), row("torch", "forward_backward", 30.0),
            row("grouped_gemm", "forward_backward", 15.0, "baseline")]
    add_ratios(rows)
    assert rows[0].ratios == {"vs_all_to_all": 0.25, "vs_copy": 0.125}
    assert rows[4].ratios == {"vs_grouped_gemm": 0.5, "vs_weight_read": 0.2, "vs_all_to_all": pytest.approx(0.3)}
    assert rows[5].ratios == {"vs_grouped_gemm": 1.0}
    assert rows[6].ratios == {"vs_weight_read": 1.0}
    # forward_backward: its own GEMMs, twice the exchanges, no weight_read
    assert rows[7].ratios == {"vs_grouped_gemm": 0.5, "vs_all_to_all": pytest.approx(0.2)}


def test_the_harness_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import moe_ep_bench.cli, moe_ep_bench.model, moe_ep_bench.results, moe_ep_bench.plots\n"
        "import moe_ep_bench.drivers.torch_driver, moe_ep_bench.drivers.world\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=120)


def test_moe_ep_bench_subcommand_when_installed(capsys: pytest.CaptureFixture) -> None:
    names = {ep.name for ep in metadata.entry_points(group="moe_ep_spec.commands")}
    if "bench" not in names:
        pytest.skip("moe-ep-bench is not installed (pip install -e bench)")
    from moe_ep_spec.cli import main

    assert main(["bench", "--help"]) == 0
    assert "--ep-size" in capsys.readouterr().out


# ----------------------------------------------------------------------------- one name per baseline, the table


_PROGRESS = re.compile(r"^\[\d+/\d+\] (\S+)")


def _table_lines(stdout: str) -> list:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend "))
    out = []
    for line in lines[start + 1:]:
        first = line.split(" ", 1)[0]
        if not line or first.endswith(":") or re.match(r"^(torch \d|wrote |parent )", line):
            break
        out.append(line)
    return out


def test_quick_run_uses_one_name_per_baseline(quick_run) -> None:
    _, report, _, stdout, stderr = quick_run
    backends = {"reference", "torch"}
    rows = report["rows"]
    names = {r["backend"] for r in rows if r["kind"] == "baseline"}
    if HAVE_TORCH:
        assert names == set(BASELINES)
        variants = {r["backend"]: r["variant"] for r in rows if r["kind"] == "baseline"}
        assert variants == {"all_to_all": "gloo", "copy": "host", "grouped_gemm": "per-expert matmul",
                            "weight_read": "host copy"}
    assert {r["backend"] for r in rows} <= backends | set(BASELINES)
    keys = {k for r in rows for k in r["ratios"]} | {k for k in report["definitions"] if k.startswith("vs_")}
    assert keys <= set(RATIO_KEYS) and set(report["definitions"]) >= set(RATIO_KEYS)
    progress = {m.group(1) for line in stderr.splitlines() for m in [_PROGRESS.match(line)] if m}
    assert progress and progress <= backends | set(BASELINES), progress
    if HAVE_TORCH:
        assert set(BASELINES) <= progress
    table = _table_lines(stdout)
    assert {line.split(" ", 1)[0] for line in table} <= backends | set(BASELINES)
    header = re.split(r"\s{2,}", next(line for line in stdout.splitlines() if line.startswith("backend ")))
    for old in OLD_NAMES:
        assert old not in header and old not in keys and old not in progress, old


_NUMBER = re.compile(r"^(?:-|0|\d+|\d+\.\d+)$")


def _sig_digits(text: str) -> int:
    return len(text.replace(".", "").lstrip("0"))


def _check_number(text: str) -> None:
    assert _NUMBER.match(text), text
    if text not in ("-", "0") and "." in text:
        assert _sig_digits(text) == 3, text
    elif text not in ("-", "0"):
        assert len(text) >= 3, text  # integers: three digits or more, never rounded to fewer


def test_quick_run_table_has_one_number_style(quick_run) -> None:
    _, report, _, stdout, _ = quick_run
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("backend "))
    cols = re.split(r"\s{2,}", header.strip())
    assert cols[:8] == ["backend", "op", "format", "tokens", "median ms", "min-max ms", "GB/s", "TFLOP/s"]
    assert "e-0" not in stdout and "e+0" not in stdout
    ok = [r for r in report["rows"] if r["status"] == "ok"]
    table = _table_lines(stdout)
    assert len(table) == len(ok)
    for line in table:
        cells = re.split(r"\s{2,}", line.strip())
        numbers = cells[4:len(cols) - 1]
        lo, hi = numbers[1].split("-")
        for text in [numbers[0], lo, hi] + numbers[2:]:
            _check_number(text)


def test_format_table_median_spread_and_significant_digits() -> None:
    rows = [Row(backend="torch", kind="backend", op="forward", tokens=8, format="bf16", ep_size=1,
                device="cpu").set_times([0.0005881, 0.0004, 0.009712]),
            Row(backend="grouped_gemm", kind="baseline", op="forward", tokens=8, format="bf16", ep_size=1,
                device="cpu", variant="per-expert matmul").set_times([9.712e-05, 1e-4, 2e-4])]
    rows[0].bytes, rows[0].flops = 1e6, 3e9
    for r in rows:
        r.gbps = r.tflops = None
    add_ratios(rows)
    compact = format_table(rows).splitlines()
    assert compact[:2] == ["forward", "backend       format  tokens  median ms  TFLOP/s  vs_grouped_gemm"]
    assert compact[2].split() == ["torch", "bf16", "8", "0.000588", "-", "0.170"]
    assert "baselines: grouped_gemm per-expert matmul" in compact
    text = format_table(rows, wide=True)
    lines = text.splitlines()
    cols = re.split(r"\s{2,}", lines[0])
    assert cols == ["backend", "op", "format", "tokens", "median ms", "min-max ms", "GB/s", "TFLOP/s",
                    "vs_grouped_gemm", "note"]
    torch_cells = re.split(r"\s{2,}", lines[1].strip())
    assert torch_cells[4:7] == ["0.000588", "0.000400-0.00971", "-"]
    assert torch_cells[8] == "0.170"  # 0.0001 / 0.0005881
    gemm_cells = re.split(r"\s{2,}", lines[2].strip())
    assert gemm_cells[4:6] == ["0.000100", "0.0000971-0.000200"] and gemm_cells[-1] == "per-expert matmul"
    assert "e-0" not in text
    assert [sig(v) for v in (45.1, 0.0999, 0.09996, 1.0, 12345.6, 623.4, None, 0.0)] == \
        ["45.1", "0.0999", "0.100", "1.00", "12346", "623", "-", "0"]


def test_weight_read_is_the_weights_at_the_runs_copy_bandwidth(quick_run) -> None:
    _, report, _, _, _ = quick_run
    if not HAVE_TORCH:
        pytest.skip("the baselines need torch")
    s = report["settings"]
    settings = BenchSettings(device="cpu", ep_size=s["ep_size"], hidden=s["hidden"], intermediate=s["intermediate"],
                             experts=s["experts"], topk=s["topk"], tokens=tuple(s["tokens"]), formats=tuple(s["formats"]))
    wr = {(r["format"], r["tokens"]): r for r in report["rows"] if r["backend"] == "weight_read"}
    assert set(wr) == {(f, t) for f in s["formats"] for t in s["tokens"]}
    bandwidth = wr[("bf16", s["tokens"][0])]["gbps"]
    for (fmt, t), r in wr.items():
        assert r["status"] == "ok" and r["derived"] and r["kind"] == "baseline" and r["op"] == "forward"
        assert r["bytes"] == weight_bytes(settings, fmt)
        assert r["gbps"] == pytest.approx(bandwidth)  # one copy bandwidth for the whole run
        assert "copy bandwidth" in r["label"] and "read + write" in r["label"]
        assert r["median_ms"] == pytest.approx(r["bytes"] / (bandwidth * 1e9) * 1e3)
    for r in report["rows"]:
        if r["backend"] == "torch" and r["op"] == "forward" and r["status"] == "ok":
            base = wr[(r["format"], r["tokens"])]["median_ms"]
            assert r["ratios"]["vs_weight_read"] == pytest.approx(base / r["median_ms"])
    # bf16: 6 E_local H I bytes; mxfp8: codes plus one scale byte per 32
    assert weight_bytes(settings, "bf16") == 6 * settings.num_local_experts * s["hidden"] * s["intermediate"]
    big = BenchSettings(device="cuda", ep_size=1, hidden=7168, intermediate=2048, experts=32, topk=8, tokens=(128,),
                        formats=("bf16",))
    assert weight_bytes(big, "bf16") == 2_818_572_288  # issue 14: "reads 2.82 GB of bf16 weights"


# ----------------------------------------------------------------------------- the cuda-nccl, jax and jax-ffi drivers


def test_drivers_cover_every_backend_and_say_what_they_skip() -> None:
    from moe_ep_bench.drivers import BUILTIN
    from moe_ep_bench.drivers.jax_driver import jax_cases
    from moe_ep_bench.drivers.torch_driver import make_jobs, unsupported

    assert BUILTIN == {"reference": "world", "torch": "torch", "cuda-nccl": "torch", "jax": "jax", "jax-ffi": "jax"}
    s = BenchSettings(device="cpu", ep_size=2, hidden=64, intermediate=32, experts=8, topk=2, tokens=(8, 32),
                      formats=("bf16", "mxfp8"))
    jobs = make_jobs(s, ["cuda-nccl"], baselines=True)
    mine = {(j.op, j.format, j.tokens) for j in jobs if j.target == "cuda-nccl"}
    assert mine == {(op, f, t) for op in ("forward", "forward_backward") for f in s.formats for t in s.tokens}
    assert [j.describe() for j in jobs if j.target == "weight_read"] == ["weight_read (device copy of the local bf16 weights)"]
    assert {j.target for j in jobs} == {"cuda-nccl"} | set(BASELINES)
    assert unsupported("cuda-nccl", "dispatch", "bf16").startswith("skipped:")
    # --cuda-nccl-mode device: the device exchange's stages are timed too (bf16 rows).
    dev = BenchSettings(**{**s.__dict__, "cuda_nccl_mode": "device"})
    assert dev.as_dict()["exchange_mode"] == "throughput"  # the device exchange's mode is in the JSON's settings
    from moe_ep_bench.cli import _command

    ll = BenchSettings(**{**dev.__dict__, "exchange_mode": "low_latency"})
    assert "--cuda-nccl-mode device --exchange-mode low_latency" in _command(ll, ["cuda-nccl"])
    assert "--exchange-mode" not in _command(s, ["cuda-nccl"])  # synced: no device exchange
    mine = {(j.op, j.format) for j in make_jobs(dev, ["cuda-nccl"], baselines=False) if j.target == "cuda-nccl"}
    assert {("dispatch", "bf16"), ("combine", "bf16")} <= mine and ("dispatch", "mxfp8") not in mine
    assert unsupported("cuda-nccl", "combine", "mxfp8", dev).startswith("skipped: the bench times the device exchange")
    assert unsupported("torch", "forward_backward", "mxfp8") is None  # the explicit API times it
    assert unsupported("torch", "dispatch", "mxfp8") is None
    backend = type("B", (), {"name": "jax-ffi"})()
    status = {(r.op, r.format, r.tokens): r.status for r in jax_cases(backend, s)}  # type: ignore[arg-type]
    assert status[("dispatch", "bf16", 8)] == "skipped"
    assert status[("forward", "mxfp8", 8)] == status[("forward_backward", "bf16", 32)] == "ok"
    assert status[("forward_backward", "mxfp8", 8)] == "ok"  # through the explicit API


# Picks the backends that can run in this environment (cuda-nccl needs MOE_EP_CUDA_NCCL_ON_CPU=1 on CPU, the jax
# ones two devices, asked for through XLA_FLAGS before jax is imported), then runs the bench on them.
_MAIN_OTHERS = (
    "import json, sys\n"
    "import moe_ep_spec\n"
    "names = []\n"
    "for name in sys.argv[1].split(','):\n"
    "    try:\n"
    "        if moe_ep_spec.get_backend(name, require_available=False).availability():\n"
    "            names.append(name)\n"
    "    except moe_ep_spec.MoeEpError:\n"
    "        pass\n"
    "print('backends:', json.dumps(names))\n"
    "if not names:\n"
    "    sys.exit(0)\n"
    "from moe_ep_bench.cli import main\n"
    "sys.exit(main(sys.argv[2:] + [a for n in names for a in ('--backend', n)]))\n"
)
OTHERS = ("cuda-nccl", "jax", "jax-ffi")


@pytest.fixture(scope="module")
def others_run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[list, Dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench-others")
    env = _env()
    env["MOE_EP_CUDA_NCCL_ON_CPU"] = "1"
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    argv = ["--quick", "--ep-size", "2", "--tokens", "8", "--format", "bf16", "--format", "mxfp8", "--op", "forward",
            "--op", "forward_backward", "--repeats", "2", "--input-sets", "1", "--timeout", "120", "--no-progress",
            "--json", str(out / "bench.json")]
    proc = subprocess.run([sys.executable, "-c", _MAIN_OTHERS, ",".join(OTHERS), *argv],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = json.loads(proc.stdout.split("backends:", 1)[1].splitlines()[0])
    if not names:
        pytest.skip("none of cuda-nccl, jax, jax-ffi can run here")
    return names, json.loads((out / "bench.json").read_text()), proc.stdout


@pytest.mark.parametrize("name", OTHERS)
def test_other_drivers_time_the_layer_on_cpu(others_run, name: str) -> None:
    names, report, stdout = others_run
    if name not in names:
        pytest.skip(f"backend {name!r} cannot run here")
    rows = {r["op"]: r for r in report["rows"] if r["backend"] == name and not r["variant"] and r["format"] == "bf16"}
    assert set(rows) == {"forward", "forward_backward"}
    # Block-scaled inputs train through the explicit API (the forward with its stash, then the backward).
    mx = [r for r in report["rows"] if r["backend"] == name and r["format"] == "mxfp8" and r["op"] == "forward_backward"]
    assert mx and all(r["status"] == "ok" for r in mx), mx
    assert all("moe_ep_backward" in r["label"] for r in mx if not r["variant"]), [r["label"] for r in mx]
    module = [r for r in report["rows"] if r["backend"] == name and r["variant"] == "MoeEpLayer"]
    if name == "cuda-nccl":  # the torch module a user calls, forward+backward of bf16 layers
        assert [(r["op"], r["format"], r["status"]) for r in module] == [("forward_backward", "bf16", "ok")], module
        assert "MoeEpLayer(config, backend='cuda-nccl')" in module[0]["label"]
    else:
        assert not module
    twins = {r["op"]: r for r in report["rows"] if r["backend"] == name and r["variant"] not in ("", "MoeEpLayer")
             and r["format"] == "bf16"}
    if name.startswith("jax"):  # each jax row has a pipelined twin: 8 calls back to back, one wait
        assert set(twins) == set(rows)
        for op, r in twins.items():
            assert r["status"] == "ok" and r["variant"] == "8 calls back to back, one wait", r
            assert "8 calls + one block_until_ready, per call" in r["label"], r["label"]
            assert len(r["samples_ms"]) == report["settings"]["repeats"] and r["ratios"]["vs_grouped_gemm"] > 0
    else:
        assert not twins
    api = {"cuda-nccl": "moe_ep_cuda_nccl.api.moe_ep", "jax": "XlaKernels", "jax-ffi": "FfiKernels"}[name]
    for op, r in rows.items():
        assert r["status"] == "ok", r
        assert len(r["samples_ms"]) == report["settings"]["repeats"] and _positive_finite(r["median_ms"])
        assert api in r["label"], r["label"]
        assert r["ratios"]["vs_grouped_gemm"] > 0
    assert rows["forward"]["ratios"]["vs_weight_read"] > 0
    assert "vs_weight_read" not in rows["forward_backward"]["ratios"]
    assert any(line.startswith(f"{name} ") for line in stdout.splitlines())
    if name.startswith("jax"):
        assert report["environment"]["jax_devices"] == 2 and report["environment"]["jax_platform"] == "cpu"
    assert f"--backend {name}" in report["command"]


def test_readme_user_install_adds_the_bench() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install ./bench" in install
    text = (ROOT / "bench" / "pyproject.toml").read_text()
    assert 'bench = "moe_ep_bench.cli:add_command"' in text


def test_device_times_split_a_trace_into_calls() -> None:
    """The jax rows' device time: a trace's GPU events grouped into calls at the host's
    pauses, each call's span from its first start to its last end (overlapping events
    of two streams count once); a trace that does not split into one group per call is
    an error, not a number."""
    from moe_ep_bench.drivers.jax_driver import device_times

    ms = 1_000_000
    pause = 10 * ms
    # call 1: 0..5 ms (two kernels and a copy on a second stream inside them);
    # call 2: 16..20.5 ms with a 0.1 ms gap; call 3: 31..31.25 ms, one kernel.
    events = [(0, 2 * ms), (2 * ms, 5 * ms), (1 * ms, 3 * ms),
              (16 * ms, 18 * ms), (18.1 * ms, 20.5 * ms),
              (31 * ms, 31.25 * ms)]
    got = device_times(list(reversed(events)), 3, pause)
    assert got == pytest.approx([5.0, 4.5, 0.25]), got
    with pytest.raises(RuntimeError, match="form 3 groups .* expected one group per call, 2"):
        device_times(events, 2, pause)
    with pytest.raises(RuntimeError, match="form 2 groups"):  # a call that idles past half the pause splits
        device_times([(0, ms), (7 * ms, 8 * ms)], 1, pause)
    with pytest.raises(RuntimeError, match="no GPU stream events"):
        device_times([], 1, pause)


def test_compare_refuses_a_malformed_baseline_with_a_sentence(tmp_path) -> None:
    from moe_ep_bench.compare import BASELINE_SCHEMA, entries

    with pytest.raises(ValueError, match="expected a JSON object; got list"):
        entries([1, 2], "base.json")
    bad = {"schema": BASELINE_SCHEMA, "rows": [{"identity": {"backend": "x"}, "median_ms": 0}]}
    with pytest.raises(ValueError, match=r"base.json: baseline row 0 needs a median_ms > 0 \(milliseconds\); got 0"):
        entries(bad, "base.json")
    good = {"schema": BASELINE_SCHEMA, "rows": [{"identity": {"backend": "x"}, "median_ms": 1.5}]}
    assert [e.ident for e in entries(good, "base.json")] == [{"backend": "x"}]


def test_a_baseline_is_refreshed_from_itself_and_a_new_report(tmp_path: Path) -> None:
    from moe_ep_bench import compare as C

    old = _report([("cuda-nccl", "backend", "forward", "bf16", 128, 1.0),
                   ("cuda-nccl", "backend", "forward", "bf16", 4096, 5.0)])
    old.update(created="2026-12-01T00:00:00Z", command="moe-ep bench --old")
    first = tmp_path / "first.json"
    assert C.main(["--make-baseline", str(first), _write(tmp_path / "old.json", old)]) == 0
    new = _report([("cuda-nccl", "backend", "forward", "bf16", 4096, 4.0)])
    new.update(created="2026-12-06T00:00:00Z", command="moe-ep bench --new")
    refreshed = tmp_path / "refreshed.json"
    assert C.main(["--make-baseline", str(refreshed), str(first), _write(tmp_path / "new.json", new)]) == 0
    doc = json.loads(refreshed.read_text())
    assert [s["command"] for s in doc["sources"]] == ["moe-ep bench --old", "moe-ep bench --new"]
    by_tokens = {r["identity"]["tokens"]: r for r in doc["rows"]}
    assert by_tokens[128]["median_ms"] == 1.0 and by_tokens[128]["source"] == "old.json"  # kept, its own source
    assert by_tokens[4096]["median_ms"] == 4.0 and by_tokens[4096]["source"] == "new.json"  # replaced
