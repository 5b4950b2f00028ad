#!/usr/bin/env bash
# Run on a device machine (one H200 is enough): the native layer object's
# tensor-core path, from a build made on the CPU machine and carried over.
#
# On the CPU machine first (docs/native.md, "Building for the device"):
#   bash scripts/build_cuda.sh          # -> .devbuild/libmoe_ep_native.so, .devbuild/moe_ep_gemm_check
# then, through the device tool, carrying .devbuild and .whl (pytest and friends):
#   STEPS="gemm tests conformance" bash scripts/gpu_layer_check.sh
#
# Steps (STEPS, default all):
#   gemm         the grouped-GEMM check program (every layout against a float32 reference, then TFLOP/s);
#   tests        tests/test_native_layer.py, tests/test_native_cuda.py, tests/test_cuda_nccl.py;
#   conformance  the full conformance table on cuda-nccl on CUDA at EP 1;
#   probe        gemm_check --initcheck-probe under initcheck: whether the tool tracks the GEMM's TMA stores;
#   sanitizer    compute-sanitizer memcheck, racecheck and initcheck on one forward+backward of each mode;
#   layer        scripts/gpu_cuda_nccl_layer.py --time (graph capture, timing against the torch backend);
#   profile      scripts/gpu_layer_profile.py (CUDA-event times and the top kernels, forward and backward);
#   bench        moe-ep bench at the DeepSeek-V3 per-rank shape (EP 1), JSON under $OUT.
# Logs go to $OUT/gpu-layer (or reports/gpu-layer without OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-reports}/gpu-layer"
mkdir -p "$out"
. scripts/device_env.sh
status=0
steps=" ${STEPS:-gemm tests conformance probe sanitizer layer profile bench} "
want() { [[ "$steps" == *" $1 "* ]]; }
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import moe_ep_native as m; print(m.build_info(), '| nccl transport:', m.has_nccl())"
  "$py" -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$out/environment.txt"

if want gemm; then
  echo "== grouped GEMM check"
  timeout 300 .devbuild/moe_ep_gemm_check 2>&1 | tee "$out/gemm.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want tests; then
  echo "== tests"
  timeout 420 "$py" -m pytest -q -p no:cacheprovider -n 0 -m "not slow" -rs tests/test_native_layer.py tests/test_native_cuda.py \
    tests/test_cuda_nccl.py 2>&1 | tail -n 40 | tee "$out/tests.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want conformance; then
  echo "== conformance: cuda-nccl on CUDA, EP 1"
  timeout 480 "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 --report-md "$out/conformance-ep1.md" \
    2>&1 | tail -n 25 | tee "$out/conformance.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want probe; then
  echo "== does initcheck see the grouped GEMM's (TMA) stores? gemm_check --initcheck-probe under initcheck"
  timeout 120 compute-sanitizer --tool initcheck --print-limit 4 .devbuild/moe_ep_gemm_check --initcheck-probe \
    > "$out/initcheck-probe.txt" 2>&1
  echo "initcheck probe: rc=$?"
  grep -E "^========= +at |initcheck probe|ERROR SUMMARY" "$out/initcheck-probe.txt" | sort | uniq -c | head -12
fi
if want sanitizer; then
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck}; do
    echo "== compute-sanitizer $tool (one forward+backward per mode, no graphs)"
    timeout 240 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 --print-limit 8 \
      "$py" scripts/gpu_cuda_nccl_layer.py --no-graph --tokens 64 --hidden 256 --intermediate 128 \
      > "$out/sanitizer-$tool.txt" 2>&1
    rc=$?
    grep -m 8 -A 6 -E "^========= (Invalid|Uninitialized|Race|Error)" "$out/sanitizer-$tool.txt" || true
    grep -E "SUMMARY|static == synced" "$out/sanitizer-$tool.txt" || true
    echo "compute-sanitizer $tool: rc=$rc"
    [ "$rc" -eq 0 ] || status=1
  done
fi
if want layer; then
  echo "== one layer: static = synced, graph capture, timing against the torch backend"
  timeout 300 "$py" scripts/gpu_cuda_nccl_layer.py --time --tokens 4096 --hidden 7168 --intermediate 2048 \
    --experts-per-rank 32 --topk 8 --iters 5 2>&1 | tail -n 30 | tee "$out/layer.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want profile; then
  echo "== where the time goes: scripts/gpu_layer_profile.py (EP 1, DeepSeek-V3 per-rank shape)"
  timeout 300 "$py" scripts/gpu_layer_profile.py 2>&1 | tee "$out/profile.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
  echo "== moe-ep bench, EP 1, DeepSeek-V3 per-rank shape"
  timeout 540 "$py" -m moe_ep_spec.cli bench ${BENCH_ARGS:---device cuda --ep-size 1 --backend torch --backend cuda-nccl \
    --tokens 128 --tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 --topk 8 --format bf16 \
    --intermediate-format bf16 --op forward --op forward_backward} \
    --json "$out/bench.json" 2>&1 | tail -n 40 | tee "$out/bench.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
