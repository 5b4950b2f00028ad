#!/usr/bin/env bash
# One device call (2026-12-01, third session): the exchange timing after the dispatch
# changes, the bench of cuda-nccl in bf16, mxfp8 and nvfp4 (forward, dispatch, combine)
# and of jax-ffi (forward, bf16 and mxfp8), from a build carried in .devbuild.
#   OUT=/tmp/o bash scripts/gpu_session_run2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
o="${OUT:-reports}/run2"; mkdir -p "$o"
. scripts/device_env.sh
shape="--device cuda --ep-size 1 --tokens 128 --tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 --topk 8 --intermediate-format bf16 --no-progress"
timeout 90 "$py" scripts/gpu_exchange_check.py --time > "$o/exchange-time.txt" 2>&1; echo "exchange rc=$?"
grep -E "^(EP|dispatch|combine|graph)" "$o/exchange-time.txt"; grep -E "dispatch_|plan_" "$o/exchange-time.txt" | awk '{print $1, $(NF-2), $(NF-1)}'
timeout 280 "$py" -m moe_ep_spec.cli bench $shape --backend cuda-nccl --format bf16 --format mxfp8 --format nvfp4 \
  --op forward --op dispatch --op combine --json "$o/bench-cuda-nccl.json" > "$o/bench-cuda-nccl.txt" 2>&1
echo "bench cuda-nccl rc=$?"; grep -E "forward|dispatch|combine" "$o/bench-cuda-nccl.txt" | cut -c1-150 | head -40
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 120 env MOE_EP_NATIVE_CUDA=ON MOE_EP_CUDA_ARCHS=90a MOE_EP_NATIVE_CORE_LIBRARY="$PWD/.devbuild/libmoe_ep_native_core.a" \
  "$py" -m pip install -q --no-build-isolation --no-deps -e ./backends/jax -e ./backends/jax_ffi > "$o/jaxffi-build.txt" 2>&1
echo "jaxffi build rc=$?"
timeout 200 "$py" -m moe_ep_spec.cli bench $shape --backend jax-ffi --format bf16 --format mxfp8 --op forward \
  --json "$o/bench-jax-ffi.json" > "$o/bench-jax-ffi.txt" 2>&1
echo "bench jax-ffi rc=$?"; grep -E "forward" "$o/bench-jax-ffi.txt" | cut -c1-150 | head -20; tail -5 "$o/bench-jax-ffi.txt"
