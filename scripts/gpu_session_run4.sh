#!/usr/bin/env bash
# One device call (2026-12-01, third session): the block formats' FC2 epilogue with four
# values a lane (it took 4.2 ms of the 10.6 ms mxfp8 forward as one thread per block):
# the layer's CUDA tests (bit for bit against the CPU kernels), the quick conformance table
# at EP 1 (the format cases), and the bench's block-scaled forward.
#   OUT=/tmp/o bash scripts/gpu_session_run4.sh
set -uo pipefail
cd "$(dirname "$0")/.."
o="${OUT:-reports}/run4"; mkdir -p "$o"
. scripts/device_env.sh
step tests-layer 90 "$py" -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_native_layer.py -k cuda
step conformance-quick 90 "$py" -m moe_ep_spec.cli conformance --backend cuda-nccl --ep-size 1 --quick \
  --report-md "$o/conformance-quick-ep1.md"
TAIL=20 step bench-formats 150 "$py" -m moe_ep_spec.cli bench --device cuda --ep-size 1 --tokens 128 --tokens 4096 \
  --hidden 7168 --intermediate 2048 --experts 32 --topk 8 --intermediate-format bf16 --backend cuda-nccl \
  --format mxfp8 --format nvfp4 --op forward --json "$o/bench-formats.json" --no-progress
