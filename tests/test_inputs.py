"""moe_ep_spec.inputs: reproducible random worlds."""

from __future__ import annotations

import re

import numpy as np
import pytest

from moe_ep_spec import BlockScaledTensor, ConfigError, MoeEpConfig, validation
from moe_ep_spec.formats import BF16
from moe_ep_spec.inputs import random_dispatch_world, random_topk, random_world

CONFIG = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=3, num_ranks=2)


def test_shapes_dtypes_and_validity() -> None:
    world = random_world(CONFIG, num_tokens=[5, 0], seed=3)
    assert [w.activation.shape for w in world] == [(5, 64), (0, 64)]
    for rank, w in enumerate(world):
        assert w.activation.dtype == BF16 and w.fc1_weight.dtype == BF16
        assert w.topk_idx.dtype == np.int32 and w.topk_weights.dtype == np.float32
        validation.validate_rank_inputs(CONFIG, w, rank)


def test_reproducible_and_seed_dependent() -> None:
    a = random_world(CONFIG, num_tokens=4, seed=1)
    b = random_world(CONFIG, num_tokens=4, seed=1)
    c = random_world(CONFIG, num_tokens=4, seed=2)
    assert np.array_equal(a[1].activation, b[1].activation)
    assert np.array_equal(a[1].topk_idx, b[1].topk_idx)
    assert not np.array_equal(a[1].activation, c[1].activation)
    assert np.all(np.abs(a[0].activation.astype(np.float32)) > 0)  # never zeros


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_inputs(fmt: str) -> None:
    world = random_world(CONFIG, num_tokens=3, input_format=fmt, weight_format="fp32", seed=0)
    assert isinstance(world[0].activation, BlockScaledTensor) and world[0].activation.format.value == fmt
    assert world[0].activation.axis == 1
    assert world[0].fc1_weight.dtype == np.float32


def test_routing_patterns() -> None:
    rng = np.random.default_rng(0)
    uniform = random_topk(CONFIG, 50, "uniform", rng)
    assert all(len(set(row)) == 3 for row in uniform.tolist())  # distinct experts per token
    assert (random_topk(CONFIG, 20, "skewed", rng)[:, 0] == 0).all()
    one = random_topk(CONFIG, 20, "one_rank", rng)
    assert ((one >= 0) & (one < CONFIG.num_local_experts)).all()
    mixed = random_topk(CONFIG, 200, "unused_mixed", rng)
    assert (mixed == -1).any() and (mixed >= 0).any()
    assert (random_topk(CONFIG, 4, "all_unused", rng) == -1).all()


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match=r"num_tokens must be an int or one count per rank \(num_ranks = 2\); got 3"):
        random_world(CONFIG, num_tokens=[1, 2, 3])
    with pytest.raises(ConfigError, match=r"routing must be one of"):
        random_world(CONFIG, num_tokens=1, routing="zipf")
    with pytest.raises(ConfigError, match=r"input_format must be one of"):
        random_world(CONFIG, num_tokens=1, input_format="fp64")


def test_dispatch_world_matches_forward_world() -> None:
    fw = random_world(CONFIG, num_tokens=[2, 3], seed=5)
    dw = random_dispatch_world(CONFIG, num_tokens=[2, 3], seed=5)
    for f, d in zip(fw, dw):
        assert np.array_equal(f.activation, d.tokens) and np.array_equal(f.topk_idx, d.topk_idx)


@pytest.mark.parametrize(
    "num_tokens, text",
    [
        ([-1, 4], "num_tokens[0] must be an integer >= 0; got -1"),
        (-2, "num_tokens must be an integer >= 0; got -2"),
        ([2, 1.5], "num_tokens[1] must be an integer >= 0; got float 1.5"),
        ("4", "num_tokens must be an integer >= 0 or one such count per rank (num_ranks = 2); got str '4'"),
    ],
)
def test_random_world_rejects_bad_token_counts_with_the_projects_error(num_tokens, text):
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2)
    with pytest.raises(ConfigError, match=re.escape(text)) as ei:
        random_world(config, num_tokens=num_tokens)
    assert ei.value.field == "num_tokens"
