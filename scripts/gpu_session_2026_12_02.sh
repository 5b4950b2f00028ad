#!/usr/bin/env bash
# The device calls of 2026-12-02 (one H200), one per RUN, each under the call's 600 s:
#   RUN=1: the jax-ffi bf16 decode of block-scaled operands on CUDA (its tests, the bench's
#          mxfp8 row), where jax-ffi's bf16 forward spends its time, and where cuda-nccl's
#          mxfp8 forward spends its time (after the vectorised FC2 epilogue).
#   RUN=2: the device exchange after the fan-out dispatch and with the low-latency mode: its CUDA
#          tests (EP 2 and 4 loopback, both modes), the EP 2 smoke (eager and graph replays), the EP 1
#          timings against a device copy at 4096 and 128 tokens in both modes, compute-sanitizer
#          memcheck and racecheck on the EP 2 smoke in both modes; the mxfp8 forward's ops by shape and line.
#   RUN=3: after run 2 found the fan-out copy's shuffles inside a loop not every lane ran (rows
#          of fewer than 32 16-byte pieces: wrong rows at EP 2, a hang in the low-latency mode):
#          the EP 2 smoke and the EP 1 timings in both modes, the conformance table through the
#          device exchange at EP 2 and 4 on one GPU in both modes, compute-sanitizer memcheck and
#          racecheck on the smoke in both modes, the low-latency mode's CUDA tests, the
#          low-latency timings with fewer blocks.
#   RUN=4: (prepared for the next session: what this one could not run) the EP 2 smoke in both
#          modes (after the review's changes: L2 loads of peer rows in the low-latency kernel, its
#          grid computed once at layer creation), the low-latency mode's
#          CUDA tests (errors, a peer that never arrives), the conformance table over the NCCL
#          provider at EP 1, jax-ffi after the native row gathers (its CUDA tests, its conformance
#          table at EP 1, its profile and bench), the low-latency timings with fewer blocks, and
#          the mxfp8 forward's ops by shape and issuing line (what its torch-side copies are).
#   RUN=5: (the day's second session) the NCCL provider's table at EP 1; block-scaled rows decoded
#          where the dispatch put them, nvfp4 expert-output rows as bf16, jax-ffi's bf16 y and
#          bf16 combine sums: their CUDA tests, conformance (cuda-nccl EP 1 over NCCL and EP 2 over
#          the device exchange, jax-ffi EP 1), the bench and the profiles.
#   RUN=6: after run 5: the dispatched codes decoded as views of the received rows, jax's weights
#          decoded 16 neighbours a thread, the bench's pipelined jax rows, and the CUDA tests run 5
#          did not finish.
#   RUN=7: the mxfp8 epilogue round trip and decodes through the hardware's E4M3 converts: their
#          bit-exactness tests, the bench, the NCCL provider's table.
#   RUN=8: (prepared for the next session) jax-ffi's bf16 forward with and without XLA's command
#          buffers and with one or four input sets; nvfp4's forward profile.
#   RUN=9: (the day's third session) the CUDA tests and the NCCL provider's table after the two
#          review mends run 7 did not see, compute-sanitizer memcheck and racecheck on the second
#          session's new kernels (strided, middle-axis and element-by-element bf16 decodes, the
#          vectorised combine reduction, the nvfp4 bf16-output and mxfp8 E4M3-convert FC2
#          epilogues), then run 8.
#   RUN=10: nvfp4's scale through the hardware's E4M3 convert (every bound and its neighbours
#          against the spec), its FC2 epilogue with the thresholds computed once, its rows
#          decoded to bf16 by byte permutes and bf16 multiplies: tests, sanitizer, the NCCL
#          provider's and jax-ffi's tables, the bench, the nvfp4 profile; jax-ffi's bf16
#          forward's host time (issue against finish, host events).
#   RUN=11: after run 10 found the nvfp4 rows decode dropping signs (__byte_perm takes 3 bits
#          of a selector: no sign-replicate mode): the decode a piece of 8 elements a thread
#          (one 16-byte store, contiguous across a warp) for both formats; its tests and
#          sanitizer, the bench, both formats' profiles, jax-ffi's bf16 forward's GPU gaps.
#   RUN=12: the explicit training step with block-scaled inputs (moe_ep_forward_with_stash,
#          moe_ep_backward): its CUDA test and the bench's mxfp8/nvfp4 forward_backward rows;
#          the row permutation with 4 units a thread (tests, sanitizer, jax-ffi's profile
#          and bench); the tables of both backends.
#   RUN=13: (prepared for the next session: no device time was left) the mxfp8-weights GEMM's
#          checks and decode-shape timings (moe_ep_gemm_check --mxfp8-weights), a first
#          sanitizer verdict for jax-ffi (memcheck with XLA's command buffers off and the
#          platform allocator; the default setup segfaulted under memcheck on 2026-12-01),
#          jax-ffi's block-scaled forward_backward through the explicit API, and the middle-axis
#          decode with 32-bit index divisions (its CUDA tests, jax-ffi's mxfp8 forward).
#   RUN=14: (the day's fourth session) the mxfp8-weights GEMM staged through shared memory with
#          cp.async (its checks incl. bf16 output and an inexact block, memcheck, racecheck, the
#          decode-shape timings), the layer's mxfp8-weights forward
#          (moe_ep_layer_experts_forward_mxfp8) and the cuda-nccl front-end taking it at few rows:
#          CUDA tests, the NCCL provider's table, the bench's decode row (128 tokens) with it and
#          without it (MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS=0), in the default device mode.
#   RUN=15: after run 14 (the check's bf16-output bound was 2^-9 of the value; bf16's rounding
#          moves it by up to 2^-8): the mxfp8-weights GEMM's checks, memcheck and racecheck
#          again, its timings with 32-row passes at the routing's spread; the CUDA tests of the
#          front-end with the switch now opt-in.
#   RUN=16: the review mends (one forward output check and finish for both forward entries,
#          the staged decode through cpu::dequantize_bf16_values, one shape rule for the
#          mxfp8-weights GEMM): its checks, the CUDA tests of the layer and the front-end, the
#          NCCL provider's table.
#   RUN=24: (the day's sixth session) the one-rank combine in one pass (sum, round trip, NaN flag
#          and output encode: moe_ep_combine_reduce_encode), no stash in a forward-only program,
#          the mxfp8 rows' gather-decode a bf16 pair at a time: tests, memcheck, bench, profile.
#   RUN=26: (the day's seventh session) the prefill's kNN GEMMs with a float32 D as pingpong
#          128x128x64 (grouped_gemm_nn_pingpong128{,_bf16}.cu, in commit 7cbc580 only; a later
#          build has no such kernel and ignores the switch's value): every kernel's GEMM checks and
#          the prefill timings of each; the mxfp8 rows' decode 16 codes a thread (run 25's
#          variant, now the kernel); jax-ffi's bench with each kNN kernel
#          (MOE_EP_GEMM_KNN); the CUDA tests, memcheck, the profile, cuda-nccl's bench.
#          (Run 25's script is in commit c5ea0a1.)
#   RUN=27: after run 26 (pingpong 128x128 no faster alone and 1.2 ms slower in jax-ffi's
#          layer: dropped): the kNN cooperative kernel with cluster 1x2 instead of 2x1, so no CTA
#          idles on a group's odd M tile count: every kernel's GEMM checks, timings at the
#          routing's spread of rows; jax-ffi's bench with each kNN kernel; cuda-nccl's bench;
#          the layer's CUDA tests.
#   RUN=28: after run 27 (1x2 clusters: jax-ffi mxfp8 0.702 against 0.691 with 2x1, and the FC1
#          GEMM at 32 rows a group 0.45 ms against pingpong's 0.63): the cooperative 1x2 kernel
#          for the kNN GEMMs at any rows a group: the GEMM checks under memcheck, the decode
#          kernels timed against each other, cuda-nccl's bench at 128 and 4096 tokens,
#          jax-ffi's bench (bf16, mxfp8, nvfp4), the CUDA tests, both backends' tables at EP 1.
#   RUN=29: after run 28 (its jax-ffi bench with nvfp4 and its CUDA tests, selected by -k "cuda",
#          which matched whole modules, ran past their limits): the CUDA tests by name (a new
#          layer case wide enough for the 1x2 kernel), jax-ffi's tests and bench (bf16, mxfp8).
#   RUN=30: where cuda-nccl's forward+backward spends its time (issue 15's 0.70 stands at 0.375):
#          the layer profile, bf16, device mode, with the exact and the bf16 FC2 operand.
#   RUN=31: (the day's eighth session) the mxfp8-weights GEMM with a cheaper decode (the bf16
#          convert first, then one bf16x2 multiply by the scale; no NaN select) and passes of
#          1 to 4 m16 tiles as the expert's rows need: its checks (a NaN code, a scale sweep
#          across the fast path's bound), memcheck, its SASS counts, the decode timings;
#          cuda-nccl's decode bench with the kernel and with the kept bf16 decode, alternated;
#          the tests.
#   RUN=32: after run 31 (the GEMM 1.1-1.25x faster, the layer with it still slower than the
#          kept bf16 decode: 0.366 against 0.406): the decode 8 codes at a time between the
#          MMAs, and kernel variants <kMaxMt, kStages, kMinBlocks> (more blocks an SM, fewer
#          stages) checked and timed against the default; the decode bench alternated again.
#   RUN=33: after run 32 (an H100: <4,2,3> and <3,2,3> faster than <4,3,2> at the routing's
#          spread; the layer with the GEMM still behind the kept decode, 0.402 against 0.421):
#          <4,2,3> as the default: every check and memcheck on it, the variants again, the
#          decode bench alternated, the tests.
#   RUN=34: after run 33 (an H100: with <4,2,3> the layer's decode took the GEMM at 0.433
#          against the kept decode's 0.421): the variant picked by the rows an expert
#          (<3,2,3> up to 48 on average, else <4,3,2>), its checks and memcheck, the decode
#          bench alternated, the decode forward's profile with the GEMM, the tests.
#   RUN=35: after run 34 (the H200: the decode between the MMAs made the 3- and 4-tile passes
#          slower, FC1 at the spread 0.621 ms against run 31's 0.538, and the layer with the
#          GEMM 0.328 against the kept decode's 0.409): that decode for passes of 1 and 2 tiles
#          only, all 16 codes first for 3 and 4; the variants, the bench alternated, the tests.
#   RUN=36: after run 35 (the H200: still slower than run 31's kernel at the routing's spread,
#          FC1 0.565 ms against 0.538): run 31's kernel again as the default <4,3,2>, its
#          checks and memcheck, the variants of it, the decode bench alternated, the tests.
#   RUN=37: after run 36 (run 31's kernel body: <3,2,3> of it 0.511 / 0.522 of the copy at the
#          spread against the default's 0.427 / 0.438; but its layer tests failed and the kept
#          decode's bench read 2.19: a commit had dropped GroupedGemmProblem::total_rows from
#          the layer's CUTLASS launches): the build with it back, <3,2,3> picked up to 48 rows
#          an expert; the checks, memcheck, the decode bench alternated, the CUDA tests.
#   RUN=38: after run 37 (the H200: the layer's decode with the GEMM 0.429 / 0.427 against the
#          kept decode's 0.402 / 0.402; 145 CUDA tests passed, memcheck clean): the GEMM on by
#          default up to 40 rows an expert: the NCCL provider's conformance table at EP 1,
#          the front-end's and the block-scaled CUDA tests, the decode bench (default, then
#          the switch at 0).
#   RUN=39: (the day's ninth session) the mxfp8-weights GEMM with the x rows as the n8 B
#          operand against the m16 layout: checks, timings, ncu warp states, the layer A/B.
#   RUN=40: the fast stages apart (the choice per lane: its checks hung), against run 39's
#          build and an out-of-line slow decode.
#   RUN=41: the choice warp-uniform: checks, memcheck, SASS, the layer, tests, the table.
#   RUN=42, 43: the FC2 epilogue fused into the GEMM (taken out after run 43's timing), the
#          48-row bound, the three-format decode bench, the block-scaled CUDA tests.
#   RUN=44: the build without the fused epilogue. RUN=45: three x planes in one pass.
#   OUT=/tmp/o RUN=1 bash scripts/gpu_session_2026_12_02.sh
set -uo pipefail
cd "$(dirname "$0")/.."
o="${OUT:-reports}/run${RUN:?RUN=1..}"; mkdir -p "$o"
. scripts/device_env.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
. scripts/gpu_session_steps.sh
case "$RUN" in
1)
  jaxffi_build
  TAIL=30 step jax-profile-bf16 100 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format bf16
  TAIL=12 step bench-jax-ffi-mxfp8 120 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format mxfp8 --intermediate-format bf16 --op forward --json "$o/bench-jax-ffi-mxfp8.json" \
    --no-progress
  TAIL=30 step profile-mxfp8 100 "$py" scripts/gpu_layer_profile.py --mode device --format mxfp8 --intermediate-format bf16 \
    --iters 3 --top 16
  step tests-jax-ffi 200 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs -x tests/test_jax_ffi.py
  ;;
2)
  TAIL=40 step exchange-check 120 "$py" scripts/gpu_exchange_check.py --smoke 2 --time --tokens 4096 --tokens 128 \
    --mode throughput --mode low_latency
  step tests-exchange-ll 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "cuda and low_latency"
  for tool in memcheck racecheck; do
    step "sanitizer-exchange-$tool" 75 compute-sanitizer --tool "$tool" --target-processes all --report-api-errors no \
      --error-exitcode 9 "$py" scripts/gpu_exchange_check.py --smoke 2 --mode throughput --mode low_latency
  done
  for mode in throughput low_latency; do
    TAIL=14 step "bench-exchange-$mode" 60 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
      --tokens 128 --tokens 4096 "${shape[@]}" --format bf16 --op dispatch --op combine --exchange-mode "$mode" \
      --json "$o/bench-exchange-$mode.json" --no-progress
  done
  TAIL=14 step bench-formats 70 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 --op forward \
    --json "$o/bench-formats.json" --no-progress
  jaxffi_build
  TAIL=30 step jax-profile-bf16 60 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format bf16
  TAIL=14 step bench-jax-ffi 70 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  ;;
3)
  TAIL=30 step exchange-check 90 "$py" scripts/gpu_exchange_check.py --smoke 2 --time --tokens 4096 --tokens 128 \
    --mode throughput --mode low_latency
  sanitize() {
    TAIL=8 step "sanitizer-exchange-$1" 60 compute-sanitizer --tool "$1" --target-processes all \
      --report-api-errors no --error-exitcode 9 "$py" scripts/gpu_exchange_check.py --smoke 2 --mode throughput \
      --mode low_latency
  }
  conform() {
    TAIL=3 step "conformance-device-$1" 50 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_CUDA_NCCL_EXCHANGE_MODE=$1 \
      MOE_EP_CUDA_NCCL_TIMEOUT_S=30 MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance \
      --backend cuda-nccl --ep-size 2 --ep-size 4 --device cuda-shared --timeout 45 \
      --report-md "$o/conformance-device-$1.md"
  }
  sanitize memcheck
  conform throughput
  sanitize racecheck
  conform low_latency
  step tests-exchange-ll 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "cuda and low_latency"
  TAIL=12 step exchange-ll-blocks 40 "$py" scripts/gpu_exchange_check.py --time --tokens 128 --sms 66 --sms 16 \
    --mode low_latency
  ;;
4)
  TAIL=8 step exchange-smoke 60 "$py" scripts/gpu_exchange_check.py --smoke 2 --mode throughput --mode low_latency
  step tests-exchange-ll 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_exchange.py \
    -k "cuda and low_latency"
  TAIL=3 step conformance-nccl-ep1 90 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --report-md "$o/conformance-nccl-ep1.md"  # (run 4 lacked --device cuda: a CPU layer, refused)
  jaxffi_build
  step tests-jax-ffi 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py tests/test_jax_one_rank.py
  TAIL=3 step conformance-jax-ffi 120 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 100 --report-md "$o/conformance-jax-ffi-ep1.md"
  TAIL=30 step jax-profile-bf16 60 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format bf16
  TAIL=14 step bench-jax-ffi 70 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=12 step exchange-ll-blocks 40 "$py" scripts/gpu_exchange_check.py --time --tokens 128 --sms 66 --sms 16 \
    --mode low_latency
  TAIL=4 step profile-mxfp8-detail 60 "$py" scripts/gpu_layer_profile.py --mode device --format mxfp8 \
    --intermediate-format bf16 --iters 3 --top 20 --detail
  ;;
5)
  # The second session of 2026-12-02: the NCCL provider's table at EP 1 (run 4 left out --device
  # cuda); the block-scaled rows decoded where the dispatch put them (moe_ep_dequantize_bf16_rows:
  # no copy of the codes), nvfp4 expert-output rows as bf16, jax-ffi's bf16 y and bf16 combine
  # sums (moe_ep_combine_reduce_bf16), each with its CUDA tests, then the bench.
  TAIL=3 step conformance-nccl-ep1 90 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 60 --report-md "$o/conformance-nccl-ep1.md"
  step tests-native-cuda 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_cuda.py \
    tests/test_native_decode_bf16.py tests/test_native_layer.py tests/test_cuda_nccl_block_scaled.py \
    -k "test_native_cuda or test_cuda_"
  TAIL=14 step bench-formats 100 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 128 --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 \
    --op forward --json "$o/bench-formats.json" --no-progress
  jaxffi_build
  TAIL=14 step bench-jax-ffi 60 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=20 step jax-profile-bf16 40 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format bf16
  TAIL=24 step jax-profile-mxfp8 50 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8
  step tests-jax-ffi 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py tests/test_jax_one_rank.py
  TAIL=3 step conformance-jax-ffi 60 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 50 --report-md "$o/conformance-jax-ffi-ep1.md"
  TAIL=24 step profile-mxfp8 40 "$py" scripts/gpu_layer_profile.py --mode device --format mxfp8 \
    --intermediate-format bf16 --iters 3 --top 14
  TAIL=3 step conformance-device-ep2 60 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_CUDA_NCCL_TIMEOUT_S=30 \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 2 \
    --device cuda-shared --timeout 45 --report-md "$o/conformance-device-ep2.md"
  ;;
6)
  # After run 5: the dispatched codes and scales stay views into the received byte rows (run 5
  # still copied them while unpacking), jax's weights blocked along their middle axis decoded 16
  # neighbours a thread (run 5: 10.4 of jax-ffi's 17 ms mxfp8 forward in the element-by-element
  # kernel), and the bench's pipelined jax rows; the CUDA tests run 5 did not finish.
  TAIL=3 step conformance-nccl-ep1 60 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 50 --report-md "$o/conformance-nccl-ep1.md"
  TAIL=22 step bench-formats 100 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 128 --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 \
    --op forward --json "$o/bench-formats.json" --no-progress
  jaxffi_build
  TAIL=12 step bench-jax-ffi 60 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=14 step jax-profile-mxfp8 30 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8
  TAIL=3 step conformance-jax-ffi 40 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 35 --report-md "$o/conformance-jax-ffi-ep1.md"
  TAIL=4 step tests-native-cuda 60 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_"
  TAIL=4 step tests-jax-ffi 100 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py \
    tests/test_jax_one_rank.py
  TAIL=16 step profile-mxfp8 25 "$py" scripts/gpu_layer_profile.py --mode device --format mxfp8 \
    --intermediate-format bf16 --iters 3 --top 12
  TAIL=3 step conformance-device-ep2 30 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_CUDA_NCCL_TIMEOUT_S=20 \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 2 \
    --device cuda-shared --timeout 25 --report-md "$o/conformance-device-ep2.md"
  TAIL=6 step tests-cuda-nccl-block 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_cuda_nccl_block_scaled.py -k "test_cuda_"
  ;;
7)
  # The last 270 s of the day's second session: the mxfp8 round trip of the FC2 epilogue and
  # the mxfp8 decodes through the hardware's E4M3 converts (bit for bit the spec's: the
  # epilogue against the spec's numpy round trip of the same layer's unrounded rows, every
  # code at every scale for the decodes), then their bench and the NCCL provider's table.
  TAIL=4 step tests-cvt 40 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
    tests/test_native_decode_bf16.py -k "epilogue or test_cuda_"
  TAIL=12 step bench-formats 30 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 \
    --op forward --json "$o/bench-formats.json" --no-progress
  jaxffi_build
  TAIL=10 step bench-jax-ffi 30 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=3 step conformance-nccl-ep1 45 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 40 --report-md "$o/conformance-nccl-ep1.md"
  ;;
8)
  # Prepared for the next session (no device time was left): where jax-ffi's bf16 forward loses
  # 0.6 ms a call even with calls issued back to back (its GPU events of one call sum to 4.85 ms
  # without gaps). Hypothesis to test: XLA's command buffers re-recorded every call, as the
  # bench alternates four input sets (new buffer addresses), with the host waiting meanwhile.
  # The same bench without command buffers and with one input set, then nvfp4's forward profile
  # (0.662 of the roofline: its FC2 epilogue's scale search is the suspect).
  TAIL=16 step profile-nvfp4 40 "$py" scripts/gpu_layer_profile.py --mode device --format nvfp4 \
    --intermediate-format bf16 --iters 3 --top 12
  jaxffi_build
  for flags in "" "--xla_gpu_enable_command_buffer="; do
    for sets in 1 4; do
      TAIL=6 step "bench-jax-ffi-cb${flags:+off}-sets$sets" 60 env XLA_FLAGS="$flags" "$py" -m moe_ep_spec.cli bench \
        --device cuda --ep-size 1 --backend jax-ffi --tokens 4096 "${shape[@]}" --format bf16 \
        --intermediate-format bf16 --op forward --input-sets "$sets" --no-progress
    done
  done
  ;;
9)
  # The review mends after run 7 (the rows decode through the strided launcher, one shared
  # 16-byte unpack) and the second session's kernels under compute-sanitizer.
  TAIL=4 step tests-native-cuda 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  TAIL=3 step conformance-nccl-ep1 50 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 45 --report-md "$o/conformance-nccl-ep1.md"
  for tool in memcheck racecheck; do
    for sel in "tests/test_native_decode_bf16.py:test_cuda_" "tests/test_native_layer.py:epilogue" \
               "tests/test_native_cuda.py:combine_reduce"; do
      TAIL=4 step "sanitizer-$tool-$(basename "${sel%%:*}" .py)" 80 compute-sanitizer --tool "$tool" \
        --target-processes all --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider \
        -n 0 -rs "${sel%%:*}" -k "${sel#*:}"
    done
  done
  RUN=8 bash "$0"
  ;;
10)
  nv='test_nvfp4_cuda or test_formats_cuda or combine_reduce'
  TAIL=4 step tests-native-cuda 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  for tool in memcheck racecheck; do
    for sel in "tests/test_native_cuda.py:$nv" "tests/test_native_decode_bf16.py:rows" \
               "tests/test_native_layer.py:epilogue"; do
      TAIL=3 step "sanitizer-$tool-$(basename "${sel%%:*}" .py)" 60 compute-sanitizer --tool "$tool" \
        --target-processes all --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider \
        -n 0 -rs "${sel%%:*}" -k "${sel#*:}"
    done
  done
  TAIL=3 step conformance-nccl-ep1 50 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 45 --report-md "$o/conformance-nccl-ep1.md"
  TAIL=12 step bench-formats 80 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 128 --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 \
    --op forward --json "$o/bench-formats.json" --no-progress
  TAIL=16 step profile-nvfp4 40 "$py" scripts/gpu_layer_profile.py --mode device --format nvfp4 \
    --intermediate-format bf16 --iters 3 --top 12
  jaxffi_build
  TAIL=60 step jax-profile-bf16 60 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format bf16 --top 30
  TAIL=3 step conformance-jax-ffi 50 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 45 --report-md "$o/conformance-jax-ffi-ep1.md"
  ;;
11)
  TAIL=4 step tests-native-cuda 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  for tool in memcheck racecheck; do
    TAIL=3 step "sanitizer-$tool-decode" 60 compute-sanitizer --tool "$tool" --target-processes all \
      --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
      tests/test_native_decode_bf16.py -k "test_cuda_"
  done
  TAIL=12 step bench-formats 80 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 128 --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 \
    --op forward --json "$o/bench-formats.json" --no-progress
  for f in nvfp4 mxfp8; do
    TAIL=12 step "profile-$f" 40 "$py" scripts/gpu_layer_profile.py --mode device --format "$f" \
      --intermediate-format bf16 --iters 3 --top 10
  done
  TAIL=3 step conformance-nccl-ep1 50 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 45 --report-md "$o/conformance-nccl-ep1.md"
  jaxffi_build
  TAIL=24 step jax-profile-bf16 60 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format bf16 --top 12
  ;;
12)
  TAIL=4 step tests-native-cuda 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  # (run 12 itself selected -k "test_cuda_", which matched the module's name: the whole file
  # ran and was cut at 90 s; its CUDA cases then ran by these names in a call of their own)
  TAIL=4 step tests-cuda-nccl-block 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_cuda_nccl_block_scaled.py -k "test_cuda_explicit or test_cuda_tensor or test_cuda_values"
  for tool in memcheck racecheck; do
    TAIL=3 step "sanitizer-$tool-permute" 60 compute-sanitizer --tool "$tool" --target-processes all \
      --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
      tests/test_native_cuda.py -k "permute or nan_token"
  done
  TAIL=30 step bench-formats 200 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 128 --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 \
    --op forward --op forward_backward --json "$o/bench-formats.json" --no-progress
  TAIL=3 step conformance-nccl-ep1 50 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 45 --report-md "$o/conformance-nccl-ep1.md"
  jaxffi_build
  TAIL=10 step bench-jax-ffi 70 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=12 step jax-profile-bf16 40 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format bf16 --top 8
  TAIL=3 step conformance-jax-ffi 50 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 45 --report-md "$o/conformance-jax-ffi-ep1.md"
  ;;
13)
  TAIL=30 step gemm-check-mxfp8-weights 60 .devbuild/moe_ep_gemm_check --mxfp8-weights
  # (also the third session's review mends, compiled only: one nvfp4 round trip for every
  # caller, one mxfp8 8-element decode for the rows and the chunks)
  TAIL=4 step tests-decode 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  TAIL=6 step sanitizer-memcheck-mxfp8-weights 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    .devbuild/moe_ep_gemm_check --mxfp8-weights --no-time
  jaxffi_build
  TAIL=10 step bench-jax-ffi 70 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=10 step bench-jax-ffi-fwd-bwd 150 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward_backward \
    --json "$o/bench-jax-ffi-fwd-bwd.json" --no-progress
  TAIL=8 step sanitizer-memcheck-jax-ffi 150 env XLA_FLAGS=--xla_gpu_enable_command_buffer= \
    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py \
    -k "cuda"
  ;;
14)
  TAIL=16 step gemm-check-mxfp8-weights 60 .devbuild/moe_ep_gemm_check --mxfp8-weights
  TAIL=6 step tests-mxfp8-weights 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py
  for tool in memcheck racecheck; do
    TAIL=4 step "sanitizer-$tool-mxfp8-weights" 120 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      .devbuild/moe_ep_gemm_check --mxfp8-weights --no-time
  done
  TAIL=12 step bench-decode 90 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 128 "${shape[@]}" --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-decode.json" --no-progress
  TAIL=12 step bench-decode-bf16-path 90 env MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS=0 "$py" -m moe_ep_spec.cli bench \
    --device cuda --ep-size 1 --backend cuda-nccl --tokens 128 "${shape[@]}" --format mxfp8 \
    --intermediate-format bf16 --op forward --json "$o/bench-decode-bf16-path.json" --no-progress
  TAIL=4 step tests-native-cuda 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  TAIL=3 step conformance-nccl-ep1 60 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 45 --report-md "$o/conformance-nccl-ep1.md"
  ;;
15)
  TAIL=20 step gemm-check-mxfp8-weights 60 .devbuild/moe_ep_gemm_check --mxfp8-weights
  for tool in memcheck racecheck; do
    TAIL=4 step "sanitizer-$tool-mxfp8-weights" 120 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      .devbuild/moe_ep_gemm_check --mxfp8-weights --no-time
  done
  TAIL=6 step tests-mxfp8-weights 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py
  ;;
16)
  TAIL=4 step gemm-check-mxfp8-weights 60 .devbuild/moe_ep_gemm_check --mxfp8-weights --no-time
  TAIL=4 step tests-mxfp8-weights 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py
  TAIL=4 step tests-native-cuda 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  TAIL=3 step conformance-nccl-ep1 60 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 45 --report-md "$o/conformance-nccl-ep1.md"
  ;;
17)
  # Fifth session: jax-ffi's rows timed as the baselines are (device time), why calls back to
  # back cost more than one call's kernels, and where jax-ffi's mxfp8 forward spends its time.
  jaxffi_build
  TAIL=14 step bench-jax-ffi 150 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  (timeout 100 nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
    -lms 50 > "$o/clocks-sustained.csv" 2>&1 &)
  TAIL=20 step jax-sustained-bf16 100 "$py" scripts/gpu_jax_ffi_sustained.py --tokens 4096 --format bf16
  TAIL=26 step jax-profile-mxfp8 60 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8 --top 18
  ;;
18)
  # The jax-ffi mxfp8 forward's two changes: the weights' middle-axis decode (bf16_inner_mx_kernel)
  # and the block combine format rounded inside the one-rank sum (moe_ep_combine_reduce_round_trip).
  jaxffi_build
  TAIL=4 step tests-native-cuda 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  TAIL=4 step tests-jax-ffi-cuda 100 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py -k "cuda"
  TAIL=4 step sanitizer-memcheck-new 120 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_cuda.py tests/test_native_decode_bf16.py -k "round_trip_on_every or middle_axis or along_inner"
  TAIL=14 step bench-jax-ffi 90 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=18 step jax-profile-mxfp8 40 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8 --top 14
  TAIL=3 step conformance-jax-ffi 70 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 45 --report-md "$o/conformance-jax-ffi-ep1.md"
  ;;
19)
  # The middle-axis mxfp8 decode: run 18's block-rows-a-thread kernel took 5.2 ms where the
  # element-by-element one took 1.8; the variants (MOE_EP_DECODE_INNER_VARIANT, an experiment
  # of the builds of runs 19 and 20 only, since removed) measured in jax-ffi's forward, each
  # checked bit for bit first.
  jaxffi_build
  for v in 0 1 2 3 4; do
    TAIL=2 step "tests-decode-variant-$v" 60 env MOE_EP_DECODE_INNER_VARIANT=$v "$py" -m pytest -q -p no:cacheprovider \
      -n 0 -rs tests/test_native_decode_bf16.py -k "middle_axis or along_inner or every_path"
    TAIL=5 step "jax-profile-mxfp8-variant-$v" 40 env MOE_EP_DECODE_INNER_VARIANT=$v "$py" scripts/gpu_jax_ffi_profile.py \
      --tokens 4096 --format mxfp8 --top 3 --iters 3
  done
  ;;
20)
  # Run 19's best (2: a row a thread, the fast multiply, 1.165 ms for both weights) against
  # the same with 2 or 4 units a thread (5, 6) and with 8 blocks an SM (7).
  jaxffi_build
  for v in 2 5 6 7; do
    TAIL=2 step "tests-decode-variant-$v" 60 env MOE_EP_DECODE_INNER_VARIANT=$v "$py" -m pytest -q -p no:cacheprovider \
      -n 0 -rs tests/test_native_decode_bf16.py -k "middle_axis or along_inner or every_path"
    TAIL=5 step "jax-profile-mxfp8-variant-$v" 40 env MOE_EP_DECODE_INNER_VARIANT=$v "$py" scripts/gpu_jax_ffi_profile.py \
      --tokens 4096 --format mxfp8 --top 4 --iters 3
  done
  ;;
21)
  # The kept decode (run 20's variant 7, now the only mxfp8 middle-axis kernel) with the
  # one-rank round trip inside the sum: tests, memcheck, conformance, bench and profiles.
  jaxffi_build
  TAIL=4 step tests-native-cuda 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  TAIL=4 step tests-jax-ffi-cuda 100 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py -k "cuda"
  TAIL=4 step sanitizer-memcheck-new 120 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_cuda.py tests/test_native_decode_bf16.py -k "round_trip_on_every or middle_axis or along_inner"
  TAIL=14 step bench-jax-ffi 90 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=12 step jax-profile-mxfp8 40 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8 --top 10
  TAIL=3 step conformance-jax-ffi 70 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 45 --report-md "$o/conformance-jax-ffi-ep1.md"
  TAIL=3 step conformance-nccl-ep1 60 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --timeout 45 --report-md "$o/conformance-nccl-ep1.md"
  ;;
22)
  # The buffer's block-scaled rows decoded straight from the token rows at one rank
  # (moe_ep_dequantize_bf16_gather): tests, memcheck, bench, profile, conformance.
  jaxffi_build
  TAIL=4 step tests-native-cuda 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_native_cuda.py tests/test_native_layer.py -k "test_native_cuda or test_cuda_ or epilogue"
  TAIL=4 step tests-jax-ffi-cuda 100 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py -k "cuda"
  TAIL=4 step sanitizer-memcheck-gather 120 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_decode_bf16.py -k "cuda_gather or cuda_rows"
  TAIL=14 step bench-jax-ffi 90 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=12 step jax-profile-mxfp8 40 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8 --top 10
  TAIL=3 step conformance-jax-ffi 70 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 45 --report-md "$o/conformance-jax-ffi-ep1.md"
  ;;
23)
  # Run 22's bench step ran past its bound with nvfp4 added (bf16 and mxfp8 ran again on the
  # warm machine: run22/bench-jax-ffi-bf16-mxfp8.json). The gather's route id divided in 32
  # bits (div_nonneg): its tests, memcheck, bench and profile.
  jaxffi_build
  TAIL=4 step tests-gather-cuda 60 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_decode_bf16.py \
    tests/test_jax_one_rank.py -k "cuda_gather or cuda_rows or straight_from_the_tokens"
  TAIL=4 step sanitizer-memcheck-gather 60 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_decode_bf16.py -k "cuda_gather"
  TAIL=14 step bench-jax-ffi 80 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=12 step jax-profile-mxfp8 30 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8 --top 8
  ;;
24)
  # (the day's sixth session) The one-rank combine in one pass (moe_ep_combine_reduce_encode:
  # sum, round trip, NaN flag and output encode), no stash in a forward-only program, the
  # mxfp8 rows' gather-decode a bf16 pair at a time: tests, memcheck, bench, profile, table.
  jaxffi_build
  TAIL=4 step tests-native-cuda 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_cuda.py \
    tests/test_native_decode_bf16.py -k "combine_reduce or cuda_gather or cuda_rows or rows_on_every"
  TAIL=4 step tests-jax-one-rank-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_one_rank.py \
    -k "native_paths or straight_from or input_error"
  TAIL=4 step tests-jax-ffi-cuda 100 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py -k "cuda"
  TAIL=4 step sanitizer-memcheck-encode 120 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_cuda.py tests/test_native_decode_bf16.py -k "combine_reduce_encode or cuda_gather"
  TAIL=14 step bench-jax-ffi 80 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=12 step jax-profile-mxfp8 30 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8 --top 10
  TAIL=3 step conformance-jax-ffi 70 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 45 --report-md "$o/conformance-jax-ffi-ep1.md"
  ;;
26)
  # (the day's seventh session) Deciding first: the GEMM checks and timings, then jax-ffi's
  # bench with the new default (pingpong 128x128 for a float32 D) and with the cooperative kernel.
  TAIL=45 step gemm-check 120 .devbuild/moe_ep_gemm_check
  TAIL=12 step sass-hgmma 60 bash -c "cuobjdump --dump-sass .devbuild/moe_ep_gemm_check | awk '/Function :/ {f=\$3} /HGMMA/ {n[f]++} END {for (k in n) print n[k], k}' | sort -k2 | cut -c1-160"
  jaxffi_build
  TAIL=14 step bench-jax-ffi 90 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=14 step bench-jax-ffi-coop 90 env MOE_EP_GEMM_KNN=cooperative "$py" -m moe_ep_spec.cli bench --device cuda \
    --ep-size 1 --backend jax-ffi --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 \
    --op forward --json "$o/bench-jax-ffi-coop.json" --no-progress
  TAIL=12 step jax-profile-mxfp8 40 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8 --top 10
  TAIL=4 step tests-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
    tests/test_native_decode_bf16.py tests/test_native_cuda.py -k "cuda"
  TAIL=4 step sanitizer-memcheck-rows 60 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_native_decode_bf16.py -k "cuda_rows or rows_on_every or cuda_gather"
  TAIL=14 step bench-cuda-nccl 90 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 --op forward \
    --json "$o/bench-cuda-nccl.json" --no-progress
  # What limits the decode's mxfp8-weights GEMM (issue 15's decode target): one launch under
  # Nsight Compute's counters, clocks left alone.
  TAIL=80 step ncu-mxfp8-weights-gemm 90 ncu --clock-control none --set full -k regex:mxfp8_weights_gemm -s 16 -c 1 \
    .devbuild/moe_ep_gemm_check --mxfp8-weights
  ;;
27)
  TAIL=45 step gemm-check 150 .devbuild/moe_ep_gemm_check
  jaxffi_build
  # The two kernels alternating (clocks drift over a run): 1x2, 2x1, 1x2, 2x1.
  i=0
  for knn in cooperative_1x2 cooperative cooperative_1x2 cooperative; do
    i=$((i + 1))
    TAIL=14 step "bench-jax-ffi-$i-$knn" 90 env MOE_EP_GEMM_KNN=$knn "$py" -m moe_ep_spec.cli bench --device cuda \
      --ep-size 1 --backend jax-ffi --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 \
      --op forward --json "$o/bench-jax-ffi-$i-$knn.json" --no-progress
  done
  TAIL=12 step jax-profile-mxfp8 40 "$py" scripts/gpu_jax_ffi_profile.py --tokens 4096 --format mxfp8 --top 10
  TAIL=4 step tests-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
    tests/test_native_cuda.py tests/test_jax_one_rank.py -k "cuda or native_paths or straight_from"
  TAIL=14 step bench-cuda-nccl 100 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 --op forward \
    --op forward_backward --json "$o/bench-cuda-nccl.json" --no-progress
  ;;
28)
  TAIL=50 step gemm-check 150 .devbuild/moe_ep_gemm_check
  TAIL=14 step bench-cuda-nccl 120 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend cuda-nccl \
    --tokens 128 --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 \
    --op forward --json "$o/bench-cuda-nccl.json" --no-progress
  jaxffi_build
  TAIL=20 step bench-jax-ffi 90 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=4 step tests-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
    tests/test_cuda_nccl_block_scaled.py tests/test_native_mxfp8_weights.py -k "cuda"
  TAIL=6 step sanitizer-memcheck-gemm 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    .devbuild/moe_ep_gemm_check --no-time
  TAIL=3 step conformance-nccl-ep1 90 env MOE_EP_CUDA_NCCL_EXCHANGE=device MOE_EP_EXCHANGE_PEERS=nccl \
    MOE_EP_LOAD_PLUGINS=reference,cuda-nccl "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 \
    --device cuda --report-md "$o/conformance-nccl-ep1.md"
  TAIL=3 step conformance-jax-ffi 100 "$py" -m moe_ep_spec.cli conformance --backend jax-ffi --device cuda --ep-size 1 \
    --timeout 90 --report-md "$o/conformance-jax-ffi-ep1.md"
  ;;
29)
  TAIL=4 step tests-native-cuda 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
    tests/test_native_mxfp8_weights.py tests/test_native_cuda.py -k "test_cuda_ or test_native_cuda"
  TAIL=4 step tests-cuda-nccl-block 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_cuda_nccl_block_scaled.py -k "test_cuda_explicit or test_cuda_tensor or test_cuda_values"
  jaxffi_build
  TAIL=14 step bench-jax-ffi 90 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --backend jax-ffi \
    --tokens 4096 "${shape[@]}" --format bf16 --format mxfp8 --intermediate-format bf16 --op forward \
    --json "$o/bench-jax-ffi.json" --no-progress
  TAIL=4 step tests-jax-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_jax_ffi.py \
    tests/test_jax_one_rank.py -k "cuda or native_paths or straight_from or input_error"
  ;;
30)
  TAIL=80 step profile-fwd-bwd 150 "$py" scripts/gpu_layer_profile.py --mode device --format bf16 \
    --intermediate-format bf16 --intermediate-format none --iters 3 --top 16
  ;;
31)
  TAIL=40 mxw_gemm_check 120
  mxw_sass
  mxw_memcheck 120
  decode_bench_ab
  TAIL=4 step tests-mxfp8-weights 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py \
    -k "test_cuda_"
  ;;
32)
  TAIL=60 mxw_gemm_check 150
  mxw_sass
  decode_bench_ab
  mxw_memcheck 150
  TAIL=4 step tests-mxfp8-weights 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py \
    -k "test_cuda_"
  ;;
33)
  TAIL=60 mxw_gemm_check 150
  mxw_sass
  decode_bench_ab
  mxw_memcheck 150
  TAIL=4 step tests-mxfp8-weights 120 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py \
    -k "test_cuda_"
  ;;
34)
  TAIL=60 mxw_gemm_check 150
  mxw_memcheck 150
  decode_bench_ab
  TAIL=30 step profile-decode-mxw1 90 env MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS=1 "$py" scripts/gpu_layer_profile.py \
    --mode device --tokens 128 --format mxfp8 --intermediate-format bf16 --iters 5 --top 16
  TAIL=4 step tests-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py \
    tests/test_native_layer.py -k "test_cuda_"
  ;;
35)
  TAIL=60 mxw_gemm_check 150
  mxw_memcheck 150
  decode_bench_ab
  TAIL=4 step tests-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py \
    tests/test_native_layer.py -k "test_cuda_"
  ;;
36)
  TAIL=60 mxw_gemm_check 150
  mxw_memcheck 150
  decode_bench_ab
  TAIL=4 step tests-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_mxfp8_weights.py \
    tests/test_native_layer.py -k "test_cuda_"
  ;;
37)
  TAIL=60 mxw_gemm_check 150
  mxw_memcheck 150
  decode_bench_ab
  TAIL=4 step tests-native-cuda 150 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py \
    tests/test_native_mxfp8_weights.py tests/test_native_cuda.py -k "test_cuda_ or test_native_cuda"
  ;;
38)
  mxw_tests 150 tests/test_cuda_nccl_block_scaled.py
  TAIL=8 decode_bench default bf16
  TAIL=8 decode_bench mxw0 bf16 MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS=0
  conformance_nccl_ep1 120
  ;;
39)
  # (the day's ninth session) The mxfp8-weights GEMM with the x rows as the MMA's n8 B operand
  # (rows in steps of 8, the new default) against the m16 layout: both checked and timed,
  # memcheck on the new default, Nsight Compute's warp states on one launch of each at FC1's
  # spread, SASS counts, the layer's decode alternated between the layouts, the CUDA tests.
  TAIL=75 mxw_gemm_check 150
  mxw_memcheck 100
  TAIL=120 step ncu-mxw-sections 120 ncu --clock-control none -k regex:mxfp8_weights_gemm_kernel -c 2 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section ComputeWorkloadAnalysis --print-details all .devbuild/moe_ep_gemm_check --mxfp8-weights-profile
  TAIL=60 step ncu-mxw-stalls 60 ncu --clock-control none -k regex:mxfp8_weights_gemm_kernel -c 2 \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum" \
    .devbuild/moe_ep_gemm_check --mxfp8-weights-profile
  mxw_sass
  i=0
  for lay in n8 m16 n8 m16; do
    i=$((i + 1))
    TAIL=6 decode_bench "$i-$lay" bf16 MOE_EP_MXW_LAYOUT=$lay
  done
  mxw_tests 100
  ;;
40)
  # After run 39 (the n8 layout won; a fifth of its stalls were instruction-cache misses):
  # the n8 kernel alone, its stages on the fast decode without the slow decode in their code.
  # Alternated against run 39's build and a build with the slow decode out of line (their
  # gemm_check binaries carried as moe_ep_gemm_check_run39 and _noinline); then memcheck,
  # the warp states, SASS counts, the layer's decode and its profile, the CUDA tests and the
  # cuda-nccl table at EP 1.
  TAIL=40 mxw_gemm_check 150
  TAIL=12 step gemm-check-run39 150 .devbuild/moe_ep_gemm_check_run39 --mxfp8-weights
  TAIL=12 step gemm-check-noinline 150 .devbuild/moe_ep_gemm_check_noinline --mxfp8-weights
  TAIL=12 step gemm-check-again 150 .devbuild/moe_ep_gemm_check --mxfp8-weights
  mxw_memcheck 100
  TAIL=30 step ncu-mxw-stalls 60 ncu --clock-control none -k regex:mxfp8_weights_gemm_kernel -c 1 \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active" \
    .devbuild/moe_ep_gemm_check --mxfp8-weights-profile
  mxw_sass
  for i in 1 2; do TAIL=6 decode_bench "$i" bf16; done
  TAIL=30 step profile-decode 90 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 --format mxfp8 \
    --intermediate-format bf16 --iters 5 --top 20
  mxw_tests 100
  conformance_nccl_ep1 150
  ;;
41)
  # After run 40 (a stage's fast/slow choice was per lane, so the .aligned MMAs diverged and
  # the checks with planted scale codes hung): the choice is warp-uniform now. The checks
  # and timings, memcheck, the SASS of the decode's kernel, the layer's decode, the CUDA
  # tests and the cuda-nccl table at EP 1.
  TAIL=40 mxw_gemm_check 150
  mxw_memcheck 120
  step sass-dump-few-rows 60 bash -c "cuobjdump --dump-sass --function '_ZN6moe_ep4cuda3mxw25mxfp8_weights_gemm_kernelINS1_6ConfigILi6ELi2ELi3EEEEEvNS0_16Mxfp8WeightsGemmE' .devbuild/moe_ep_gemm_check"
  for i in 1 2; do TAIL=6 decode_bench "$i" bf16; done
  mxw_tests 150
  conformance_nccl_ep1 150
  ;;
42)
  # The mxfp8-weights GEMM applies the FC2 epilogue itself (router weight, combine round trip;
  # checked bit for bit against the plain kernel and the epilogue), and cuda-nccl takes the
  # codes up to 48 rows an expert: checks and timings, memcheck, the layer's decode and its
  # profile, the CUDA tests and the cuda-nccl table at EP 1.
  TAIL=50 mxw_gemm_check 150
  mxw_memcheck 120
  for i in 1 2; do TAIL=6 decode_bench "$i" bf16; done
  TAIL=30 step profile-decode 90 "$py" scripts/gpu_layer_profile.py --mode device --tokens 128 --format mxfp8 \
    --intermediate-format bf16 --iters 5 --top 20
  mxw_tests 200 tests/test_native_layer.py
  conformance_nccl_ep1 150
  ;;
43)
  # The session's record: the checks and timings (FC2 with the fused epilogue alternated
  # against the plain kernel), the cuda-nccl bench at 128 tokens in the three formats, and
  # test_cuda_nccl_block_scaled.py's CUDA tests, which run 38 cut short.
  TAIL=30 mxw_gemm_check 150
  TAIL=8 step bench-cuda-nccl-decode-formats 120 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 \
    --backend cuda-nccl --tokens 128 "${shape[@]}" --format bf16 --format mxfp8 --format nvfp4 \
    --intermediate-format bf16 --op forward --json "$o/bench-cuda-nccl-decode-formats.json" --no-progress
  TAIL=4 step tests-cuda-block-scaled 280 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/test_cuda_nccl_block_scaled.py -k "test_cuda_tensor_cores or test_cuda_explicit or test_cuda_values"
  ;;
44)
  # The final build (run 43: the fused FC2 epilogue cost the GEMM as much as the kernel it
  # replaced, so it was taken out again): checks and timings, memcheck, the layer's decode,
  # the CUDA tests of the mxfp8-weights forward and the layer, the cuda-nccl table at EP 1.
  TAIL=30 mxw_gemm_check 150
  mxw_memcheck 120
  for i in 1 2; do TAIL=6 decode_bench "$i" bf16; done
  mxw_tests 200 tests/test_native_layer.py
  conformance_nccl_ep1 150
  ;;
45)
  # Three x planes in one pass (FC2 of a float32 or mxfp8 intermediate, the bench's default
  # intermediate_format none): the checks (3 planes at few and many rows, NaN code, inexact
  # block) and FC2's timing, one pass against a launch a plane, alternated; memcheck; the
  # CUDA tests (the intermediate-mxfp8 case takes the one-pass kernel); the decode forward
  # with intermediate_format none, the codes against the kept decode, alternated, then bf16;
  # the cuda-nccl table at EP 1.
  TAIL=40 mxw_gemm_check 150
  mxw_memcheck 120
  mxw_tests 200 tests/test_native_layer.py
  i=0
  for mx in 1 0 1; do
    i=$((i + 1))
    TAIL=6 decode_bench "none-$i-mxw$mx" none MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS=$mx
  done
  TAIL=6 decode_bench bf16 bf16
  conformance_nccl_ep1 150
  ;;
*) echo "no RUN $RUN"; exit 2 ;;
esac
