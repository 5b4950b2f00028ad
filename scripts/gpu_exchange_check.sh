#!/usr/bin/env bash
# Run on a device machine (ONE H200 is enough: the ranks are processes sharing it
# through CUDA IPC): the native layer's device exchange (docs/cuda-nccl.md, "The device exchange").
#
# On the CPU machine first:
#   bash scripts/build_cuda.sh          # -> .devbuild/libmoe_ep_native.so (with src/cuda/exchange.cu)
# then through the device tool, carrying .devbuild and .whl (pytest for the device image):
#   bash scripts/gpu_exchange_check.sh
#
# Steps (STEPS, default all; every one bounded, about 8 minutes in all):
#   tests      tests/test_native_exchange.py (CPU twin, front-end on CPU, and the CUDA loopback tests at EP 2 and 4);
#   smoke      scripts/gpu_exchange_check.py --smoke 2 and 4: the kernels against the spec's order bit for bit,
#              eager steps then CUDA-graph replays on new inputs;
#   sanitizer  compute-sanitizer memcheck and racecheck on the EP 2 smoke (both processes);
#   timing     EP 1 dispatch/combine of 4096 tokens (hidden 7168, top-8) against a device copy of the per-route rows;
#   conformance  the whole conformance table on cuda-nccl over the device exchange (MOE_EP_CUDA_NCCL_EXCHANGE=device)
#              at EP 2 and at EP 4, every rank on cuda:0 (--device cuda-shared): both layouts, every operation,
#              the same kernels (docs/cuda-nccl.md, "The world-level backend over the device exchange").
#              Not in the default STEPS (at most 250 s per EP size): STEPS=conformance bash scripts/gpu_exchange_check.sh;
#              CONFORMANCE_EP=2 (or 4) runs one size, CONFORMANCE_ARGS=--quick the representative subset.
# Logs go to $OUT/gpu-exchange (or reports/gpu-exchange without OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-reports}/gpu-exchange"
mkdir -p "$out"
. scripts/device_env.sh
status=0
steps=" ${STEPS:-tests smoke sanitizer timing} "
want() { [[ "$steps" == *" $1 "* ]]; }
run() {  # run NAME SECONDS CMD...: print everything, keep a log, remember a failure
  local name="$1" secs="$2"; shift 2
  echo "== $name (at most ${secs}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc after $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || status=1
}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_mode --format=csv,noheader
  "$py" -c "import moe_ep_native as m; print(m.build_info())"
  "$py" -c "import torch; print('torch', torch.__version__)"
} 2>&1 | tee "$out/environment.txt"

if want tests; then
  run tests 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs -x tests/test_native_exchange.py
fi
if want smoke; then
  run smoke-ep2 45 "$py" scripts/gpu_exchange_check.py --smoke 2
  run smoke-ep4 60 "$py" scripts/gpu_exchange_check.py --smoke 4
fi
if want sanitizer; then
  for tool in memcheck racecheck; do
    run "sanitizer-$tool" 75 compute-sanitizer --tool "$tool" --target-processes all --report-api-errors no \
      --error-exitcode 9 "$py" scripts/gpu_exchange_check.py --smoke 2
  done
fi
if want timing; then
  run timing 90 "$py" scripts/gpu_exchange_check.py --time ${TIMING_ARGS:-}
fi
if want conformance; then
  for ep in ${CONFORMANCE_EP:-2 4}; do
    run "conformance-ep$ep" 250 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_CUDA_NCCL_TIMEOUT_S=60 \
      MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl \
      --ep-size "$ep" --device cuda-shared --timeout 200 --report-json "$out/conformance-ep$ep.json" \
      --report-md "$out/conformance-ep$ep.md" ${CONFORMANCE_ARGS:-}
  done
fi
echo "gpu_exchange_check: $([ "$status" -eq 0 ] && echo PASS || echo FAIL) (logs in $out)"
exit "$status"
