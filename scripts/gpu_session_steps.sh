# Sourced by the one-call session scripts (scripts/gpu_session_*.sh) after
# scripts/device_env.sh, with o (the log directory) and py set: the steps several calls share.
# The eighth session's mxfp8-weights GEMM steps (RUN=31..37): its checks and timings, their
# memcheck, its SASS counts, and the decode bench alternated between the GEMM reading the
# codes (MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS=1) and the kept bf16 decode (0), twice.
mxw_gemm_check() { step gemm-check-mxfp8-weights "$1" .devbuild/moe_ep_gemm_check --mxfp8-weights; }
mxw_memcheck() {
  TAIL=6 step sanitizer-memcheck-mxfp8-weights "$1" compute-sanitizer --tool memcheck --error-exitcode 9 \
    .devbuild/moe_ep_gemm_check --mxfp8-weights --no-time
}
mxw_sass() {
  TAIL=12 step sass-mxfp8-weights 60 bash scripts/sass_counts.sh .devbuild/moe_ep_gemm_check mxfp8_weights_gemm_kernel
}
# decode_bench LABEL INTERMEDIATE [VAR=VALUE...]: the cuda-nccl bench at 128 tokens, mxfp8,
# with that intermediate_format, under those variables; log and JSON bench-cuda-nccl-decode-LABEL.
decode_bench() {
  local label="$1" inter="$2"
  shift 2
  step "bench-cuda-nccl-decode-$label" 60 env "$@" "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 \
    --backend cuda-nccl --tokens 128 "${shape[@]}" --format mxfp8 --intermediate-format "$inter" --op forward \
    --json "$o/bench-cuda-nccl-decode-$label.json" --no-progress
}
decode_bench_ab() {
  local i=0 mx
  for mx in 1 0 1 0; do
    i=$((i + 1))
    TAIL=8 decode_bench "$i-mxw$mx" bf16 MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS=$mx
  done
}
# The ninth session's steps (RUN=38..45): the mxfp8-weights forward's CUDA tests (SECONDS,
# then more test files), the cuda-nccl table at EP 1 over NCCL (SECONDS).
mxw_tests() {
  local secs="$1"
  shift
  TAIL=4 step tests-cuda "$secs" "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py \
    "$@" -k "test_cuda_"
}
conformance_nccl_ep1() {
  TAIL=3 step conformance-nccl-ep1 "$1" env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --report-md "$o/conformance-nccl-ep1.md"
}
jaxffi_build() {
  step jaxffi-build 150 env MOE_EP_NATIVE_CUDA=ON MOE_EP_CUDA_ARCHS=90a \
    MOE_EP_NATIVE_CORE_LIBRARY="$PWD/.devbuild/libmoe_ep_native_core.a" \
    "$py" -m pip install --no-build-isolation --no-deps -e ./backends/jax -e ./backends/jax_ffi
}
shape=(--hidden 7168 --intermediate 2048 --experts 32 --topk 8)
