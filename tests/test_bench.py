"""``moe-ep bench`` (the bench/ distribution): a CPU smoke run of the harness.

A ``--quick`` run on the reference and, when installed, the torch backend at EP
1 and 2 (gloo on loopback), with the JSON report's schema, its numbers and its
plots checked; plus the parts that need no run. When moe-ep-bench is not
installed, bench/ is put on sys.path (the spawned rank processes inherit it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
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
from moe_ep_bench.model import BenchSettings, auto_experts, make_routing, row_bytes  # noqa: E402
from moe_ep_bench.results import SCHEMA, STATUSES, Row, add_ratios  # noqa: E402



def _have_torch() -> bool:
    try:
        return moe_ep_spec.get_backend("torch").is_available()
    except moe_ep_spec.MoeEpError:
        return False


HAVE_TORCH = _have_torch()
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
ROW_KEYS = {"backend", "kind", "op", "tokens", "format", "status", "reason", "median_ms", "gbps", "ratios", "bytes",
            "samples_ms", "label", "ep_size", "device"}


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
            "--timeout", "120"] + backends
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
        for key, value in row["ratios"].items():
            assert key in ("vs_nccl", "vs_peer_copy", "vs_roofline")
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
                for base in ("gloo", "memcpy"):
                    assert (base, "dispatch", fmt, t) in ok and (base, "combine", fmt, t) in ok
                assert ("matmul", "forward", fmt, t) in ok and ("matmul", "forward_backward", fmt, t) in ok
        if HAVE_TORCH:
            assert ("torch", "forward_backward", "bf16", t) in ok
            unsupported = [r for r in report["rows"] if r["backend"] == "torch" and r["format"] == "mxfp8"
                           and r["op"] == "forward_backward"]
            assert unsupported and all(r["status"] == "unsupported" for r in unsupported)
    if HAVE_TORCH:
        torch_rows = [r for r in report["rows"] if r["backend"] == "torch" and r["status"] == "ok"]
        for r in torch_rows:
            want = {"vs_nccl", "vs_peer_copy"} if r["op"] in ("dispatch", "combine") else {"vs_nccl", "vs_roofline"}
            assert want <= set(r["ratios"]), r
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
    for col in ("median_ms", "GB/s", "vs_nccl", "vs_peer", "vs_roofline"):
        assert col in header
    assert any(line.startswith("reference  ") and " dispatch " in line for line in stdout.splitlines())
    assert "[1/" in stderr or "%|" in stderr  # the plain counter or tqdm
    assert "parent imported torch: False" in stdout


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


def test_backend_without_a_driver_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    registry = moe_ep_spec.get_registry()
    registry.register(_NoDriver())
    try:
        code = bench_cli.main([
            "--quick", "--ep-size", "1", "--backend", "reference", "--backend", _NoDriver.name, "--op", "dispatch",
            "--format", "bf16", "--tokens", "8", "--no-baselines", "--no-progress", "--json", str(tmp_path / "b.json"),
        ])
    finally:
        registry.unregister(_NoDriver.name)
    assert code == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    mine = [r for r in rows if r["backend"] == _NoDriver.name]
    assert len(mine) == 1 and mine[0]["status"] == "no bench driver" and mine[0]["median_ms"] is None
    assert [r["status"] for r in rows if r["backend"] == "reference"] == ["ok"]
    assert f"{_NoDriver.name}: no bench driver" in capsys.readouterr().out


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

    rows = [row("torch", "dispatch", 4.0), row("nccl", "dispatch", 1.0, "baseline"),
            row("peer-copy", "dispatch", 0.5, "baseline"), row("nccl", "combine", 2.0, "baseline"),
            row("torch", "forward", 10.0), row("grouped-gemm", "forward", 5.0, "baseline")]
    add_ratios(rows)
    assert rows[0].ratios == {"vs_nccl": 0.25, "vs_peer_copy": 0.125}
    assert rows[4].ratios == {"vs_roofline": 0.5, "vs_nccl": pytest.approx(0.3)}
    assert rows[5].ratios == {"vs_roofline": 1.0}


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

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert "--ep-size" in capsys.readouterr().out
