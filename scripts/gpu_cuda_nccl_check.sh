#!/usr/bin/env bash
# Run on a device machine (see docs/cuda-nccl.md): builds the native core with
# CUDA (sm_90) and the NCCL transport from this checkout, installs the
# cuda-nccl backend, then checks it:
#   1. tests/test_cuda_nccl.py (transport, static mode, CUDA-graph capture and
#      replay, errors) and tests/test_native_cuda.py (the kernels);
#   2. compute-sanitizer (memcheck, initcheck) on one forward+backward of each
#      mode at EP 1 (scripts/gpu_cuda_nccl_layer.py);
#   3. the full conformance table on cuda-nccl on GPU at each EP size;
#   4. scripts/gpu_cuda_nccl_layer.py --time at the largest EP size (ratios to the torch backend).
#
#   bash scripts/gpu_cuda_nccl_check.sh EP_SIZES...      e.g. `bash scripts/gpu_cuda_nccl_check.sh 1 2` on 2 GPUs
#   STEPS="tests conformance" bash scripts/gpu_cuda_nccl_check.sh 2    some steps only (default:
#                                    tests sanitizer conformance timing; the build always runs)
#
# Writes logs to reports/gpu-cuda-nccl/ and packs them into $OUT/gpu-cuda-nccl-logs.tgz when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
out="reports/gpu-cuda-nccl"
mkdir -p "$out"
eps=("$@")
[ ${#eps[@]} -gt 0 ] || eps=(1)
export PYTHONUNBUFFERED=1 NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then  # the device image has no pytest (docs/gpu.md)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$py" -m pip install -q --no-build-isolation --no-deps -e . -e ./conformance -e ./backends/torch \
  -e ./backends/cuda_nccl 2>&1 | grep -v "^WARNING" || true
export MOE_EP_NATIVE_CUDA=1 MOE_EP_NATIVE_NCCL=1 MOE_EP_CUDA_ARCHS="${MOE_EP_CUDA_ARCHS:-90}"
status=0
pack() { if [ -n "${OUT:-}" ]; then tar -czf "$OUT/gpu-cuda-nccl-logs.tgz" -C "$out" .; fi; }  # after every step
echo "== build backends/native with CUDA (archs $MOE_EP_CUDA_ARCHS) and NCCL"
rm -f backends/native/build/native-cuda-nccl/CMakeCache.txt  # find NCCL afresh (the lookup is cached)
"$py" -m pip install --no-build-isolation --no-deps -e backends/native -Cbuild-dir="$PWD/backends/native/build/native-cuda-nccl" \
  > "$out/build-native.log" 2>&1 \
  || { echo "build failed:"; tail -n 40 "$out/build-native.log"; status=1; }
grep -h "^MOE_EP_NCCL_\(LIBRARY\|INCLUDE_DIR\):" backends/native/build/native-cuda-nccl/CMakeCache.txt 2>/dev/null \
  | tee "$out/nccl-found.txt" || true
moe_ep() { "$py" -m moe_ep_spec.cli "$@"; }
steps=" ${STEPS:-tests sanitizer conformance timing} "
want() { [[ "$steps" == *" $1 "* ]]; }
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvcc --version | tail -n 2
  "$py" -c "import moe_ep_native as m; print(m.build_info(), '| nccl transport:', m.has_nccl())"
  "$py" -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  "$py" -c "import nvidia.nccl as m, os; print('nvidia-nccl wheel at', list(m.__path__)[0])" || true
  ldd "$("$py" -c "import moe_ep_native as m; print(m.library_path())")" | grep -i nccl || true
} 2>&1 | tee "$out/environment.txt"
moe_ep backends | tee "$out/backends.txt"
pack

if want tests; then
  echo "== tests: cuda-nccl front-end and transport, native CUDA kernels"
  "$py" -m pytest -q -p no:cacheprovider -rs tests/test_cuda_nccl.py tests/test_native_cuda.py 2>&1 | tail -n 30 \
    | tee "$out/tests.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  pack
fi
if want sanitizer; then
  echo "== compute-sanitizer: one forward+backward per mode (synced, static) at EP 1"
  for tool in memcheck initcheck; do
    # --report-api-errors no: torch's and NCCL's own probing (cudaErrorNoKernelImageForDevice from
    # cudaFuncGetAttributes at init) is not a memory error of this code.
    timeout 300 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 --print-limit 20 \
      --target-processes all "$py" scripts/gpu_cuda_nccl_layer.py --ranks 1 --tokens 64 --hidden 128 \
      --intermediate 64 --no-graph 2>&1 | grep -v "UserWarning: The AccumulateGrad\|return Variable._execution" | tail -n 30 \
      | tee "$out/sanitizer-$tool.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    pack
  done
fi
if want conformance; then
  for ep in "${eps[@]}"; do
    echo "== conformance: cuda-nccl on CUDA, ep $ep"
    moe_ep conformance --backend cuda-nccl --device cuda --ep-size "$ep" --timeout 300 \
      --report-md "$out/conformance-cuda-nccl-ep$ep.md" 2>&1 | tail -n 25 \
      | tee "$out/conformance-cuda-nccl-ep$ep.log"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    pack
  done
fi
if want timing; then
  ep="${eps[${#eps[@]}-1]}"
  echo "== timing at EP $ep (median of 20, against the torch backend in the same run)"
  timeout 240 "$py" scripts/gpu_cuda_nccl_layer.py --ranks "$ep" --tokens 1024 --hidden 1024 --intermediate 512 --time 2>&1 \
    | tail -n 15 | tee "$out/timing-ep$ep.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "status: $status" | tee "$out/status.txt"
pack
exit $status
