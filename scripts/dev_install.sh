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
for dir in conformance backends/*/; do
  if [ -f "$dir/pyproject.toml" ]; then
    echo "installing $dir"
    pip_install -e "$dir"
  fi
done
python -c "import moe_ep_spec, sys; print('moe-ep-spec', moe_ep_spec.__version__, 'on Python', sys.version.split()[0])"
