"""The conformance suite on cuda-nccl's world-level backend over the device exchange.

``MOE_EP_CUDA_NCCL_EXCHANGE=device`` runs every world-level call of ``cuda-nccl``
through the native layer's device exchange (:mod:`moe_ep_cuda_nccl.device_world`):
both layouts (the dynamic one on a worst-case static buffer cut after the one
host synchronisation), every operation, the errors shared across ranks.

On CPU (CI) the ranks' CPU layers run the exchange's CPU twin through the
``/dev/shm`` loopback provider (``MOE_EP_CUDA_NCCL_ON_CPU=1``). On a GPU
(skipped here) ``--device cuda-shared`` puts every rank on cuda:0, their
regions joined by CUDA IPC: what NCCL refuses. scripts/gpu_exchange_check.sh,
step ``conformance``, runs the whole table that way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("moe_ep_cuda_nccl")

import moe_ep_native  # noqa: E402
from moe_ep_spec import DispatchInputs, MoeEpConfig, MoeEpError, get_backend  # noqa: E402
from moe_ep_spec.inputs import random_world  # noqa: E402
from moe_ep_spec.launch import call_world  # noqa: E402
from moe_ep_spec.tolerance import compare  # noqa: E402

#: The environment of the CPU mode over the device exchange (bounded waits: a lost peer fails in 30 s, not 300).
DEVICE_ENV = {
    "MOE_EP_CUDA_NCCL_ON_CPU": "1",
    "MOE_EP_CUDA_NCCL_EXCHANGE": "device",
    "MOE_EP_CUDA_NCCL_TIMEOUT_S": "30",
    "MOE_EP_LOAD_PLUGINS": "reference,cuda-nccl",
}
SUMMARY = re.compile(r"cuda-nccl \S+: (\d+) passed, (\d+) failed, (\d+) skipped")


def _conformance(tmp_path, *args: str, env: dict, timeout: float = 600):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep_spec.cli", "conformance", "--backend", "cuda-nccl", "--timeout", "120",
         "--report-json", str(report), *args],
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=dict(os.environ, **env),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = SUMMARY.search(proc.stdout)
    assert summary, out[-3000:]
    passed, failed, skipped = map(int, summary.groups())
    data = json.loads(report.read_text())
    versions = data["backends"]["cuda-nccl"]["framework_versions"]
    assert versions["exchange"].startswith("device"), versions  # the run went through the device exchange
    return passed, failed, skipped, data


def _ep_sizes(data) -> set:
    return {c["params"]["num_ranks"] for c in data["cases"]}


def test_quick_table_at_ep_2_and_4_over_the_device_exchange_on_cpu(tmp_path) -> None:
    passed, failed, skipped, data = _conformance(tmp_path, "--quick", "--ep-size", "2", "--ep-size", "4",
                                                 env=DEVICE_ENV)
    assert failed == 0 and skipped == 0 and passed >= 80, (passed, failed, skipped)
    assert _ep_sizes(data) == {2, 4}
    ops = {c["params"]["op"] for c in data["cases"]}
    assert {"forward", "forward_stash", "backward", "dispatch", "combine", "dispatch_backward", "combine_backward",
            "bad_input", "nan_isolation"} <= ops
    layouts = {c["params"]["layout"] for c in data["cases"] if c["params"]["op"] != "formats"}
    assert layouts == {"dynamic", "static"}


def test_full_table_at_ep_2_and_4_over_the_device_exchange_on_cpu(tmp_path) -> None:
    """Every case at EP 2 and 4 (349 today, about 35 s): each through the device exchange's stages."""
    passed, failed, skipped, data = _conformance(tmp_path, "--ep-size", "2", "--ep-size", "4", env=DEVICE_ENV,
                                                 timeout=1200)
    assert failed == 0 and skipped == 0 and passed >= 300, (passed, failed, skipped)
    assert _ep_sizes(data) == {2, 4}


def test_quick_table_in_slot_order_at_ep_2_and_3(tmp_path) -> None:
    """MOE_EP_CUDA_NCCL_COMBINE=slot: one combine row per route, the slot-order sums."""
    env = dict(DEVICE_ENV, MOE_EP_CUDA_NCCL_COMBINE="slot")
    passed, failed, skipped, data = _conformance(tmp_path, "--quick", "--ep-size", "2", "--ep-size", "3", env=env)
    assert failed == 0 and skipped == 0 and passed >= 60, (passed, failed, skipped)
    assert _ep_sizes(data) == {2, 3}


# ----------------------------------------------------------------------------- through call_world


@pytest.fixture
def device_backend(monkeypatch):
    """A fresh cuda-nccl backend in the CPU mode over the device exchange (the rank
    processes inherit the environment; every call starts its own pool)."""
    for k, val in DEVICE_ENV.items():
        monkeypatch.setenv(k, val)
    return type(get_backend("cuda-nccl", require_available=False))()


def _close(name, got, want, budget) -> None:
    c = compare(name, got, want, np.asarray(budget, dtype=np.float64))
    assert c.ok, c.describe()


def test_dynamic_layout_without_max_tokens_per_rank(device_backend) -> None:
    """No max_tokens_per_rank: the host table's largest token count (to a power of
    two) sizes the exchange; forward, stash and backward as the reference's."""
    config = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=3, num_ranks=2, generate_c=True)
    world = random_world(config, num_tokens=[13, 5], seed=3)
    ref = get_backend("reference")
    got = call_world(device_backend, "forward", config, world, reuse=False, timeout_s=120)
    want, budgets = ref.forward_and_budget(config, world)
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal((w.topk_idx.shape[0], config.hidden)).astype(np.float32) for w in world]
    stash = [f.stash for f in want]
    got_b = call_world(device_backend, "backward", config, world, grads, stash, reuse=False, timeout_s=120)
    want_b, bud_b = ref.backward_and_budget(config, world, grads, stash)
    for r in range(2):
        _close(f"rank {r} output", got[r].output, want[r].output, budgets[r].output)
        assert got[r].route_metadata.shape == want[r].route_metadata.shape  # cut to the routed rows
        assert np.array_equal(got[r].route_metadata, want[r].route_metadata)
        _close(f"rank {r} fc1_c", got[r].fc1_c, want[r].fc1_c, budgets[r].fc1_c)
        for name in ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"):
            _close(f"rank {r} {name}", getattr(got_b[r], name), getattr(want_b[r], name), getattr(bud_b[r], name))


def test_handles_carry_the_routing_and_a_foreign_handle_is_refused_on_every_rank(device_backend) -> None:
    config = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=2, max_tokens_per_rank=8)
    world = random_world(config, num_tokens=[6, 4], seed=5)
    dworld = [DispatchInputs(w.activation, w.topk_idx, w.topk_weights) for w in world]
    got = call_world(device_backend, "dispatch", config, dworld, reuse=False, timeout_s=120)
    for r, d in enumerate(got):
        st = d.handle.backend_state
        assert st["exchange"] == "device" and np.array_equal(st["topk_idx"], world[r].topk_idx)
    # a handle of the NCCL / host-synchronised dispatch (no routing in it): refused before any stage
    handles = [d.handle for d in got]
    foreign = [dataclasses.replace(h, backend_state={"send_route": None}) for h in handles]
    rows = [np.zeros((h.num_recv_rows, config.hidden), np.float32) for h in handles]
    with pytest.raises(MoeEpError, match="not made by cuda-nccl's dispatch over the device exchange"):
        call_world(device_backend, "combine", config, foreign, rows, reuse=False, timeout_s=60)


# ----------------------------------------------------------------------------- options


def test_cuda_shared_puts_every_rank_on_cuda_0() -> None:
    from moe_ep_conformance.cli import pytest_args
    from moe_ep_conformance.runner import DEVICES, _devices

    assert "cuda-shared" in DEVICES
    assert _devices("cuda-shared", 4) == ["cuda:0"] * 4
    assert _devices("cuda", 2) == ["cuda:0", "cuda:1"]
    import argparse

    from moe_ep_conformance import cli

    parser = argparse.ArgumentParser()
    cli.add_command(parser.add_subparsers())
    args = parser.parse_args(["conformance", "--device", "cuda-shared", "--backend", "cuda-nccl"])
    argv = pytest_args(args)
    assert argv[argv.index("--device") + 1] == "cuda-shared"


def test_exchange_config_of_each_layout() -> None:
    from moe_ep_cuda_nccl.device_world import exchange_config

    dyn = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=4, max_tokens_per_rank=6)
    x = exchange_config(dyn, 100)
    assert (x.recv_capacity, x.expert_alignment, x.max_tokens_per_rank) == (4 * 6 * 2, 1, 6)
    static = dyn.replace(recv_capacity=64, expert_alignment=4)
    assert exchange_config(static, 100) is static
    free = dyn.replace(max_tokens_per_rank=None)
    assert exchange_config(free, 16).recv_capacity == 4 * 16 * 2


# ----------------------------------------------------------------------------- one GPU (device machine)


def _one_gpu() -> bool:
    try:
        return moe_ep_native.has_cuda() and torch.cuda.is_available() and torch.cuda.device_count() >= 1
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _one_gpu(), reason="needs a CUDA build of the native core and a GPU")
def test_quick_table_at_ep_2_and_4_on_one_gpu(tmp_path) -> None:
    env = dict(DEVICE_ENV, MOE_EP_CUDA_NCCL_ON_CPU="", MOE_EP_CUDA_NCCL_TIMEOUT_S="60")
    passed, failed, skipped, _ = _conformance(
        tmp_path, "--quick", "--ep-size", "2", "--ep-size", "4", "--device", "cuda-shared", env=env, timeout=1800,
    )
    assert failed == 0 and skipped == 0 and passed >= 80, (passed, failed, skipped)
