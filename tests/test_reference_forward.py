"""The reference fused forward against the independent per-token loop (tests/naive.py).

Every comparison of encoded outputs is bit-exact: the naive loop and the
reference both compute in float64 and round once at each rounding point of the
spec, so they land on the same codes.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import moe_ep_spec
from moe_ep_spec import BlockScaledTensor, CapacityError, MoeEpConfig, RankInputs
from moe_ep_spec.formats import BF16, dequantize, round_to_bf16
from moe_ep_reference import ReferenceBackend

try:  # tests/ may or may not be a package
    from . import naive
except ImportError:
    import naive

REF = ReferenceBackend()
FORMATS = ("bf16", "mxfp8", "nvfp4")


def _bits_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(naive.output_bits(a), naive.output_bits(b)))


def assert_same_encoding(got, expected, what: str) -> None:
    """``got`` and ``expected`` are the same encoding with the same bits."""
    if isinstance(expected, BlockScaledTensor):
        assert isinstance(got, BlockScaledTensor), f"{what}: expected a BlockScaledTensor, got {type(got).__name__}"
        assert got.format is expected.format, what
        assert got.shape == expected.shape, what
        assert got.axis == 1, what
        np.testing.assert_array_equal(got.scale_codes(), expected.scale_codes(), err_msg=f"{what} scale codes")
        np.testing.assert_array_equal(got.data_codes(), expected.data_codes(), err_msg=f"{what} data codes")
    else:
        assert isinstance(got, np.ndarray) and got.dtype == BF16, f"{what}: expected bfloat16, got {got!r:.80}"
        assert got.shape == expected.shape, what
        np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16), err_msg=what)


def check_forward(config: MoeEpConfig, world):
    """Run the reference and the naive loop; assert bit-exact agreement of
    outputs (and of the stash when ``generate_c``). Returns both results."""
    got = REF.forward(config, world)
    expected = naive.naive_forward(config, world)
    assert len(got) == config.num_ranks
    for r, (g, e) in enumerate(zip(got, expected)):
        assert_same_encoding(g.output, e.output, f"rank {r} output")
        if config.generate_c:
            assert g.fc1_c.dtype == BF16 and g.route_metadata.dtype == np.int32
            np.testing.assert_array_equal(g.route_metadata, e.route_metadata, err_msg=f"rank {r} route_metadata")
            np.testing.assert_array_equal(g.fc1_c.view(np.uint16), e.fc1_c.view(np.uint16), err_msg=f"rank {r} fc1_c")
        else:
            assert g.fc1_c is None and g.route_metadata is None and g.stash is None
    return got, expected


def cfg(**kw) -> MoeEpConfig:
    base = dict(num_experts=4, hidden=16, intermediate=8, num_topk=2, num_ranks=2)
    base.update(kw)
    return MoeEpConfig(**base)


TOKENS = {1: [7], 2: [5, 0], 4: [3, 0, 6, 1]}


# ---------------------------------------------------------------- worlds


@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
def test_matches_naive_loop_uneven_tokens_and_unused_slots(num_ranks):
    config = cfg(num_experts=8, num_topk=3, num_ranks=num_ranks, generate_c=True)
    world = naive.make_world(config, seed=num_ranks, tokens_per_rank=TOKENS[num_ranks], unused_prob=0.3)
    assert any((inp.topk_idx == -1).any() for inp in world)
    got, expected = check_forward(config, world)
    for r, n in enumerate(TOKENS[num_ranks]):
        assert got[r].output.shape == (n, config.hidden)
    total_routes = sum(int((inp.topk_idx >= 0).sum()) for inp in world)
    assert sum(g.route_metadata.shape[0] for g in got) == total_routes
    # Not vacuous: tokens with a valid slot produce non-zero output.
    r0 = next(r for r, n in enumerate(TOKENS[num_ranks]) if n)
    has_route = (world[r0].topk_idx >= 0).any(axis=1)
    assert np.all(np.abs(got[r0].output[has_route].astype(np.float32)).max(axis=1) > 0)


@pytest.mark.parametrize(
    "index_dtype,act_dtype,topk_dtype",
    [(np.int32, BF16, np.float32), (np.int64, np.float16, BF16), (np.int32, np.float32, np.float16)],
    ids=["idx-int32-act-bf16", "idx-int64-act-fp16-w-bf16", "idx-int32-w-fp16"],
)
def test_input_dtypes(index_dtype, act_dtype, topk_dtype):
    config = cfg(num_ranks=2, generate_c=True)
    world = naive.make_world(
        config, 11, [4, 3], index_dtype=index_dtype, activation_dtype=act_dtype, topk_weight_dtype=topk_dtype,
        weight_dtype=act_dtype,
    )
    check_forward(config, world)


def test_every_slot_unused_gives_zero_output_and_empty_stash():
    config = cfg(num_ranks=2, generate_c=True)
    world = naive.make_world(config, 3, [4, 2], routing="none", unused_prob=0.0)
    got, _ = check_forward(config, world)
    for r, g in enumerate(got):
        assert g.output.shape == (world[r].topk_idx.shape[0], config.hidden)
        assert not np.any(g.output.view(np.uint16)), "unused slots must contribute exactly +0"
        assert g.fc1_c.shape == (0, 2 * config.intermediate)
        assert g.route_metadata.shape == (0, 4)


def test_unused_slot_weights_are_ignored():
    config = cfg(num_ranks=2)
    world = naive.make_world(config, 5, [6, 4], unused_prob=0.4)
    poisoned = [
        RankInputs(
            inp.activation, inp.fc1_weight, inp.fc2_weight, inp.topk_idx,
            np.where(inp.topk_idx < 0, np.float32(np.nan), inp.topk_weights).astype(np.float32),
        )
        for inp in world
    ]
    assert any(np.isnan(p.topk_weights).any() for p in poisoned)
    a, b = REF.forward(config, world), REF.forward(config, poisoned)
    for r in range(2):
        np.testing.assert_array_equal(a[r].output.view(np.uint16), b[r].output.view(np.uint16))


@pytest.mark.parametrize("one_expert", [0, 3], ids=["expert0-rank0", "expert3-rank1"])
def test_all_routes_to_one_expert(one_expert):
    config = cfg(num_ranks=2, generate_c=True)
    world = naive.make_world(config, 7, [5, 3], routing="one_expert", one_expert=one_expert, unused_prob=0.2)
    got, _ = check_forward(config, world)
    owner = one_expert // config.num_local_experts
    assert got[1 - owner].route_metadata.shape == (0, 4)
    meta = got[owner].route_metadata
    assert meta.shape[0] == sum(int((inp.topk_idx >= 0).sum()) for inp in world)
    assert np.all(meta[:, 0] == one_expert % config.num_local_experts)


def test_duplicate_expert_ids_within_a_token():
    config = cfg(num_experts=4, num_topk=3, num_ranks=2, generate_c=True)
    world = naive.make_world(config, 9, [6, 5], routing="duplicates", unused_prob=0.0)
    got, _ = check_forward(config, world)
    # A token routed twice to the same expert processes two rows, one per slot.
    idx = world[0].topk_idx
    e = int(idx[0, 0])
    assert idx[0, -1] == e
    meta = got[e // 2].route_metadata
    rows = meta[(meta[:, 1] == 0) & (meta[:, 2] == 0) & (meta[:, 0] == e % 2)]
    assert sorted(rows[:, 3].tolist()) == sorted(np.nonzero(idx[0] == e)[0].tolist())


def test_duplicate_slots_are_separate_routes_summed():
    """Two slots of one token to the same expert are two routes, each rounded by
    the combine format and then summed: with weights 1/4 and 1/2 (powers of two
    commute with every rounding) the output is exactly bf16(3 * y(1/4))."""
    config = cfg(num_experts=2, num_topk=2, num_ranks=1, hidden=16)
    base = naive.make_world(config, 13, [3], routing="one_expert", one_expert=1, unused_prob=0.0)[0]
    w = np.array([[0.25, 0.5]] * 3, dtype=np.float32)
    two = RankInputs(base.activation, base.fc1_weight, base.fc2_weight, base.topk_idx, w)
    one = RankInputs(
        base.activation, base.fc1_weight, base.fc2_weight,
        np.array([[1, -1]] * 3, dtype=np.int64), np.array([[0.25, 0.0]] * 3, dtype=np.float32),
    )
    a = REF.forward(config, [two])[0].output.astype(np.float64)
    b = REF.forward(config, [one])[0].output.astype(np.float64)
    # 0.25 * y and 0.5 * y are power-of-two multiples of the same y: the combine
    # rounding commutes with them, so the sum is exactly 3 * bf16(0.25 y).
    np.testing.assert_array_equal(a, round_to_bf16(3.0 * b).astype(np.float64))


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize(
    "output_format,combine_format",
    list(itertools.product(FORMATS, FORMATS)),
    ids=[f"out-{o}-combine-{c}" for o, c in itertools.product(FORMATS, FORMATS)],
)
def test_output_and_combine_formats(output_format, combine_format):
    config = cfg(num_ranks=2, hidden=32, output_format=output_format, combine_format=combine_format)
    world = naive.make_world(config, 17, [5, 3])
    got, expected = check_forward(config, world)
    if output_format != "bf16":
        out = got[0].output
        assert out.format.value == output_format and out.scale.shape == (5, 32 // out.block_size)
    # The combine rounding matters: a different combine format changes the bits.
    if combine_format != "bf16":
        other = REF.forward(config.replace(combine_format="bf16"), world)
        assert not all(_bits_equal(a.output, b.output) for a, b in zip(got, other))


BLOCK_INPUT_CASES = [
    # (activation, fc1, fc2, hidden, intermediate)
    ("mxfp8", "mxfp8", "mxfp8", 64, 32),
    ("nvfp4", "nvfp4", "nvfp4", 32, 16),
    ("mxfp8", "nvfp4", None, 32, 8),
    (None, "mxfp8", "nvfp4", 32, 16),
    ("mxfp8", None, None, 40, 8),  # partial last mxfp8 block along H (32 + 8)
    ("nvfp4", "nvfp4", None, 40, 8),  # partial last nvfp4 block along H (16 + 16 + 8)
    (None, None, "nvfp4", 16, 40),  # partial last nvfp4 block along I (16 + 16 + 8)
    ("nvfp4", "mxfp8", "mxfp8", 16, 40),  # partial last mxfp8 block along I (32 + 8)
]


@pytest.mark.parametrize(
    "act_fmt,fc1_fmt,fc2_fmt,hidden,intermediate",
    BLOCK_INPUT_CASES,
    ids=[f"act-{a or 'fp32'}-fc1-{b or 'fp32'}-fc2-{c or 'fp32'}-H{h}-I{i}" for a, b, c, h, i in BLOCK_INPUT_CASES],
)
def test_block_scaled_inputs(act_fmt, fc1_fmt, fc2_fmt, hidden, intermediate):
    config = cfg(num_ranks=2, hidden=hidden, intermediate=intermediate, generate_c=True)
    world = naive.make_world(
        config, 19, [4, 3], activation_format=act_fmt, fc1_format=fc1_fmt, fc2_format=fc2_fmt, unused_prob=0.1
    )
    if fc2_fmt is not None:
        block = world[0].fc2_weight.block_size
        assert world[0].fc2_weight.scale.shape == (2, -(-intermediate // block), hidden)
    got, _ = check_forward(config, world)
    # Input decode is exact: the same values as plain float32 give the same bits.
    plain = [
        RankInputs(
            dequantize(inp.activation) if act_fmt else inp.activation,
            dequantize(inp.fc1_weight) if fc1_fmt else inp.fc1_weight,
            dequantize(inp.fc2_weight) if fc2_fmt else inp.fc2_weight,
            inp.topk_idx,
            inp.topk_weights,
        )
        for inp in world
    ]
    for a, b in zip(got, REF.forward(config, plain)):
        assert_same_encoding(a.output, b.output, "block-scaled vs decoded float32 inputs")
        np.testing.assert_array_equal(a.fc1_c.view(np.uint16), b.fc1_c.view(np.uint16))


# ---------------------------------------------------------------- weight placement


@pytest.mark.parametrize("intermediate_format", [None, "bf16", "mxfp8", "nvfp4"], ids=lambda f: f"inter-{f}")
def test_weight_placements(intermediate_format):
    base = cfg(num_ranks=2, hidden=16, intermediate=32, intermediate_format=intermediate_format)
    world = naive.make_world(base, 23, [6, 5], unused_prob=0.1)
    in_fc1, in_fc1_naive = check_forward(base.replace(apply_topk_in_fc1=True), world)
    in_fc2, in_fc2_naive = check_forward(base.replace(apply_topk_in_fc1=False), world)
    for r in range(2):
        a, b = in_fc1_naive[r].presum, in_fc2_naive[r].presum
        if intermediate_format is None:
            # Equal in exact arithmetic: float64 agrees to ~1e-12, and so do the bits.
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(in_fc1[r].output.view(np.uint16), in_fc2[r].output.view(np.uint16))
        else:
            assert np.max(np.abs(a - b)) > 1e-6
    if intermediate_format is not None:
        assert not all(_bits_equal(a.output, b.output) for a, b in zip(in_fc1, in_fc2))


@pytest.mark.parametrize("intermediate_format", ["bf16", "mxfp8", "nvfp4"], ids=lambda f: f"inter-{f}")
def test_power_of_two_router_weights_make_placements_agree(intermediate_format):
    """R(w h) = w R(h) for a power-of-two w: every format here is scale-invariant
    under powers of two, so the placements agree bit for bit."""
    base = cfg(num_ranks=2, hidden=16, intermediate=32, intermediate_format=intermediate_format)
    world = naive.make_world(base, 29, [6, 5], unused_prob=0.1)
    rng = np.random.default_rng(0)
    world = [
        RankInputs(
            inp.activation, inp.fc1_weight, inp.fc2_weight, inp.topk_idx,
            (2.0 ** rng.integers(-3, 2, size=inp.topk_idx.shape)).astype(np.float32),
        )
        for inp in world
    ]
    a = REF.forward(base.replace(apply_topk_in_fc1=True), world)
    b = REF.forward(base.replace(apply_topk_in_fc1=False), world)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.output.view(np.uint16), y.output.view(np.uint16))


# ---------------------------------------------------------------- clamp


@pytest.mark.parametrize("placement", [True, False], ids=["weight-in-fc1", "weight-in-fc2"])
@pytest.mark.parametrize("clamp", [None, 0.5, -0.5], ids=["no-clamp", "clamp0.5", "clamp-neg0.5"])
def test_clamp(clamp, placement):
    config = cfg(num_ranks=2, gate_up_clamp=clamp, apply_topk_in_fc1=placement, generate_c=True)
    world = naive.make_world(config, 31, [6, 4], act_scale=2.0)
    got, expected = check_forward(config, world)
    c = np.concatenate([e.c for e in expected])
    i = config.intermediate
    # The world does hit the clamp on both sides.
    assert (c[:, :i] > 0.5).mean() > 0.1 and (c[:, i:] > 0.5).mean() > 0.1 and (c[:, i:] < -0.5).mean() > 0.1
    unclamped = REF.forward(config.replace(gate_up_clamp=None), world)
    changed = not all(_bits_equal(a.output, b.output) for a, b in zip(got, unclamped))
    assert changed == (clamp is not None)
    if clamp is not None:
        # fc1_c is the pre-clamp value: values beyond the limit are kept.
        assert np.abs(got[0].fc1_c.astype(np.float64)).max() > 0.5


def test_clamp_far_away_is_the_identity():
    config = cfg(num_ranks=2)
    world = naive.make_world(config, 37, [5, 4])
    a = REF.forward(config, world)
    b = REF.forward(config.replace(gate_up_clamp=1e6), world)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.output.view(np.uint16), y.output.view(np.uint16))


def test_gate_clamp_is_upper_only():
    """A hand-made route: gate far below -L is not clamped (silu(-8) is tiny but
    not silu(-L)), up far below -L is."""
    config = MoeEpConfig(num_experts=1, hidden=1, intermediate=1, num_topk=1, gate_up_clamp=1.0)
    x = np.array([[1.0]], np.float32)
    w1 = np.array([[[-8.0, -8.0]]], np.float32)  # g = -8, u = -8 -> u clamped to -1
    w2 = np.array([[[1.0]]], np.float32)
    inp = RankInputs(x, w1, w2, np.array([[0]], np.int64), np.array([[1.0]], np.float32))
    out = REF.forward(config, [inp])[0].output.astype(np.float64)[0, 0]
    silu = -8.0 / (1.0 + np.exp(8.0))
    assert out == float(round_to_bf16(np.float64(silu * -1.0)).astype(np.float64))


# ---------------------------------------------------------------- stash


@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
def test_generate_c_stash(num_ranks):
    config = cfg(num_experts=8, num_topk=3, num_ranks=num_ranks, generate_c=True, gate_up_clamp=0.25)
    world = naive.make_world(config, 41, TOKENS[num_ranks], routing="duplicates", unused_prob=0.2)
    got, expected = check_forward(config, world)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g.fc1_c.view(np.uint16), round_to_bf16(e.c).view(np.uint16))
        meta = g.route_metadata
        # Expert-major: sorted lexicographically by (local_expert, src_rank, src_token, src_slot).
        keys = [tuple(row) for row in meta.tolist()]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert g.stash is not None and g.stash.fc1_c is g.fc1_c


def test_stash_metadata_hand_checked():
    config = cfg(num_experts=4, num_topk=2, num_ranks=2, generate_c=True)
    idx = [np.array([[0, 1], [2, 0], [1, -1]]), np.array([[3, 0], [-1, -1]])]
    world = [
        RankInputs(
            np.ones((i.shape[0], 16), np.float32), np.ones((2, 16, 16), np.float32) / 16,
            np.ones((2, 8, 16), np.float32) / 8, i.astype(np.int64), np.full(i.shape, 0.5, np.float32),
        )
        for i in idx
    ]
    got = REF.forward(config, world)
    np.testing.assert_array_equal(
        got[0].route_metadata, [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1], [1, 0, 0, 1], [1, 0, 2, 0]]
    )
    np.testing.assert_array_equal(got[1].route_metadata, [[0, 0, 1, 0], [1, 1, 0, 0]])
    # c = sum of 16 * (1 * 1/16) = 1 in every column.
    assert np.all(got[0].fc1_c.astype(np.float32) == 1.0)


@pytest.mark.parametrize("alignment", [1, 4], ids=lambda a: f"align{a}")
@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
def test_static_layout_stash(num_ranks, alignment):
    dyn = cfg(num_experts=8, num_topk=3, num_ranks=num_ranks, generate_c=True)
    world = naive.make_world(dyn, 43, TOKENS[num_ranks], unused_prob=0.2)
    capacity = max(int(p.offsets[-1]) for p in naive.naive_plan(dyn.replace(recv_capacity=1000, expert_alignment=alignment), [w.topk_idx for w in world])) + 3
    config = dyn.replace(recv_capacity=capacity, expert_alignment=alignment)
    got, expected = check_forward(config, world)
    dynamic = REF.forward(dyn, world)
    for r, (g, e, d) in enumerate(zip(got, expected, dynamic)):
        assert g.fc1_c.shape == (capacity, 2 * config.intermediate) and g.route_metadata.shape == (capacity, 4)
        pad = g.route_metadata[:, 0] < 0
        assert pad.sum() >= 3
        assert np.all(g.route_metadata[pad] == -1)
        assert not np.any(g.fc1_c[pad].view(np.uint16)), "padding rows of fc1_c must be +0"
        # Every slab starts at a multiple of the alignment.
        for le in range(config.num_local_experts):
            rows = np.nonzero(g.route_metadata[:, 0] == le)[0]
            if rows.size:
                assert rows[0] % alignment == 0 and np.all(np.diff(rows) == 1)
        # Same routes and values as the dynamic layout.
        np.testing.assert_array_equal(g.route_metadata[~pad], d.route_metadata)
        np.testing.assert_array_equal(g.fc1_c[~pad].view(np.uint16), d.fc1_c.view(np.uint16))
        np.testing.assert_array_equal(g.output.view(np.uint16), d.output.view(np.uint16))


def test_static_layout_hand_checked():
    config = cfg(num_experts=4, num_topk=2, num_ranks=2, generate_c=True, recv_capacity=8, expert_alignment=4)
    idx = [np.array([[0, 1], [0, 2], [1, -1]]), np.array([[0, 3], [-1, -1]])]
    world = naive.make_world(config, 47, [3, 2])
    world = [RankInputs(w.activation, w.fc1_weight, w.fc2_weight, i.astype(np.int64), w.topk_weights) for w, i in zip(world, idx)]
    got, _ = check_forward(config, world)
    pad = [-1, -1, -1, -1]
    np.testing.assert_array_equal(
        got[0].route_metadata,
        [[0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], pad, [1, 0, 0, 1], [1, 0, 2, 0], pad, pad],
    )
    np.testing.assert_array_equal(got[1].route_metadata, [[0, 0, 1, 1], pad, pad, pad, [1, 1, 0, 1], pad, pad, pad])


def test_capacity_error_when_aligned_rows_exceed_recv_capacity():
    config = cfg(num_experts=4, num_topk=2, num_ranks=2, recv_capacity=7, expert_alignment=4)
    idx = [np.array([[0, 1], [0, 2], [1, -1]]), np.array([[0, 3], [-1, -1]])]
    world = naive.make_world(config, 47, [3, 2])
    world = [RankInputs(w.activation, w.fc1_weight, w.fc2_weight, i.astype(np.int64), w.topk_weights) for w, i in zip(world, idx)]
    with pytest.raises(naive.NaiveCapacityError):
        naive.naive_plan(config, idx)
    expected = (
        "rank 0: received rows after aligning every expert's slab to expert_alignment = 4 must be <= "
        "recv_capacity = 7; got 8 (5 routes, per local expert [3, 2])"
    )
    with pytest.raises(CapacityError, match=re.escape(expected)) as info:
        REF.forward(config, world)
    assert info.value.limit == 7 and info.value.got == 8
    # Exactly enough rows is fine.
    REF.forward(config.replace(recv_capacity=8), world)
    # 5 routes would fit 7 rows without the alignment.
    REF.forward(config.replace(expert_alignment=1), world)


# ---------------------------------------------------------------- NaN isolation

NAN_CASES = {
    "bf16": dict(),
    "block-formats": dict(hidden=32, intermediate=16, output_format="mxfp8", combine_format="nvfp4", intermediate_format="nvfp4"),
    "static-aligned": dict(recv_capacity=32, expert_alignment=4, generate_c=True),
    "clamp-weight-in-fc2": dict(gate_up_clamp=0.5, apply_topk_in_fc1=False, generate_c=True),
}


@pytest.mark.parametrize("case", list(NAN_CASES), ids=list(NAN_CASES))
def test_nan_in_one_token_stays_in_that_token(case):
    config = cfg(num_ranks=2, num_topk=2, **NAN_CASES[case])
    world = naive.make_world(config, 53, [6, 5], unused_prob=0.0)
    src, tok = 1, 2
    act = world[src].activation.copy()
    act[tok, 3] = np.nan
    poisoned = list(world)
    poisoned[src] = RankInputs(act, *(getattr(world[src], f) for f in ("fc1_weight", "fc2_weight", "topk_idx", "topk_weights")))
    clean, dirty = REF.forward(config, world), REF.forward(config, poisoned)
    # The NaN token shares an expert with other tokens (so the test means something).
    experts = set(world[src].topk_idx[tok].tolist())
    others = {int(e) for r in range(2) for t, row in enumerate(world[r].topk_idx) if (r, t) != (src, tok) for e in row}
    assert experts & others
    for r in range(2):
        a, b = clean[r].output, dirty[r].output
        keep = np.ones(a.shape[0], bool)
        if r == src:
            keep[tok] = False
            assert np.all(np.isnan(dequantize(b, np.float64)[tok])), "the NaN token's own output is NaN"
        da, db = dequantize(a, np.float64), dequantize(b, np.float64)
        assert np.all(np.isfinite(db[keep]))
        np.testing.assert_array_equal(db[keep], da[keep])
        if isinstance(a, BlockScaledTensor):
            np.testing.assert_array_equal(b.data_codes()[keep], a.data_codes()[keep])
            np.testing.assert_array_equal(b.scale_codes()[keep], a.scale_codes()[keep])
        else:
            np.testing.assert_array_equal(b.view(np.uint16)[keep], a.view(np.uint16)[keep])
        if config.generate_c:
            meta = dirty[r].route_metadata
            mine = (meta[:, 1] == src) & (meta[:, 2] == tok)
            assert np.all(np.isnan(dirty[r].fc1_c[mine].astype(np.float32)))
            np.testing.assert_array_equal(dirty[r].fc1_c[~mine].view(np.uint16), clean[r].fc1_c[~mine].view(np.uint16))


def test_registry_returns_the_reference():
    backend = moe_ep_spec.get_backend("reference")
    assert backend.name == "reference"
    config = cfg(num_ranks=2)
    world = naive.make_world(config, 59, [3, 2])
    for a, b in zip(backend.forward(config, world), naive.naive_forward(config, world)):
        assert_same_encoding(a.output, b.output, "registry reference")
