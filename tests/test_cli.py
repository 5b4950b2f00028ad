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
