#!/usr/bin/env bash
# One device call (2026-12-01, third session): the exchange after programmatic dependent
# launch (timing at 4096 and 128 tokens, graph replays, kernels), its CUDA tests and the EP 2
# loopback smoke, the world-level mxfp8 fix on one GPU, and where the block-scaled forward's
# time goes (device mode, mxfp8 and nvfp4).
#   OUT=/tmp/o bash scripts/gpu_session_run3.sh
set -uo pipefail
cd "$(dirname "$0")/.."
o="${OUT:-reports}/run3"; mkdir -p "$o"
. scripts/device_env.sh
step() {  # step NAME SECONDS CMD...: log under $o, print the tail
  local name="$1" secs="$2"; shift 2
  timeout -k 5 "$secs" "$@" > "$o/$name.txt" 2>&1; echo "== $name rc=$?"; tail -n "${TAIL:-6}" "$o/$name.txt"
}
TAIL=40 step exchange-time 120 "$py" scripts/gpu_exchange_check.py --time --tokens 4096 --tokens 128
step exchange-smoke 90 "$py" scripts/gpu_exchange_check.py --smoke 2
step tests-layer-exchange 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
  tests/test_native_exchange.py tests/test_native_exchange_nccl.py -k "cuda or nccl"
step tests-world-mxfp8 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_cuda_nccl_device_conformance.py -k one_gpu
for f in mxfp8 nvfp4; do
  TAIL=22 step "profile-$f" 150 "$py" scripts/gpu_layer_profile.py --mode device --format "$f" --intermediate-format bf16 --iters 5 --top 16
done
