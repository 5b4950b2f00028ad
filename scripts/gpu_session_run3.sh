#!/usr/bin/env bash
# One device call (2026-12-01, third session): the exchange after programmatic dependent
# launch (timing at 4096 and 128 tokens, graph replays, kernels; the dispatch's two copy
# loops; the bench's dispatch and combine rows), its CUDA tests and the EP 2 loopback
# smoke, the world-level mxfp8 fix on one GPU, jax-ffi under memcheck, and where the mxfp8
# forward's time goes (device mode).
#   OUT=/tmp/o bash scripts/gpu_session_run3.sh
set -uo pipefail
cd "$(dirname "$0")/.."
o="${OUT:-reports}/run3"; mkdir -p "$o"
. scripts/device_env.sh
TAIL=30 step exchange-time 100 "$py" scripts/gpu_exchange_check.py --time --tokens 4096 --tokens 128
# (MOE_EP_DISPATCH_PLACE was a timing switch of that build: the record-prefetching loop gained nothing, 316.5 vs
# 315.1 us, and was removed after this run; the variable is ignored now.)
TAIL=8 step exchange-time-place-plain 60 env MOE_EP_DISPATCH_PLACE=plain "$py" scripts/gpu_exchange_check.py --time --tokens 4096
step exchange-smoke 60 "$py" scripts/gpu_exchange_check.py --smoke 2
step tests-layer-exchange 170 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
  tests/test_native_exchange.py tests/test_native_exchange_nccl.py -k "cuda or nccl"
step tests-world-mxfp8 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_cuda_nccl_device_conformance.py -k one_gpu
export XLA_PYTHON_CLIENT_PREALLOCATE=false
step jaxffi-build 60 env MOE_EP_NATIVE_CUDA=ON MOE_EP_CUDA_ARCHS=90a MOE_EP_NATIVE_CORE_LIBRARY="$PWD/.devbuild/libmoe_ep_native_core.a" \
  "$py" -m pip install -q --no-build-isolation --no-deps -e ./backends/jax -e ./backends/jax_ffi
TAIL=8 step sanitizer-jax-ffi-memcheck 130 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
  "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 --quick --timeout 120
TAIL=12 step bench-exchange 80 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --tokens 128 --tokens 4096 \
  --hidden 7168 --intermediate 2048 --experts 32 --topk 8 --format bf16 --backend cuda-nccl --op dispatch --op combine \
  --json "$o/bench-exchange.json" --no-progress
TAIL=22 step profile-mxfp8 80 "$py" scripts/gpu_layer_profile.py --mode device --format mxfp8 --intermediate-format bf16 --iters 3 --top 14
