#!/usr/bin/env bash
# Run on a device machine (see docs/gpu.md): installs the project from this
# checkout without touching the package registry, then checks the GPU backends.
#
#   bash scripts/gpu_check.sh EP_SIZES...      e.g. `bash scripts/gpu_check.sh 1 2` on 2 GPUs
#
# Writes reports to $OUT (or ./reports/gpu when OUT is unset).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-reports/gpu}"
mkdir -p "$out"
eps=("$@")
[ ${#eps[@]} -gt 0 ] || eps=(1)
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
# The device image has no pytest: carry wheels in .whl (docs/gpu.md says how).
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$py" -m pip install -q --no-build-isolation --no-deps -e . -e ./conformance -e ./backends/torch 2>&1 | grep -v "^WARNING" || true
moe_ep() { "$py" -m moe_ep_spec.cli "$@"; }
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import torch, numpy, ml_dtypes, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version(), 'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, 'pytest', pytest.__version__)"
} | tee "$out/environment.txt"
moe_ep backends | tee "$out/backends.txt"
status=0
for ep in "${eps[@]}"; do
  echo "== conformance: torch on CUDA, ep $ep"
  moe_ep conformance --backend torch --device cuda --ep-size "$ep" --timeout 300 \
    --report-md "$out/conformance-torch-cuda-ep$ep.md" --report-json "$out/conformance-torch-cuda-ep$ep.json" \
    2>&1 | tail -n 25 | tee "$out/conformance-torch-cuda-ep$ep.log" || status=1
done
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  echo "== autograd training step over NCCL, 2 ranks"
  "$py" scripts/gpu_training_step.py 2 | tee "$out/training-step-nccl.txt" || status=1
fi
echo "== torch backend tests (the CUDA ones run here only)"
"$py" -m pytest -q -p no:cacheprovider tests/test_torch_backend.py 2>&1 | tail -n 15 | tee "$out/test-torch-backend.txt" || status=1
exit $status
