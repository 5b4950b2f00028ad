#!/usr/bin/env bash
# Run on a device machine (see docs/gpu.md): builds the native core and the
# jax-ffi extension with CUDA (sm_90) from this checkout, then checks them:
#   1. the CUDA kernels against the CPU kernels (tests/test_native_cuda.py) and
#      the CPU kernels against the reference (tests/test_native.py);
#   2. the same CUDA tests under compute-sanitizer (memcheck, initcheck, racecheck);
#   3. the jax-ffi tests and the conformance suite on jax-ffi on GPU at each EP size.
#
#   bash scripts/gpu_native_check.sh EP_SIZES...     e.g. `bash scripts/gpu_native_check.sh 1 2` on 2 GPUs
#   STEPS="tests sanitizer" bash scripts/gpu_native_check.sh     only some steps (default: all of
#                                    tests sanitizer jaxffi conformance; the build always runs and
#                                    is incremental when the build folders are still there)
#
# Writes logs and reports to reports/gpu-native/, and packs them into
# $OUT/gpu-native-logs.tgz when OUT is set (the device tool returns few files).
set -uo pipefail
cd "$(dirname "$0")/.."
out="reports/gpu-native"
mkdir -p "$out"
eps=("$@")
[ ${#eps[@]} -gt 0 ] || eps=(1)
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then  # the device image has no pytest (docs/gpu.md)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$py" -m pip install -q --no-build-isolation --no-deps -e . -e ./conformance -e ./backends/jax 2>&1 | grep -v "^WARNING" || true
export MOE_EP_NATIVE_CUDA=1 MOE_EP_CUDA_ARCHS="${MOE_EP_CUDA_ARCHS:-90}"
status=0
for pkg in backends/native backends/jax_ffi; do
  echo "== build $pkg with CUDA (archs $MOE_EP_CUDA_ARCHS)"
  "$py" -m pip install --no-build-isolation --no-deps -e "$pkg" > "$out/build-$(basename "$pkg").log" 2>&1 \
    || { echo "build of $pkg failed:"; tail -n 40 "$out/build-$(basename "$pkg").log"; status=1; }
done
moe_ep() { "$py" -m moe_ep_spec.cli "$@"; }
steps=" ${STEPS:-tests sanitizer jaxffi conformance} "
want() { [[ "$steps" == *" $1 "* ]]; }
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvcc --version | tail -n 2
  "$py" -c "import moe_ep_native as m; print(m.build_info())"
  "$py" -c "import jax, jaxlib; print('jax', jax.__version__, 'devices', jax.devices())"
} 2>&1 | tee "$out/environment.txt"
moe_ep backends | tee "$out/backends.txt"

if want tests; then
echo "== native kernels: CPU vs reference, CUDA vs CPU"
"$py" -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_native_cuda.py 2>&1 | tail -n 25 \
  | tee "$out/test-native.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want sanitizer; then
echo "== compute-sanitizer on the CUDA kernels"
for tool in memcheck initcheck racecheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
    "$py" -m pytest -q -p no:cacheprovider -x tests/test_native_cuda.py 2>&1 | tail -n 30 \
    | tee "$out/sanitizer-$tool.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
fi

if want jaxffi; then
echo "== jax-ffi tests"
"$py" -m pytest -q -p no:cacheprovider tests/test_jax_ffi.py 2>&1 | tail -n 25 | tee "$out/test-jax-ffi.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
want conformance || eps=()
for ep in "${eps[@]+"${eps[@]}"}"; do
  echo "== conformance: jax-ffi on CUDA, ep $ep"
  moe_ep conformance --backend jax-ffi --device cuda --ep-size "$ep" --timeout 300 \
    --report-md "$out/conformance-jax-ffi-cuda-ep$ep.md" 2>&1 | tail -n 25 \
    | tee "$out/conformance-jax-ffi-cuda-ep$ep.log"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo "status: $status" | tee "$out/status.txt"
if [ -n "${OUT:-}" ]; then tar -czf "$OUT/gpu-native-logs.tgz" -C "$out" .; fi
exit $status
