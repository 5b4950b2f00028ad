"""examples/plugin: the third-party backend package, installed and checked in a clean venv.

The test does what a plugin author does: make a new virtual environment, ``pip
install`` the core, the conformance package and the plugin (no editable installs,
no path tricks), then ask ``moe-ep backends`` whether the entry point was found
and run ``moe-ep conformance --quick`` on the plugin's process-per-rank backend.

The sources are copied to ``tmp_path`` first so that the builds leave no
``build/`` or ``*.egg-info`` in the repository. The venv is made without pip when
this environment's pip can install into it (``pip --python``), which skips
ensurepip; the packages' builds use build isolation unless the venv's own
setuptools satisfies their build requirement. It needs the package index the
project's dependencies come from (numpy, ml_dtypes, pluggy, pytest, and setuptools
for the builds); pip's cache is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIR = Path("examples") / "plugin"
BACKEND = "example-loopback"
DISTRIBUTION = "moe-ep-example-plugin"

INSTALL_TIMEOUT_S = 600
SUITE_TIMEOUT_S = 300
COMMAND_TIMEOUT_S = 120

#: Whether the venv's own setuptools can build the packages without build isolation
#: (their build requirement is setuptools>=68; before 70.1 setuptools also needs wheel).
_CAN_BUILD_IN_PLACE = """
import importlib.metadata as m
def version(name):
    try:
        return tuple(int(part) for part in m.version(name).split(".")[:2])
    except Exception:
        return None
st = version("setuptools")
print(int(st is not None and st >= (68, 0) and (st >= (70, 1) or version("wheel") is not None)))
"""

#: Checks inside the venv that the command line does not reach.
_IN_VENV_CHECKS = """
import importlib.metadata, json
import moe_ep_spec, moe_ep_example, moe_ep_conformance
from moe_ep_example.exchange import RendezvousError

backend = moe_ep_spec.get_backend("example-loopback")
assert backend.version == moe_ep_example.__version__ == importlib.metadata.version("moe-ep-example-plugin")
assert moe_ep_spec.plugin_failures() == ()
config = moe_ep_spec.MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2)
world = moe_ep_spec.inputs.random_world(config, num_tokens=[2, 3], seed=0)
ctx = moe_ep_spec.RankContext(rank=1, num_ranks=2, rendezvous="tcp://192.0.2.1:29500", timeout_s=5)
try:
    backend.forward_rank(config, ctx, world[1])
except RendezvousError as exc:
    refused = str(exc)
else:
    raise AssertionError("a non-loopback rendezvous was accepted")
print(json.dumps({"quick_cases": len(moe_ep_conformance.quick_cases()), "refused": refused}))
"""


def _copy_sources(dest: Path) -> Path:
    """The repository's sources without VCS data, virtual environments or build output."""
    shutil.copytree(
        ROOT,
        dest,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "reports", "*.pyc"
        ),
    )
    return dest


def _outer_pip_can_target(minimum: tuple = (22, 3)) -> bool:
    """Whether this environment's pip can install into another interpreter
    (``pip --python``, pip >= 22.3): then the new venv is made without pip,
    which saves running ensurepip."""
    try:
        from importlib.metadata import version

        return tuple(int(p) for p in version("pip").split(".")[:2]) >= minimum
    except Exception:  # noqa: BLE001 - no pip here, or an odd version: use the venv's own
        return False


def _make_venv(venv: Path) -> List[str]:
    """Create a clean venv; return the pip command that installs into it."""
    outer = _outer_pip_can_target()
    cmd = [sys.executable, "-m", "venv"] + (["--without-pip"] if outer else []) + [str(venv)]
    created = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    assert created.returncode == 0, _explain(created)
    python = str(_bin(venv) / "python")
    return [sys.executable, "-m", "pip", "--python", python] if outer else [python, "-m", "pip"]


def _bin(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin")


def _venv_env(venv: Path) -> Dict[str, str]:
    """The environment of a shell with ``venv`` activated, and nothing of ours leaking in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "MOE_EP_", "VIRTUAL_ENV", "CONDA_PREFIX", "__PYVENV"))
        and k not in ("PIP_USER", "PIP_TARGET", "PIP_PREFIX", "PIP_REQUIRE_VIRTUALENV")
    }
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = str(_bin(venv)) + os.pathsep + os.environ.get("PATH", "")
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _run(cmd: Sequence[str], env: Dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def _explain(proc: subprocess.CompletedProcess) -> str:
    return (
        f"command: {' '.join(map(str, proc.args))}\nexit code: {proc.returncode}\n"
        f"--- stdout (tail) ---\n{proc.stdout[-6000:]}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}"
    )


def test_example_plugin_installs_registers_and_conforms(tmp_path: Path) -> None:
    src = _copy_sources(tmp_path / "src")
    venv = tmp_path / "venv"
    pip = _make_venv(venv)
    env = _venv_env(venv)
    python = _bin(venv) / "python"

    # Install the core, the conformance package and the plugin, as a user would (not editable).
    probe = _run([python, "-c", _CAN_BUILD_IN_PLACE], env, tmp_path, COMMAND_TIMEOUT_S)
    assert probe.returncode == 0, _explain(probe)
    install: List[str] = pip + ["install", "-q"]
    if probe.stdout.strip() == "1":
        install.append("--no-build-isolation")
    if (src / "constraints.txt").is_file():
        install += ["-c", str(src / "constraints.txt")]
    install += [str(src), str(src / "conformance"), str(src / PLUGIN_DIR)]
    installed = _run(install, env, tmp_path, INSTALL_TIMEOUT_S)
    assert installed.returncode == 0, _explain(installed)

    # The entry point is found: the table...
    table = _run([_bin(venv) / "moe-ep", "backends"], env, tmp_path, COMMAND_TIMEOUT_S)
    assert table.returncode == 0, _explain(table)
    assert "failed" not in table.stderr, _explain(table)
    rows = {line.split()[0]: line.split() for line in table.stdout.splitlines()[1:] if line.strip()}
    assert BACKEND in rows, _explain(table)
    row = rows[BACKEND]
    assert row[2] == "yes" and row[3] == DISTRIBUTION and "launch=process-per-rank" in row, _explain(table)
    assert "reference" in rows, _explain(table)

    # ... and the JSON say the same.
    listing = _run([_bin(venv) / "moe-ep", "backends", "--json"], env, tmp_path, COMMAND_TIMEOUT_S)
    assert listing.returncode == 0, _explain(listing)
    data = json.loads(listing.stdout)
    assert data["plugin_failures"] == []
    entry = next(b for b in data["backends"] if b["name"] == BACKEND)
    assert entry["available"] is True, entry
    assert entry["distribution"] == DISTRIBUTION
    assert entry["capabilities"]["launch"] == "process-per-rank"

    checks = _run([python, "-c", _IN_VENV_CHECKS], env, tmp_path, COMMAND_TIMEOUT_S)
    assert checks.returncode == 0, _explain(checks)
    facts = json.loads(checks.stdout.strip().splitlines()[-1])
    assert "192.0.2.1" in facts["refused"] and "loopback" in facts["refused"]
    num_cases = facts["quick_cases"]
    assert num_cases > 0

    # The conformance suite, quick subset: every case passes.
    report_path = tmp_path / "r.json"
    suite = _run(
        [_bin(venv) / "moe-ep", "conformance", "--backend", BACKEND, "--quick", "--report-json", report_path],
        env,
        tmp_path,
        SUITE_TIMEOUT_S,
    )
    assert suite.returncode == 0, _explain(suite)
    report = json.loads(report_path.read_text())
    meta = report["backends"][BACKEND]
    assert meta["distribution"] == DISTRIBUTION and meta["launch"] == "process-per-rank", meta
    cases = report["cases"]
    assert len(cases) == num_cases, f"{len(cases)} cases in the report; quick_cases() has {num_cases}"
    not_passed = [(c["id"], c["outcome"], c["reason"]) for c in cases if c["outcome"] != "passed"]
    assert not not_passed, not_passed
    assert all(c["backend"] == BACKEND for c in cases)
    assert report["summary"][BACKEND]["passed"] == num_cases
