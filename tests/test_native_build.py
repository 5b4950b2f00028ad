"""The CUDA configure of backends/native around CUTLASS (configure only, no compile):
without CUTLASS's headers a CUDA configure stops with a message that says how to get
them; MOE_EP_NATIVE_CUTLASS=OFF configures without them. Needs cmake and nvcc (CI has
both); the full CUDA compile is a step of .ci/run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "backends" / "native"

pytestmark = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which("nvcc") is None, reason="needs cmake and nvcc"
)


def _configure(tmp_path: Path, *defines: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUTLASS_DIR"}
    return subprocess.run(
        ["cmake", "-S", str(NATIVE), "-B", str(tmp_path / "build"), "-DMOE_EP_NATIVE_CUDA=ON",
         "-DCMAKE_CUDA_ARCHITECTURES=90a", *defines],
        capture_output=True, text=True, env=env, timeout=300,
    )


def test_cuda_configure_without_cutlass_names_the_wheel(tmp_path):
    # No Python to ask for the nvidia-cutlass wheel, no CUTLASS_DIR: CUTLASS is not found.
    r = _configure(tmp_path, "-DPython3_EXECUTABLE=/bin/false")
    assert r.returncode != 0
    out = " ".join((r.stdout + r.stderr).split())
    assert "pip install nvidia-cutlass==4.2.0.0" in out
    assert "MOE_EP_NATIVE_CUTLASS=OFF" in out


def test_cuda_configure_with_cutlass_off(tmp_path):
    r = _configure(tmp_path, "-DMOE_EP_NATIVE_CUTLASS=OFF")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CUTLASS" not in r.stdout
