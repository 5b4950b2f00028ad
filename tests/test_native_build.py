"""The CUDA configure of backends/native around CUTLASS (configure only, no compile):
without CUTLASS's headers a CUDA configure stops with a message that says how to get
them; MOE_EP_NATIVE_CUTLASS=OFF configures without them. And backends/jax_ffi's configure
with a prebuilt core (MOE_EP_NATIVE_CORE_LIBRARY): a core that references NCCL stops it
with a message that says how to build the right one. Needs cmake and nvcc (CI has both);
the full CUDA compile is a step of .ci/run."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "backends" / "native"
JAX_FFI = ROOT / "backends" / "jax_ffi"

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


def _static_library(tmp_path: Path, name: str, source: str) -> Path:
    """A one-object static library compiled from C source by the system's cc and ar."""
    src, obj, lib = tmp_path / f"{name}.c", tmp_path / f"{name}.o", tmp_path / f"lib{name}.a"
    src.write_text(source)
    subprocess.run(["cc", "-c", str(src), "-o", str(obj)], check=True, timeout=120)
    subprocess.run(["ar", "rcs", str(lib), str(obj)], check=True, timeout=120)
    return lib


def _configure_jax_ffi(tmp_path: Path, core: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["cmake", "-S", str(JAX_FFI), "-B", str(tmp_path / "jax_ffi_build"), f"-DPython_EXECUTABLE={sys.executable}",
         f"-DMOE_EP_NATIVE_CORE_LIBRARY={core}"],
        capture_output=True, text=True, timeout=300,
    )


needs_jax_ffi_tools = pytest.mark.skipif(
    shutil.which("cc") is None or shutil.which("ar") is None or importlib.util.find_spec("jax") is None
    or importlib.util.find_spec("nanobind") is None,
    reason="needs cc, ar, jax and nanobind",
)


@needs_jax_ffi_tools
def test_jax_ffi_configure_refuses_a_core_built_with_nccl(tmp_path):
    # A core built with MOE_EP_NATIVE_NCCL=ON calls NCCL, which the module does not link:
    # its import would fail on the undefined symbol, so the configure says so first.
    core = _static_library(tmp_path, "nccl_core", "void ncclDevCommCreate(void);\nvoid f(void) { ncclDevCommCreate(); }\n")
    r = _configure_jax_ffi(tmp_path, core)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0, out
    assert "MOE_EP_NATIVE_NCCL=ON" in out and "ncclDevCommCreate" in out, out
    assert "-DMOE_EP_NATIVE_NCCL=OFF" in out, out


@needs_jax_ffi_tools
def test_jax_ffi_configure_takes_a_core_without_nccl(tmp_path):
    core = _static_library(tmp_path, "plain_core", "int f(int x) { return x + 1; }\n")
    r = _configure_jax_ffi(tmp_path, core)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the native core prebuilt" in r.stdout
