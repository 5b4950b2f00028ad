#!/usr/bin/env bash
# Build the native core for the device on this machine (no GPU needed, nvcc 13.0):
# CUDA for sm_90a, the CUTLASS grouped GEMMs and the NCCL transport, against the
# NCCL the device runs (nvidia-nccl-cu13 2.28.9). Copies what a device run needs
# into .devbuild/ (ignored by git; the device tool's `carry` takes it):
#   .devbuild/libmoe_ep_native.so    (MOE_EP_NATIVE_LIBRARY points the binding at it)
#   .devbuild/moe_ep_gemm_check      (the grouped-GEMM check program)
#   .devbuild/libmoe_ep_native_core.a (JAX_FFI_CORE=1: the core without NCCL, for the jax-ffi module)
#
#   bash scripts/build_cuda.sh                 # JOBS=2 for two nvcc at once (3.4 GB each)
# On the GPU machine, python scripts/gpu.py reuses what it copied (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
"$py" -m pip install -q --disable-pip-version-check --no-deps "nvidia-cutlass==4.2.0.0" "nvidia-nccl-cu13==2.28.9"
cmake -S backends/native -B build-cuda -G Ninja -DMOE_EP_NATIVE_CUDA=ON -DMOE_EP_NATIVE_NCCL=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$(command -v "$py")" > /tmp/moe_ep_build_cuda_configure.log
cmake --build build-cuda -j "${JOBS:-1}"
mkdir -p .devbuild
cp build-cuda/libmoe_ep_native.so .devbuild/
if [ "${JAX_FFI_CORE:-0}" = 1 ]; then
  # The core as a static library without NCCL, for the jax-ffi module: a device run then
  # compiles the module alone (MOE_EP_NATIVE_CORE_LIBRARY=.devbuild/libmoe_ep_native_core.a).
  cmake -S backends/native -B build-cuda-core -G Ninja -DMOE_EP_NATIVE_CUDA=ON -DMOE_EP_NATIVE_NCCL=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$(command -v "$py")" > /tmp/moe_ep_build_cuda_core_configure.log
  cmake --build build-cuda-core -j "${JOBS:-1}" --target moe_ep_native_core
  cp build-cuda-core/libmoe_ep_native_core.a .devbuild/
  grep -q "^/build-cuda-core/" .git/info/exclude 2>/dev/null || echo "/build-cuda-core/" >> .git/info/exclude
fi
if [ -f build-cuda/moe_ep_gemm_check ]; then cp build-cuda/moe_ep_gemm_check .devbuild/; fi
grep -q "^/.devbuild/" .git/info/exclude 2>/dev/null || echo "/.devbuild/" >> .git/info/exclude
ls -la .devbuild
