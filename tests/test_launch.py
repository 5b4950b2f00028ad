"""moe_ep_spec.launch: world and process-per-rank backends behind one call."""

from __future__ import annotations

import time

import numpy as np
import pytest
from rank_backends import CrashingRank, HangingRank, LoopbackReference

import moe_ep_spec
from moe_ep_spec import MoeEpConfig, RoutingIndexError
from moe_ep_spec.inputs import random_world
from moe_ep_spec.launch import RankCrashError, RankTimeoutError, call_world

CONFIG = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2, generate_c=True)


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_world_backend_called_directly() -> None:
    world = random_world(CONFIG, num_tokens=[3, 2])
    ref = moe_ep_spec.get_backend("reference")
    out = call_world(ref, "forward", CONFIG, world)
    assert len(out) == 2 and out[0].output.shape == (3, 32)


def test_process_per_rank_forward_and_backward_match_the_reference() -> None:
    world = random_world(CONFIG, num_tokens=[3, 4], seed=2)
    ref = moe_ep_spec.get_backend("reference")
    want = ref.forward(CONFIG, world)
    got = call_world(LoopbackReference(), "forward", CONFIG, world, timeout_s=60)
    for g, w in zip(got, want):
        assert _same(g.output, w.output) and _same(g.fc1_c, w.fc1_c) and _same(g.route_metadata, w.route_metadata)
    grads = [np.ones((3, 32), np.float32), np.full((4, 32), 0.5, np.float32)]
    stash = [w.stash for w in want]
    got_b = call_world(LoopbackReference(), "backward", CONFIG, world, grads, stash, timeout_s=60)
    want_b = ref.backward(CONFIG, world, grads, stash)
    assert all(_same(g.grad_fc1_weight, w.grad_fc1_weight) for g, w in zip(got_b, want_b))


def test_rank_error_travels_back_with_its_type() -> None:
    world = random_world(CONFIG, num_tokens=[3, 2])
    bad = world[1].topk_idx.copy()
    bad[0, 1] = 9
    world[1] = moe_ep_spec.RankInputs(world[1].activation, world[1].fc1_weight, world[1].fc2_weight, bad, world[1].topk_weights)
    with pytest.raises(RoutingIndexError, match=r"rank 1: topk_idx values must be in \[-1, num_experts\) = \[-1, 4\); got 9 at \(token 0, slot 1\)"):
        call_world(LoopbackReference(), "forward", CONFIG, world, timeout_s=60)


def test_hanging_rank_fails_within_the_timeout() -> None:
    world = random_world(CONFIG, num_tokens=2)
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"forward: ranks \[.*1.*\] gave no result within timeout_s = 4"):
        call_world(HangingRank(), "forward", CONFIG, world, timeout_s=4)
    assert time.monotonic() - start < 20


def test_crashing_rank_is_reported() -> None:
    world = random_world(CONFIG, num_tokens=2)
    with pytest.raises((RankCrashError, RankTimeoutError)) as info:
        call_world(CrashingRank(), "forward", CONFIG, world, timeout_s=10)
    if isinstance(info.value, RankCrashError):
        assert info.value.rank == 1 and info.value.exitcode == 17


def test_argument_count_checked() -> None:
    with pytest.raises(TypeError, match="backward takes 3 per-rank arguments; got 1"):
        call_world(moe_ep_spec.get_backend("reference"), "backward", CONFIG, [])
