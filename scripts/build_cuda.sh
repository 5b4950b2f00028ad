#!/usr/bin/env bash
# Build the native core for the device on this machine (no GPU needed, nvcc 13.0):
# CUDA for sm_90a, the CUTLASS grouped GEMMs and the NCCL transport, against the
# NCCL the device runs (nvidia-nccl-cu13 2.28.9). Copies what a device run needs
# into .devbuild/ (ignored by git; the device tool's `carry` takes it):
#   .devbuild/libmoe_ep_native.so    (MOE_EP_NATIVE_LIBRARY points the binding at it)
#   .devbuild/moe_ep_gemm_check      (the grouped-GEMM check program)
#   .devbuild/libmoe_ep_native_core.a (JAX_FFI_CORE=1: the core without NCCL, for the jax-ffi module)
#   .devbuild/cutlass/                 (CARRY_CUTLASS=1: CUTLASS's headers, for compiling jax-ffi there)
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
if [ "${CARRY_CUTLASS:-0}" = 1 ]; then
  # CUTLASS's headers (27 MB), so that the GPU machine compiles the jax-ffi module with its
  # core there (about two minutes on 16 cores) instead of this machine building
  # libmoe_ep_native_core.a: gpu.py's build step sets CUTLASS_DIR to .devbuild/cutlass.
  src="$("$py" -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source'))")"
  rm -rf .devbuild/cutlass && mkdir -p .devbuild/cutlass/tools/util
  cp -r "$src/include" .devbuild/cutlass/include
  cp -r "$src/tools/util/include" .devbuild/cutlass/tools/util/include
fi
if [ -f build-cuda/moe_ep_gemm_check ]; then cp build-cuda/moe_ep_gemm_check .devbuild/; fi
grep -q "^/.devbuild/" .git/info/exclude 2>/dev/null || echo "/.devbuild/" >> .git/info/exclude
ls -la .devbuild
