#!/usr/bin/env bash
# Run on a device machine (see docs/benchmarks.md): installs the project from
# this checkout without the package registry, then runs `moe-ep bench` on CUDA
# for every EP size given, writing the table, JSON and PNG plots to $OUT.
#
#   bash scripts/gpu_bench.sh EP_SIZES... [-- BENCH_OPTIONS...]
#   e.g. `bash scripts/gpu_bench.sh 1 2` on 2 GPUs (DeepSeek-V3 shape, 128 and 4096 tokens, bf16 and mxfp8)
#        `bash scripts/gpu_bench.sh 2 -- --tokens 128 --tokens 1024 --tokens 4096 --repeats 10`
#
# Writes to $OUT (or ./reports/bench when OUT is unset): environment.txt, and for
# every EP size N bench-cuda-epN.{txt,json,log} and cuda-epN-{bandwidth,latency}.png.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-reports/bench}"
mkdir -p "$out"
eps=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do eps+=("$1"); shift; done
[ $# -gt 0 ] && shift
extra=("$@")
[ ${#eps[@]} -gt 0 ] || eps=(1)
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
"$py" -m pip install -q --no-build-isolation --no-deps -e . -e ./backends/torch -e ./bench 2>&1 | grep -v "^WARNING" || true
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader || true
  nvidia-smi topo -m || true
  "$py" -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version(), 'numpy', numpy.__version__)"
  "$py" -c "import matplotlib, tqdm; print('matplotlib', matplotlib.__version__, 'tqdm', tqdm.__version__)" || echo "matplotlib/tqdm missing: no plots / plain progress"
} | tee "$out/environment.txt"
status=0
for ep in "${eps[@]}"; do
  echo "== moe-ep bench --device cuda --ep-size $ep ${extra[*]:-}"
  "$py" -m moe_ep_spec.cli bench --device cuda --ep-size "$ep" \
    --json "$out/bench-cuda-ep$ep.json" --plot-dir "$out" "${extra[@]}" \
    2> "$out/bench-cuda-ep$ep.log" | tee "$out/bench-cuda-ep$ep.txt" || status=1
  tail -n 5 "$out/bench-cuda-ep$ep.log"
done
exit $status
