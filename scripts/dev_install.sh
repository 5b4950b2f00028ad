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

pip_install -e ".[test]"
pip_install -e "bench[plot,progress]"
# The native distributions (backends/native, backends/jax_ffi) are CMake projects
# built by scikit-build-core: they are built without build isolation, with the
# build tools installed here first (and jax's XLA FFI headers, which the jax
# backend's install brings, before backends/jax_ffi). They need cmake >= 3.21
# and a C++17 compiler on PATH; MOE_EP_NATIVE_CUDA=1 also builds the CUDA kernels.
pip_install "scikit-build-core>=0.10" "nanobind>=2"
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
  echo "dev_install: no C++ compiler on PATH (c++ or g++): the native core (backends/native, backends/jax_ffi)" >&2
  echo "  needs one with C++17 support; install it (Debian: apt-get install g++) and run this again." >&2
  exit 1
fi
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
for dir in conformance backends/*/; do
  if [ -f "$dir/pyproject.toml" ]; then
    echo "installing $dir"
    if grep -q "scikit_build_core" "$dir/pyproject.toml"; then
      pip_install --no-build-isolation -e "$dir"
    else
      pip_install -e "$dir"
    fi
  fi
done
python -c "import moe_ep_spec, sys; print('moe-ep-spec', moe_ep_spec.__version__, 'on Python', sys.version.split()[0])"
