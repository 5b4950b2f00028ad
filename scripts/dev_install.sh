#!/usr/bin/env bash
# Install moe-ep-spec for development into the active Python environment:
# the core and reference (with test tools), the conformance package, the
# benchmark harness, and every backend distribution under backends/, all editable. (examples/plugin is a
# third-party example; tests/test_example_plugin.py installs it in a fresh venv.)
#
#   python3 -m venv .venv && . .venv/bin/activate && bash scripts/dev_install.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
pip_install() { python -m pip install --disable-pip-version-check -q -c "$root/constraints.txt" "$@"; }
# One line per step, with the seconds since the start (the whole install takes minutes:
# torch and jax are large, and the native builds compile C++).
start=$SECONDS
step() { echo "dev_install: [$((SECONDS - start))s] $*"; }

step "installing the core and the reference, editable, with the test tools (moe-ep-spec[test])"
pip_install -e ".[test]"
step "installing the benchmark harness (bench[plot,progress])"
pip_install -e "bench[plot,progress]"
# Pure-Python distributions first (conformance, then every backend without a
# native build, in name order: jax before jax_ffi needs), then the native ones,
# then the pure-Python ones that need the native core (cuda_nccl needs moe-ep-native).
native=()
after_native=()
for dir in conformance backends/*/; do
  [ -f "$dir/pyproject.toml" ] || continue
  if grep -q "scikit_build_core" "$dir/pyproject.toml"; then
    native+=("$dir")
  elif grep -q '"moe-ep-native' "$dir/pyproject.toml"; then
    after_native+=("$dir")
  else
    step "installing $dir"
    pip_install -e "$dir"
  fi
done

# The native distributions (backends/native, backends/jax_ffi) are CMake projects
# built by scikit-build-core, without build isolation (backends/jax_ffi compiles
# against the XLA FFI headers of the jax installed above). They need a C++17
# compiler, the Python headers and cmake >= 3.21 (installed here when missing,
# with ninja); MOE_EP_NATIVE_CUDA=1 also builds the CUDA kernels (needs nvcc), and
# MOE_EP_NATIVE_NCCL=1 with it the NCCL transport the cuda-nccl backend needs.
missing=()
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 \
  || missing+=("a C++17 compiler (c++, g++ or clang++; Debian: apt-get install g++)")
python -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
  || missing+=("the Python development headers (Python.h; Debian: apt-get install python3-dev)")
if [ ${#missing[@]} -gt 0 ]; then
  echo "dev_install: cannot build ${native[*]}: missing" >&2
  for m in "${missing[@]}"; do echo "  - $m" >&2; done
  echo "  Install them and run this script again; everything else is installed except ${after_native[*]:-nothing}" >&2
  echo "  (they need the native core)." >&2
  exit 1
fi
step "installing the native build tools (scikit-build-core, nanobind; ninja and cmake when missing)"
pip_install "scikit-build-core>=0.10" "nanobind>=2"
command -v ninja >/dev/null 2>&1 || command -v make >/dev/null 2>&1 || pip_install ninja
if ! python - <<'PY'
import re, shutil, subprocess, sys
exe = shutil.which("cmake")
if exe is None:
    sys.exit(1)
out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
m = re.search(r"(\d+)\.(\d+)", out)
sys.exit(0 if m and (int(m.group(1)), int(m.group(2))) >= (3, 21) else 1)
PY
then
  echo "dev_install: cmake >= 3.21 not on PATH; installing it from the package registry"
  pip_install "cmake>=3.21"
fi
for dir in "${native[@]}"; do
  step "installing $dir (compiling the native core: a few minutes)"
  pip_install --no-build-isolation -e "$dir"
done
for dir in "${after_native[@]}"; do
  step "installing $dir"
  pip_install -e "$dir"
done
python -c "import moe_ep_spec, sys; print('moe-ep-spec', moe_ep_spec.__version__, 'on Python', sys.version.split()[0])"
step "done; try: moe-ep backends"
