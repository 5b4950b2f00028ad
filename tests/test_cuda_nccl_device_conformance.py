"""The conformance suite on cuda-nccl's world-level backend over the device exchange.

``MOE_EP_CUDA_NCCL_EXCHANGE=device`` runs every world-level call of ``cuda-nccl``
through the native layer's device exchange (:mod:`moe_ep_cuda_nccl.device_world`):
both layouts (the dynamic one on a worst-case static buffer cut after the one
host synchronisation), every operation, the errors shared across ranks.

On CPU (CI) the ranks' CPU layers run the exchange's CPU twin through the
``/dev/shm`` loopback provider (``MOE_EP_CUDA_NCCL_ON_CPU=1``). On a GPU
(skipped here) ``--device cuda-shared`` puts every rank on cuda:0, their
regions joined by CUDA IPC: what NCCL refuses. ``python scripts/gpu.py
conformance`` runs the whole table that way.
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


# ----------------------------------------------------------------------------- bf16 decodes that are not exact

#: mxfp8 encodes it at E8M0 scale code 0 as E4M3 3 * 2^-9, i.e. 3 * 2^-136: not a bf16 value (bf16's
#: subnormals are the multiples of 2^-133), so the bf16 operand decode makes it NaN and flags it.
TINY = 3 * 2.0**-136
EXTREME_CONFIG = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=2,
                             max_tokens_per_rank=12, generate_c=True)


def _extreme_world(config: MoeEpConfig, tiny: str, seed: int = 4):
    """mxfp8 inputs on both ranks; rank 0 alone holds values whose bf16 decode is not exact:
    ``act`` in its token 0 (every block of the row at scale code 0), ``fc1`` in column 0 of its
    local expert 0's FC1 weight (blocked along H: both blocks at scale code 0). Rank 1's
    values are ordinary."""
    from moe_ep_spec import formats as F

    world = random_world(config, num_tokens=[12, 9], input_format="mxfp8", seed=seed)
    w0 = world[0]
    if tiny == "act":
        act = F.dequantize(w0.activation).astype(np.float64)
        act[0] = TINY * (np.arange(1, config.hidden + 1) % 7 + 1)
        enc = F.quantize(act, "mxfp8", axis=1)
        assert (enc.scale_codes()[0] <= 2).all()
        world[0] = dataclasses.replace(w0, activation=enc)
    else:
        fc1 = F.dequantize(w0.fc1_weight).astype(np.float64)
        fc1[0, :, 0] = TINY
        enc = F.quantize(fc1, "mxfp8", axis=1)
        assert (enc.scale_codes()[0, :, 0] <= 2).all()
        world[0] = dataclasses.replace(w0, fc1_weight=enc)
    # The world's own values hold no other such code: rank 1 is ordinary.
    for x in (world[1].activation, world[1].fc1_weight, world[1].fc2_weight):
        assert (x.scale_codes() > 2).all()
    return world


def _finite(x) -> bool:
    from moe_ep_spec import formats as F

    values = F.dequantize(x) if isinstance(x, F.BlockScaledTensor) else np.asarray(x, dtype=np.float32)
    return bool(np.isfinite(values).all())


def _matches_reference_on_every_rank(backend, config: MoeEpConfig, world, devices=None) -> None:
    """Forward (with the stash) and backward of ``world``: every rank's results finite and
    within the reference's budgets; no rank raises."""
    ref = get_backend("reference")
    got = call_world(backend, "forward", config, world, reuse=False, timeout_s=180, devices=devices)
    want, budgets = ref.forward_and_budget(config, world)
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal((w.topk_idx.shape[0], config.hidden)).astype(np.float32) for w in world]
    stash = [f.stash for f in want]
    got_b = call_world(backend, "backward", config, world, grads, stash, reuse=False, timeout_s=180, devices=devices)
    want_b, bud_b = ref.backward_and_budget(config, world, grads, stash)
    for r in range(config.num_ranks):
        assert _finite(got[r].output), f"rank {r}: the output holds NaN"
        _close(f"rank {r} output", got[r].output, want[r].output, budgets[r].output)
        assert np.array_equal(got[r].route_metadata, want[r].route_metadata)
        _close(f"rank {r} fc1_c", got[r].fc1_c, want[r].fc1_c, budgets[r].fc1_c)
        for name in ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"):
            assert _finite(getattr(got_b[r], name)), f"rank {r}: {name} holds NaN"
            _close(f"rank {r} {name}", getattr(got_b[r], name), getattr(want_b[r], name), getattr(bud_b[r], name))


@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("tiny", ["act", "fc1"])
def test_values_bf16_cannot_hold_on_one_rank_give_every_rank_the_reference(device_backend, tiny, layout) -> None:
    """mxfp8 values whose bf16 decode is not exact on rank 0 only: the ranks share that in the
    table and all run exact float32 operands for the call, so no rank raises and no NaN
    reaches rank 1 through the combine (before: rank 1 got rank 0's NaN expert rows, or
    raised FormatError while its peer returned NaN)."""
    config = EXTREME_CONFIG if layout == "dynamic" else EXTREME_CONFIG.replace(recv_capacity=40, expert_alignment=4)
    _matches_reference_on_every_rank(device_backend, config, _extreme_world(config, tiny))


def test_the_inexact_check_reads_flags_only_for_low_scale_codes(monkeypatch) -> None:
    """The host check before the table: no decode for ordinary mxfp8 values (a screen of the
    scale codes), nvfp4, bf16 or float32 inputs; a decode with a flag for codes <= 2."""
    from moe_ep_cuda_nccl import device_world as W
    from moe_ep_cuda_nccl import prims as P
    from moe_ep_torch import backend as TB

    calls = []
    real = P.dequantize_bf16

    def spy(t, inexact=None, *, weight=False):
        calls.append(weight)
        return real(t, inexact, weight=weight)

    monkeypatch.setattr(P, "dequantize_bf16", spy)
    cpu = torch.device("cpu")

    def ops(w):
        return (TB.to_torch(w.activation, cpu), TB.to_torch(w.fc1_weight, cpu, weight=True),
                TB.to_torch(w.fc2_weight, cpu, weight=True))

    world = _extreme_world(EXTREME_CONFIG, "act")
    assert W._decodes_inexactly(*ops(world[0])) and calls == [False]  # only the activation has low codes
    calls.clear()
    assert not W._decodes_inexactly(*ops(world[1])) and calls == []
    for fmt in ("nvfp4", "bf16", "fp32"):
        w = random_world(EXTREME_CONFIG, num_tokens=[4, 4], input_format=fmt, seed=1)[0]
        assert not W._decodes_inexactly(*ops(w)) and calls == [], fmt
    fc1 = _extreme_world(EXTREME_CONFIG, "fc1")[0]
    assert W._decodes_inexactly(*ops(fc1)) and calls == [True]
    # exact values at a low scale code are decoded, and found exact: 2^-133 and its multiples are bf16 values
    from moe_ep_spec import formats as F

    calls.clear()
    act = np.full((2, EXTREME_CONFIG.hidden), 2.0**-133)
    exact = dataclasses.replace(world[1], activation=F.quantize(act, "mxfp8", axis=1))
    assert (exact.activation.scale_codes() <= 2).all()
    assert not W._decodes_inexactly(*ops(exact)) and calls == [False]
    # all-zero blocks (padding, pruned weights) have scale code 0 and no values: no decode
    calls.clear()
    zeros = dataclasses.replace(world[1], activation=F.quantize(np.zeros((2, EXTREME_CONFIG.hidden)), "mxfp8", axis=1))
    assert (zeros.activation.scale_codes() == 0).all()
    assert not W._decodes_inexactly(*ops(zeros)) and calls == []
    assert not P.inexact_decodes(cpu), "the check does not touch the device record"


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


@pytest.mark.skipif(not _one_gpu(), reason="needs a CUDA build of the native core and a GPU")
@pytest.mark.parametrize("tiny", ["act", "fc1"])
def test_values_bf16_cannot_hold_on_one_rank_on_one_gpu(monkeypatch, tiny) -> None:
    """The CPU test above on the device machine: 2 ranks on cuda:0 (CUDA IPC through the
    loopback provider), bf16 operands on tensor cores unless a rank's decode is inexact."""
    env = dict(DEVICE_ENV, MOE_EP_CUDA_NCCL_ON_CPU="", MOE_EP_CUDA_NCCL_TIMEOUT_S="60", MOE_EP_EXCHANGE_PEERS="ipc")
    for k, val in env.items():
        monkeypatch.setenv(k, val)
    backend = type(get_backend("cuda-nccl", require_available=False))()
    config = EXTREME_CONFIG.replace(recv_capacity=40, expert_alignment=4)
    _matches_reference_on_every_rank(backend, config, _extreme_world(config, tiny), devices=["cuda:0", "cuda:0"])
