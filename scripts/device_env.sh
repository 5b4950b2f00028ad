# Sourced by the device scripts (scripts/gpu_layer_check.sh, scripts/gpu_exchange_check.sh)
# from the repository root: the environment a run over a carried build needs on the
# device image, which has no pytest and no package registry.
#   - the wheels carried in .whl (pytest and friends) into /tmp/site;
#   - the native core built here by scripts/build_cuda.sh, carried in .devbuild
#     (MOE_EP_NATIVE_LIBRARY points the binding at it; the package itself from the tree);
#   - the pure-Python distributions installed editable, without their dependencies.
# Sets: py (the interpreter), PYTHONUNBUFFERED, NCCL_SOCKET_IFNAME (loopback),
# MOE_EP_NATIVE_LIBRARY and PYTHONPATH.
py="${PYTHON:-python3}"
# The one-call session scripts' step: step NAME SECONDS CMD... runs CMD bounded by SECONDS,
# its output in $o/NAME.txt, and prints its exit status, its time and the log's last
# ${TAIL:-6} lines.
step() {
  local name="$1" secs="$2"; shift 2
  local t0=$SECONDS
  timeout -k 5 "$secs" "$@" > "${o:?step needs o, the log directory}/$name.txt" 2>&1
  echo "== $name rc=$? ($((SECONDS - t0)) s)"
  tail -n "${TAIL:-6}" "$o/$name.txt"
}
export PYTHONUNBUFFERED=1 NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export MOE_EP_NATIVE_LIBRARY="${MOE_EP_NATIVE_LIBRARY:-$PWD/.devbuild/libmoe_ep_native.so}"
export PYTHONPATH="$PWD/backends/native:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
timeout 120 "$py" -m pip install -q --no-build-isolation --no-deps -e . -e ./conformance -e ./bench \
  -e ./backends/torch -e ./backends/cuda_nccl 2>&1 | grep -v "^WARNING" || true
