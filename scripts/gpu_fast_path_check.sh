#!/usr/bin/env bash
# Run on a device machine (one H200 is enough): the fast path of the native layer object —
# the tensor-core experts, the device exchange, the route planner, the block-scaled
# decode — its CUDA tests, its timings and the bench, from a build made on the CPU
# machine (bash scripts/build_cuda.sh) and carried over with the wheels (.devbuild, .whl).
#
#   STEPS="tests time bench" bash scripts/gpu_fast_path_check.sh
#
# Steps (STEPS, default all; each bounded):
#   tests        the CUDA tests of the fast path: tests/test_native_cuda.py (route planner),
#                test_native_decode_bf16.py, test_cuda_nccl_block_scaled.py, the CUDA parts of
#                test_native_layer.py and test_native_exchange.py, and test_native_exchange_nccl.py
#                (the NCCL peer provider at EP 1);
#   time         scripts/gpu_plan_routes_time.py, gpu_exchange_check.py --time, gpu_block_scaled_check.py;
#   conformance  the conformance table of cuda-nccl on CUDA at EP 1;
#   profile      scripts/gpu_layer_profile.py --mode device (where the time of one layer goes);
#   bench        moe-ep bench at the DeepSeek-V3 per-rank shape (EP 1, --cuda-nccl-mode device), JSON under $OUT;
#   sanitizer    compute-sanitizer memcheck and racecheck on the exchange (EP 2 loopback) and the route planner;
#   jaxffi       the jax-ffi module compiled over the carried core (.devbuild/libmoe_ep_native_core.a, from
#                JAX_FFI_CORE=1 bash scripts/build_cuda.sh), its tests, its conformance table on CUDA at EP 1
#                and its bench (BENCH_JAX_ARGS), memcheck on the quick table at EP 1 (11 layers, every format);
# Logs go to $OUT/gpu-fast (or reports/gpu-fast without OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-reports}/gpu-fast"
mkdir -p "$out"
. scripts/device_env.sh
status=0
steps=" ${STEPS:-tests time conformance profile bench sanitizer jaxffi} "
want() { [[ "$steps" == *" $1 "* ]]; }
run() {  # run NAME SECONDS CMD...: keep a log, print its tail, remember a failure
  local name="$1" secs="$2"; shift 2
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  echo "== $name: rc=$rc after $((SECONDS - t0))s"
  tail -n "${TAIL:-12}" "$out/$name.txt"
  [ "$rc" -eq 0 ] || status=1
}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import moe_ep_native as m; print(m.build_info(), '| nccl transport:', m.has_nccl())"
  "$py" -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

if want tests; then
  run tests-native 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_cuda.py \
    tests/test_native_decode_bf16.py tests/test_cuda_nccl_block_scaled.py
  run tests-layer-exchange 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
    tests/test_native_exchange.py -k cuda
  run tests-exchange-nccl 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange_nccl.py
fi
if want time; then
  run plan-routes 90 "$py" scripts/gpu_plan_routes_time.py
  run exchange 90 "$py" scripts/gpu_exchange_check.py --time
  run block-scaled-decode 120 "$py" scripts/gpu_block_scaled_check.py --only decode
  run block-scaled-forward 150 "$py" scripts/gpu_block_scaled_check.py --only forward --iters 5
fi
if want conformance; then
  run conformance 200 "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 --report-md "$out/conformance-ep1.md"
fi
if want profile; then
  TAIL=30 run profile 150 "$py" scripts/gpu_layer_profile.py --mode device --intermediate-format bf16 --iters 5 --top 16
fi
if want bench; then
  TAIL=30 run bench 300 "$py" -m moe_ep_spec.cli bench ${BENCH_ARGS:---device cuda --ep-size 1 --backend torch \
    --backend cuda-nccl --tokens 128 --tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 --topk 8 \
    --format bf16 --intermediate-format bf16} --json "$out/bench.json" --no-progress
fi
if want sanitizer; then
  for tool in memcheck racecheck; do
    run "sanitizer-exchange-$tool" 120 compute-sanitizer --tool "$tool" --target-processes all --report-api-errors no \
      --error-exitcode 9 "$py" scripts/gpu_exchange_check.py --smoke 2
    run "sanitizer-plan-routes-$tool" 120 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
      "$py" -m pytest -q -p no:cacheprovider -n 0 tests/test_native_cuda.py -k plan_routes
  done
fi
if want jaxffi; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  run jaxffi-build 300 env MOE_EP_NATIVE_CUDA=ON MOE_EP_CUDA_ARCHS=90a \
    MOE_EP_NATIVE_CORE_LIBRARY="$PWD/.devbuild/libmoe_ep_native_core.a" \
    "$py" -m pip install -v --no-build-isolation --no-deps -e ./backends/jax -e ./backends/jax_ffi
  run jaxffi-info 60 "$py" -c "import jax, moe_ep_jax_ffi.native as n; print(jax.devices(), n.extension().build_info(), n.platforms())"
  run tests-jax-ffi 400 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py
  run conformance-jax-ffi 450 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 300 --report-md "$out/conformance-jax-ffi-ep1.md"
  TAIL=30 run bench-jax-ffi 400 "$py" -m moe_ep_spec.cli bench ${BENCH_JAX_ARGS:---device cuda --ep-size 1 \
    --backend jax-ffi --tokens 128 --tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 --topk 8 \
    --format bf16 --intermediate-format bf16} --json "$out/bench-jax-ffi.json" --no-progress
  run sanitizer-jax-ffi-memcheck 400 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 --quick --timeout 300
fi
echo "gpu_fast_path_check: $([ "$status" -eq 0 ] && echo PASS || echo FAIL) (logs in $out)"
exit "$status"
