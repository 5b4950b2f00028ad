#!/usr/bin/env bash
# The device calls of 2026-12-03 (one H200), one per RUN, each under the call's 600 s:
#   RUN=46: (the day's first session) where the decode forward's time goes outside its two
#          GEMMs: one forward's kernels in order with the idle gaps between them (mxfp8, 128
#          tokens, intermediate_format none and bf16); the mxfp8-weights GEMM with its grid's
#          rows ordered by the experts' rows, most first (heavy first), checked and timed
#          against the plain order, alternated; Nsight Compute's pipe use on FC1's spread.
#   RUN=47: after run 46 (heavy first was slower: FC1 0.661 against 0.714; the glue around the
#          two GEMMs about 0.15 ms, of it 26 us in the five dispatch kernels and 22 us in the five
#          combine kernels at one rank): the one-rank dispatch (two kernels) and combine (one):
#          the decode bench, the timeline, the exchange's CUDA tests at EP 1 and 2 (errors
#          included), the cuda-nccl table at EP 1.
#   RUN=48: the exchange's EP 1 CUDA tests with their configuration mended (run 47's failed on
#          a recv_capacity below the good routing's rows).
#   RUN=49: compute-sanitizer on the one-rank kernels: memcheck and racecheck on the EP 1
#          exchange timing (128 tokens, both modes), memcheck on the EP 1 exchange tests.
#   RUN=50: (the day's third session) the decode glue cut: dispatch_one_plan over one thread
#          per route, the error record in one kernel (moe_ep_record_step), the forward's
#          finish in one kernel: the EP 1 exchange timing (both modes), the exchange's CUDA
#          tests at EP 1 and 2, the record's CUDA test, the cuda-nccl table at EP 1, the
#          decode bench (none twice, bf16), the timeline, memcheck on the EP 1 tests.
#   RUN=51: after run 50 (0.459 / 0.456 none, 0.573 bf16): the mxfp8 combine format's round trip
#          done by the combine as it reads y (MOE_EP_CUDA_NCCL_ROUND_TRIP=combine, the new
#          default) against the experts stage's pass (=experts), alternated in the decode bench;
#          the timeline; the round-trip CUDA tests (EP 1 and 2, both modes, slot and rank
#          order: bit for bit); the EP 1 exchange tests; the cuda-nccl table at EP 1; memcheck;
#          racecheck on the EP 1 exchange timing (the routes' plan now inside dispatch_one_plan).
#   RUN=52: finish_forward_kernel mended (run 51: 18.5 us): the EP 1 exchange tests that compare
#          the stash with the static mode's and the errors' NaN, the decode bench (bf16), the
#          timeline, memcheck on one of the tests (the session's last device time: short).
#   RUN=53: (the day's fourth session) the mxfp8-weights GEMM's f16 path (weights decoded to f16
#          relative to their row's largest scale code, two instructions a code pair; x rows
#          as f16 relative to a power of two): its checks against the float64 reference and
#          the bf16 path, its timings against the bf16 path alternated; the plain kernel's
#          checks (its passes were restructured); memcheck on both; SASS counts; the decode
#          bench (bf16) for the plain kernel.
#   RUN=54: after run 53 (every f16 check passed, bit for bit equal to the bf16 path, until the
#          empty-experts check's own fill launch of no blocks failed): the f16 path's checks
#          (mended) and timings, memcheck on its checks. (Runs 53 and 54 ran commits e3867e1 and
#          22cdc5c; --mxfp8-weights-f16 is gone since 9597f5e.)
#   RUN=55: after runs 53 and 54 (the f16 path no faster: taken out): group_block_max with one
#          vote instead of the NaN flag's shuffles, and sum_rows' round trips in straight-line
#          code (combine_one with the round trip took 25.5 us against 12.0 without, run 52):
#          the block-format CUDA tests (bit for bit against the spec: encodes, epilogue round
#          trips, the combine's reduce), the round-trip exchange tests at EP 1 and 2, the
#          decode timeline and bench, memcheck and racecheck on the round-trip tests at EP 1.
#          First: the mxfp8-weights GEMM's pipelined variants (a producer warp, mbarriers, no
#          block-wide barrier in the loop): their checks and timings against the plain kernel's
#          (commit ae63d01; the variants are gone since).
#   RUN=56: after run 55 (the pipelined variants correct but slower: taken out; combine_one with
#          the round trip still 25.7 us): the round-trip combine's rows in one batch of 8 (one
#          load wait a token): the round-trip tests (bit for bit, EP 1 and 2), the timeline, the
#          decode bench (none, bf16), memcheck on the round-trip tests at EP 1.
#   RUN=57 (not run: no device time was left; group_block_max's vote was taken out instead, so
#          the final build's device code is what runs 52 to 56 ran): after run 56 (one batch of 8: combine_one 31.8 us, slower): sum_rows as before run 55
#          (batches of 4, a branch a row), group_block_max's vote kept (its other callers ran in
#          runs 55 and 56): the round-trip and exchange tests at EP 1, the timeline (the
#          session's last device time: short).
#   RUN=58: (the day's fifth session) the mxfp8-weights GEMM on warpgroup MMAs
#          (mxfp8_weights_wgmma.cuh): every variant's checks (float64 reference, NaN, inexact
#          flag, scale sweep), then the timings against the plain kernel's, alternated; the
#          SASS counts (HGMMA) of the wgmma kernels.
#   RUN=59: after run 58 (the wgmma kernel right on every check, but at 0.40 to 0.45 of the
#          weight read against the plain kernel's 0.69): where its time goes: its ablations
#          (no wgmma; x copied in 16-byte chunks) timed against it and the plain kernel,
#          Nsight Compute's warp states and source counters on one launch of each.
#   RUN=60: after run 59 (the wgmma kernel executed twice the plain kernel's instructions: the
#          x pieces' address arithmetic, about 15 instructions a 4-byte copy): the copies with
#          constant shared offsets and a stepped global pointer: every check, the timings, the
#          ablations.
#          Runs 58 to 60 need the wgmma kernel's commit (9ede90b): it was taken out after run 60
#          (slower than the plain kernel in every configuration), and --mxfp8-weights-ablations
#          with it.
#   RUN=61: the final build (the device code of runs 52 to 56): memcheck on the EP 1 error
#          tests (finish_forward_kernel's error branch through fill_nan, which runs 55 and 56
#          ran outside the sanitizer); jax-ffi's nvfp4 forward at 4096 tokens, never timed
#          (its bf16 row in the same call).
#   RUN=62: run 61's jax-ffi bench, over the core built without NCCL (run 61 carried the NCCL
#          build's core, and the module's import failed on ncclDevCommCreate).
#   RUN=63: the mxfp8-weights checks with the K = 384 case in the default checks, under
#          memcheck (--no-time).
#   OUT=/tmp/o RUN=46 bash scripts/gpu_session_2026_12_03.sh
set -uo pipefail
cd "$(dirname "$0")/.."
o="${OUT:-reports}/run${RUN:?RUN=46..}"; mkdir -p "$o"
. scripts/device_env.sh
. scripts/gpu_session_steps.sh
# jaxffi_nvfp4_bench SECONDS: jax-ffi's nvfp4 and bf16 forward at 4096 tokens (runs 61 and 62).
jaxffi_nvfp4_bench() {
  TAIL=14 step bench-jax-ffi-nvfp4 "$1" "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format nvfp4 --format bf16 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi-nvfp4.json" --no-progress
}
case "$RUN" in
46)
  for inter in none bf16; do
    TAIL=45 step "timeline-decode-$inter" 90 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 \
      --format mxfp8 --intermediate-format "$inter" --iters 5 --top 24 --timeline
  done
  TAIL=60 mxw_gemm_check 200
  TAIL=40 step ncu-mxw-pipes 120 ncu --clock-control none -k regex:mxfp8_weights_gemm_kernel -c 4 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
    --print-details all .devbuild/moe_ep_gemm_check --mxfp8-weights-profile
  mxw_memcheck 150
  for i in 1 2; do TAIL=6 decode_bench "$i" none; done
  ;;
47)
  for i in 1 2; do TAIL=6 decode_bench "$i" none; done
  TAIL=6 decode_bench bf16 bf16
  TAIL=40 step timeline-decode-bf16 90 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 \
    --format mxfp8 --intermediate-format bf16 --iters 5 --top 5 --timeline
  TAIL=6 step tests-cuda-exchange 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "test_cuda_loopback and (ep1 or ep2)"
  conformance_nccl_ep1 150
  ;;
48)
  TAIL=6 step tests-cuda-exchange-ep1 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "test_cuda_loopback and ep1"
  ;;
49)
  for tool in memcheck racecheck; do
    TAIL=8 step "sanitizer-exchange-ep1-$tool" 150 compute-sanitizer --tool "$tool" --target-processes all \
      --report-api-errors no --error-exitcode 9 "$py" scripts/gpu_exchange_check.py --time --tokens 128 \
      --mode throughput --mode low_latency
  done
  TAIL=8 step sanitizer-memcheck-tests-ep1 200 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_exchange.py -k "test_cuda_loopback and ep1 and throughput"
  ;;
50)
  for i in 1 2; do TAIL=6 decode_bench "$i" none; done
  TAIL=6 decode_bench bf16 bf16
  TAIL=40 step timeline-decode-bf16 90 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 \
    --format mxfp8 --intermediate-format bf16 --iters 5 --top 5 --timeline
  TAIL=14 step exchange-ep1-timing 90 "$py" scripts/gpu_exchange_check.py --time --tokens 128 \
    --mode throughput --mode low_latency
  TAIL=6 step tests-cuda-record-exchange 240 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native.py \
    tests/test_native_exchange.py -k "record_step or (test_cuda_loopback and (ep1 or ep2))"
  conformance_nccl_ep1 150
  TAIL=8 step sanitizer-memcheck-ep1 120 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native.py \
    tests/test_native_exchange.py -k "record_step or (test_cuda_loopback and ep1 and throughput)"
  ;;
51)
  for i in 1 2; do
    TAIL=6 decode_bench "$i-rt-combine" none MOE_EP_CUDA_NCCL_ROUND_TRIP=combine
    TAIL=6 decode_bench "$i-rt-experts" none MOE_EP_CUDA_NCCL_ROUND_TRIP=experts
  done
  TAIL=6 decode_bench bf16-rt-combine bf16 MOE_EP_CUDA_NCCL_ROUND_TRIP=combine
  TAIL=40 step timeline-decode-bf16 90 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 \
    --format mxfp8 --intermediate-format bf16 --iters 5 --top 5 --timeline
  TAIL=8 step tests-cuda-round-trip 240 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "(round_trip and cuda) or (test_cuda_loopback and ep1)"
  conformance_nccl_ep1 150
  TAIL=8 step sanitizer-memcheck-round-trip 150 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_exchange.py -k "round_trip and cuda and (ep1 or (ep2 and slot))"
  TAIL=8 step sanitizer-racecheck-exchange-ep1 120 compute-sanitizer --tool racecheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" scripts/gpu_exchange_check.py --time --tokens 128 \
    --mode throughput
  ;;
52)
  TAIL=6 step tests-cuda-exchange-ep1 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "(test_cuda_loopback_device_exchange or test_cuda_loopback_errors) and ep1 and throughput"
  TAIL=6 decode_bench bf16 bf16
  TAIL=40 step timeline-decode-bf16 60 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 \
    --format mxfp8 --intermediate-format bf16 --iters 5 --top 5 --timeline
  TAIL=8 step sanitizer-memcheck-ep1 90 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_exchange.py -k "test_cuda_loopback_device_exchange and ep1 and throughput and slot"
  ;;
53)
  TAIL=30 step gemm-check-mxfp8-weights-f16 240 .devbuild/moe_ep_gemm_check --mxfp8-weights-f16
  TAIL=4 step gemm-check-mxfp8-weights-plain 150 .devbuild/moe_ep_gemm_check --mxfp8-weights --no-time
  mxw_sass
  TAIL=6 step sanitizer-memcheck-mxfp8-weights-f16 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    .devbuild/moe_ep_gemm_check --mxfp8-weights-f16 --no-time
  TAIL=6 decode_bench bf16 bf16
  ;;
54)
  TAIL=30 step gemm-check-mxfp8-weights-f16 300 .devbuild/moe_ep_gemm_check --mxfp8-weights-f16
  TAIL=6 step sanitizer-memcheck-mxfp8-weights-f16 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    .devbuild/moe_ep_gemm_check --mxfp8-weights-f16 --no-time
  ;;
55)
  TAIL=70 mxw_gemm_check 200
  TAIL=4 step tests-native-cuda 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  TAIL=6 step tests-cuda-round-trip 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "(round_trip and cuda) or (test_cuda_loopback and ep1)"
  TAIL=40 step timeline-decode-bf16 60 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 \
    --format mxfp8 --intermediate-format bf16 --iters 5 --top 5 --timeline
  TAIL=6 decode_bench none none
  TAIL=6 decode_bench bf16 bf16
  for tool in memcheck racecheck; do
    TAIL=6 step "sanitizer-$tool-round-trip-ep1" 90 compute-sanitizer --tool "$tool" --target-processes all \
      --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
      tests/test_native_exchange.py -k "round_trip and cuda and ep1"
  done
  ;;
56)
  TAIL=6 step tests-cuda-round-trip 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "(round_trip and cuda) or (test_cuda_loopback and ep1)"
  TAIL=40 step timeline-decode-bf16 60 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 \
    --format mxfp8 --intermediate-format bf16 --iters 5 --top 5 --timeline
  TAIL=6 decode_bench none none
  TAIL=6 decode_bench bf16 bf16
  TAIL=6 step sanitizer-memcheck-round-trip-ep1 90 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_exchange.py -k "round_trip and cuda and ep1"
  ;;
57)
  TAIL=6 step tests-cuda-round-trip-ep1 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_exchange.py -k "(round_trip and cuda and ep1) or (test_cuda_loopback and ep1)"
  TAIL=40 step timeline-decode-bf16 40 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 \
    --format mxfp8 --intermediate-format bf16 --iters 5 --top 5 --timeline
  ;;
58)
  TAIL=12 step sass-mxfp8-weights-wgmma 60 bash scripts/sass_counts.sh .devbuild/moe_ep_gemm_check \
    mxfp8_weights_wgmma_kernel
  TAIL=120 mxw_gemm_check 420
  ;;
59)
  TAIL=40 step gemm-check-mxfp8-weights-ablations 120 .devbuild/moe_ep_gemm_check --mxfp8-weights-ablations
  TAIL=10 step ncu-mxw-wgmma 200 ncu --clock-control none -k regex:mxfp8_weights_ -c 2 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section SourceCounters --section InstructionStats --print-details all \
    .devbuild/moe_ep_gemm_check --mxfp8-weights-profile
  ;;
60)
  TAIL=50 mxw_gemm_check 300
  TAIL=40 step gemm-check-mxfp8-weights-ablations 120 .devbuild/moe_ep_gemm_check --mxfp8-weights-ablations
  ;;
61)
  TAIL=6 step sanitizer-memcheck-errors-ep1 150 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_exchange.py -k "test_cuda_loopback_errors and ep1"
  jaxffi_build
  jaxffi_nvfp4_bench 150
  ;;
62)
  jaxffi_build
  jaxffi_nvfp4_bench 200
  ;;
63)
  mxw_memcheck 200
  ;;
*) echo "no RUN $RUN"; exit 2 ;;
esac
