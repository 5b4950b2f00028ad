"""Every input check of :mod:`moe_ep_spec.validation`, with the messages pinned."""

from __future__ import annotations

import copy
import re

import ml_dtypes
import numpy as np
import pytest

from moe_ep_spec import (
    BlockScaledTensor,
    CapacityError,
    DispatchHandle,
    DispatchInputs,
    DTypeError,
    FormatError,
    MoeEpConfig,
    MoeEpError,
    RankInputs,
    RoutingIndexError,
    ShapeError,
    Stash,
    quantize,
)
from moe_ep_spec import validation as V

BF16 = np.dtype(ml_dtypes.bfloat16)

E, H, I, K, RANKS = 8, 64, 32, 2, 2
EL = E // RANKS
T = 64


@pytest.fixture
def cfg():
    return MoeEpConfig(num_experts=E, hidden=H, intermediate=I, num_topk=K, num_ranks=RANKS, max_tokens_per_rank=100)


def rank_inputs(t=T, **changes):
    rng = np.random.default_rng(0)
    d = dict(
        activation=rng.standard_normal((t, H)).astype(np.float32),
        fc1_weight=rng.standard_normal((EL, H, 2 * I)).astype(BF16),
        fc2_weight=rng.standard_normal((EL, I, H)).astype(np.float16),
        topk_idx=rng.integers(0, E, (t, K)).astype(np.int32),
        topk_weights=rng.random((t, K)).astype(np.float32),
    )
    d.update(changes)
    return RankInputs(**d)


def dispatch_inputs(t=T, **changes):
    rng = np.random.default_rng(1)
    d = dict(
        tokens=rng.standard_normal((t, H)).astype(BF16),
        topk_idx=rng.integers(-1, E, (t, K)).astype(np.int64),
        topk_weights=rng.random((t, K)).astype(np.float16),
    )
    d.update(changes)
    return DispatchInputs(**d)


def idx_with(pos, value, t=T, dtype=np.int64):
    idx = np.zeros((t, K), dtype=dtype)
    idx[pos] = value
    return idx


# ============================================================================ accepted inputs


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_valid_rank_inputs_return_num_tokens(cfg, rank):
    assert V.validate_rank_inputs(cfg, rank_inputs(), rank) == T
    assert V.validate_rank_inputs(cfg, rank_inputs(t=17), rank) == 17


def test_zero_tokens_are_valid(cfg):
    assert V.validate_rank_inputs(cfg, rank_inputs(t=0)) == 0
    assert V.validate_dispatch_inputs(cfg, dispatch_inputs(t=0)) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_every_plain_float_dtype_is_accepted(cfg, dtype):
    inp = rank_inputs(
        activation=np.zeros((5, H), dtype),
        fc1_weight=np.zeros((EL, H, 2 * I), dtype),
        fc2_weight=np.zeros((EL, I, H), dtype),
        topk_idx=np.zeros((5, K), np.int64),
        topk_weights=np.zeros((5, K), dtype),
    )
    assert V.validate_rank_inputs(cfg, inp) == 5


def test_minus_one_slots_are_accepted(cfg):
    idx = np.full((T, K), -1, np.int32)
    assert V.validate_rank_inputs(cfg, rank_inputs(topk_idx=idx)) == T
    idx = np.array([[-1, E - 1], [0, -1]], np.int64)
    assert V.validate_dispatch_inputs(cfg, dispatch_inputs(t=2, topk_idx=idx)) == 2


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_inputs_blocked_along_reduction_axis_are_accepted(cfg, fmt):
    rng = np.random.default_rng(2)
    act = quantize(rng.standard_normal((T, H)), fmt, axis=1)
    fc1 = quantize(rng.standard_normal((EL, H, 2 * I)), fmt, axis=1)
    fc2 = quantize(rng.standard_normal((EL, I, H)), fmt, axis=-2)
    assert V.validate_rank_inputs(cfg, rank_inputs(activation=act, fc1_weight=fc1, fc2_weight=fc2)) == T
    assert V.validate_dispatch_inputs(cfg, dispatch_inputs(tokens=act)) == T


def test_tokens_at_the_limit_are_accepted(cfg):
    assert V.validate_rank_inputs(cfg, rank_inputs(t=100)) == 100
    V.check_num_tokens(cfg, 100)
    V.check_num_tokens(cfg.replace(max_tokens_per_rank=None), 10**9)


# ============================================================================ topk_idx / topk_weights


def test_topk_idx_shape_message(cfg):
    msg = "topk_idx must have shape (num_tokens, num_topk) = (64, 2); got (64, 3)"
    bad = rank_inputs(topk_idx=np.zeros((64, 3), np.int64))
    with pytest.raises(ShapeError, match="^" + re.escape(msg) + "$") as ei:
        V.validate_rank_inputs(cfg, bad)
    assert ei.value.name == "topk_idx" and ei.value.expected == (64, 2) and ei.value.got == (64, 3)
    with pytest.raises(ShapeError, match="^" + re.escape("rank 1: " + msg) + "$"):
        V.validate_rank_inputs(cfg, bad, rank=1)
    with pytest.raises(ShapeError, match=re.escape(
        "rank 0: topk_idx must have shape (num_tokens, num_topk) = (64, 2); got (63, 2)"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(topk_idx=np.zeros((63, 2), np.int64)), rank=0)
    with pytest.raises(ShapeError, match=re.escape(
        "topk_idx must have shape (num_tokens, num_topk) = (64, 2); got (128,)"
    )):
        V.validate_dispatch_inputs(cfg, dispatch_inputs(topk_idx=np.zeros(128, np.int64)))


@pytest.mark.parametrize("dtype", [np.int16, np.int8, np.uint32, np.uint64, np.float32, np.bool_])
def test_topk_idx_dtype(cfg, dtype):
    name = np.dtype(dtype).name
    with pytest.raises(DTypeError, match="^" + re.escape(f"topk_idx must have dtype in (int32, int64); got {name}") + "$") as ei:
        V.validate_rank_inputs(cfg, rank_inputs(topk_idx=np.zeros((T, K), dtype)))
    assert ei.value.name == "topk_idx" and ei.value.got == name and ei.value.expected == "int32, int64"


def test_topk_idx_not_an_array(cfg):
    with pytest.raises(DTypeError, match=re.escape("rank 1: topk_idx must have dtype in (int32, int64); got list")):
        V.validate_rank_inputs(cfg, rank_inputs(topk_idx=[[0, 1]] * T), rank=1)


@pytest.mark.parametrize("value,pos", [(-2, (5, 1)), (E, (7, 0)), (-100, (0, 0)), (2**40, (63, 1))])
@pytest.mark.parametrize("rank", [None, 1])
def test_routing_index_out_of_range(cfg, value, pos, rank):
    idx = idx_with(pos, value)
    prefix = "" if rank is None else f"rank {rank}: "
    msg = (
        f"{prefix}topk_idx values must be in [-1, num_experts) = [-1, {E}); "
        f"got {value} at (token {pos[0]}, slot {pos[1]})"
    )
    with pytest.raises(RoutingIndexError, match="^" + re.escape(msg) + "$") as ei:
        V.validate_rank_inputs(cfg, rank_inputs(topk_idx=idx), rank)
    err = ei.value
    assert err.position == pos and err.value == value and err.rank == rank and err.num_experts == E
    assert isinstance(err.position[0], int) and isinstance(err.value, int)
    assert isinstance(err, ValueError) and isinstance(err, MoeEpError)


def test_routing_index_reports_first_offender_in_token_major_order(cfg):
    idx = np.zeros((T, K), np.int32)
    idx[9, 0] = -5
    idx[7, 1] = E
    idx[7, 0] = 1
    idx[30, 1] = -2
    with pytest.raises(RoutingIndexError, match=re.escape(f"got {E} at (token 7, slot 1)")) as ei:
        V.validate_dispatch_inputs(cfg, dispatch_inputs(topk_idx=idx), rank=0)
    assert ei.value.position == (7, 1) and ei.value.value == E and ei.value.rank == 0


def test_topk_weights_checks(cfg):
    with pytest.raises(DTypeError, match="^" + re.escape(
        "topk_weights must have dtype in (float32, float16, bfloat16); got float64"
    ) + "$"):
        V.validate_rank_inputs(cfg, rank_inputs(topk_weights=np.ones((T, K))))
    with pytest.raises(DTypeError, match=re.escape(
        "rank 1: topk_weights must have dtype in (float32, float16, bfloat16); got int32"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(topk_weights=np.ones((T, K), np.int32)), rank=1)
    with pytest.raises(ShapeError, match=re.escape(
        "topk_weights must have shape (num_tokens, num_topk) = (64, 2); got (64, 3)"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(topk_weights=np.ones((T, 3), np.float32)))
    with pytest.raises(DTypeError, match=re.escape(
        "topk_weights must be a numpy array with dtype in (float32, float16, bfloat16); got list"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(topk_weights=[[1.0, 1.0]] * T))


# ============================================================================ activation and weights


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex64, np.dtype(ml_dtypes.float8_e4m3fn)])
def test_activation_dtype(cfg, dtype):
    name = np.dtype(dtype).name
    with pytest.raises(DTypeError, match="^" + re.escape(
        f"rank 0: activation must have dtype in (float32, float16, bfloat16); got {name}"
    ) + "$") as ei:
        V.validate_rank_inputs(cfg, rank_inputs(activation=np.zeros((T, H), dtype)), rank=0)
    assert ei.value.name == "activation" and ei.value.got == name


def test_activation_not_an_array(cfg):
    with pytest.raises(DTypeError, match=re.escape(
        "activation must be a numpy array with dtype in (float32, float16, bfloat16); got list"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(activation=[[0.0] * H] * T))


def test_activation_shape(cfg):
    with pytest.raises(ShapeError, match=re.escape(
        "activation must have shape (num_tokens, hidden) = (?, 64); got (64, 63)"
    )) as ei:
        V.validate_rank_inputs(cfg, rank_inputs(activation=np.zeros((T, 63), np.float32)))
    assert ei.value.expected == (None, 64) and ei.value.got == (64, 63)
    with pytest.raises(ShapeError, match=re.escape(
        "rank 1: activation must have shape (num_tokens, hidden) = (?, 64); got (64,)"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(activation=np.zeros(T, np.float32)), rank=1)
    with pytest.raises(ShapeError, match=re.escape(
        "activation must have shape (num_tokens, hidden) = (?, 64); got (1, 64, 64)"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(activation=np.zeros((1, T, H), np.float32)))


def test_topk_rows_must_match_activation_rows(cfg):
    with pytest.raises(ShapeError, match=re.escape(
        "topk_idx must have shape (num_tokens, num_topk) = (10, 2); got (64, 2)"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(activation=np.zeros((10, H), np.float32)))


def test_weight_shapes(cfg):
    with pytest.raises(ShapeError, match=re.escape(
        "fc1_weight must have shape (num_local_experts, hidden, 2 * intermediate) = (4, 64, 64); got (4, 64, 32)"
    )) as ei:
        V.validate_rank_inputs(cfg, rank_inputs(fc1_weight=np.zeros((EL, H, I), np.float32)))
    assert ei.value.name == "fc1_weight"
    with pytest.raises(ShapeError, match=re.escape(
        "rank 1: fc2_weight must have shape (num_local_experts, intermediate, hidden) = (4, 32, 64); got (8, 32, 64)"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(fc2_weight=np.zeros((E, I, H), np.float32)), rank=1)
    with pytest.raises(DTypeError, match=re.escape(
        "fc2_weight must have dtype in (float32, float16, bfloat16); got float64"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(fc2_weight=np.zeros((EL, I, H))))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_activation_along_wrong_axis(cfg, fmt):
    act = quantize(np.zeros((T, H), np.float32), fmt, axis=0)
    with pytest.raises(FormatError, match="^" + re.escape(
        f"rank 1: activation must be blocked along axis 1 (its reduction axis); got a {fmt} tensor blocked along axis 0"
    ) + "$"):
        V.validate_rank_inputs(cfg, rank_inputs(activation=act), rank=1)
    with pytest.raises(FormatError, match=re.escape(
        f"tokens must be blocked along axis 1 (its reduction axis); got a {fmt} tensor blocked along axis 0"
    )):
        V.validate_dispatch_inputs(cfg, dispatch_inputs(tokens=act))


def test_block_scaled_weights_along_wrong_axis(cfg):
    fc1 = quantize(np.zeros((EL, H, 2 * I), np.float32), "mxfp8", axis=2)
    with pytest.raises(FormatError, match=re.escape(
        "fc1_weight must be blocked along axis 1 (its reduction axis); got a mxfp8 tensor blocked along axis 2"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(fc1_weight=fc1))
    fc2 = quantize(np.zeros((EL, I, H), np.float32), "nvfp4", axis=-1)
    with pytest.raises(FormatError, match=re.escape(
        "rank 0: fc2_weight must be blocked along axis 1 (its reduction axis); got a nvfp4 tensor blocked along axis 2"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(fc2_weight=fc2), rank=0)


def test_block_scaled_logical_shape_is_checked(cfg):
    act = quantize(np.zeros((T, 2 * H), np.float32), "mxfp8", axis=1)
    with pytest.raises(ShapeError, match=re.escape(
        "activation must have shape (num_tokens, hidden) = (?, 64); got (64, 128)"
    )):
        V.validate_rank_inputs(cfg, rank_inputs(activation=act))
    t = quantize(np.zeros((4, 64), np.float32), "mxfp8", axis=1)
    assert V.check_tensor("x", t, (4, 64), "(a, b)", -1) == (4, 64)
    with pytest.raises(ShapeError, match=re.escape("x must have shape (a, b) = (4, 32); got (4, 64)")):
        V.check_tensor("x", t, (4, 32), "(a, b)", 1)


# ============================================================================ capacity


def test_tokens_above_max_tokens_per_rank(cfg):
    with pytest.raises(CapacityError, match="^" + re.escape(
        "rank 1: num_tokens must be <= max_tokens_per_rank = 100; got 101"
    ) + "$") as ei:
        V.validate_rank_inputs(cfg, rank_inputs(t=101), rank=1)
    assert ei.value.limit == 100 and ei.value.got == 101
    with pytest.raises(CapacityError, match=re.escape("num_tokens must be <= max_tokens_per_rank = 100; got 150")):
        V.validate_dispatch_inputs(cfg, dispatch_inputs(t=150))
    with pytest.raises(CapacityError, match=re.escape("rank 3: num_tokens must be <= max_tokens_per_rank = 100; got 101")):
        V.check_num_tokens(cfg, 101, rank=3)


# ============================================================================ wrappers, world, stash, grads


def test_inputs_type(cfg):
    with pytest.raises(DTypeError, match=re.escape("rank 3: inputs must be a RankInputs; got str")):
        V.validate_rank_inputs(cfg, "x", rank=3)
    with pytest.raises(DTypeError, match=re.escape("inputs must be a DispatchInputs; got RankInputs")):
        V.validate_dispatch_inputs(cfg, rank_inputs())


def test_validate_world(cfg):
    V.validate_world(cfg, [1, 2], "inputs")
    V.validate_world(cfg, (1, 2), "inputs")
    with pytest.raises(ShapeError, match=re.escape(
        "inputs must have one entry per rank: length num_ranks = 2; got 1"
    )) as ei:
        V.validate_world(cfg, [1], "inputs")
    assert ei.value.expected == 2 and ei.value.got == 1
    with pytest.raises(ShapeError, match=re.escape(
        "grad_output must have one entry per rank: length num_ranks = 2; got 3"
    )):
        V.validate_world(cfg, [1, 2, 3], "grad_output")
    for bad, tname in (("ab", "str"), (b"ab", "bytes"), (np.zeros(2), "ndarray"), ({0: 1, 1: 2}, "dict"), (None, "NoneType")):
        with pytest.raises(ShapeError, match=re.escape(
            f"inputs must be a sequence with one entry per rank (num_ranks = 2); got {tname}"
        )):
            V.validate_world(cfg, bad, "inputs")


def test_validate_grad(cfg):
    g = np.zeros((3, H), np.float32)
    assert V.validate_grad("grad_output", g, (3, H), "(num_tokens, hidden)") is g
    with pytest.raises(DTypeError, match=re.escape(
        "rank 1: grad_output must have dtype in (float32, float16, bfloat16); got float64"
    )):
        V.validate_grad("grad_output", np.zeros((3, H)), (3, H), "(num_tokens, hidden)", rank=1)
    with pytest.raises(ShapeError, match=re.escape(
        "rank 1: grad_output must have shape (num_tokens, hidden) = (3, 64); got (3, 63)"
    )):
        V.validate_grad("grad_output", np.zeros((3, 63), np.float32), (3, H), "(num_tokens, hidden)", rank=1)
    with pytest.raises(ShapeError, match=re.escape("g must have shape (rows,) = (4,); got (3,)")):
        V.check_float_array("g", np.zeros(3, np.float32), (4,), "(rows,)")


def _stash(rows=5, c_dtype=BF16, m_dtype=np.int32, c_shape=None, m_shape=None):
    return Stash(
        fc1_c=np.zeros(c_shape or (rows, 2 * I), c_dtype), route_metadata=np.zeros(m_shape or (rows, 4), m_dtype)
    )


def test_validate_stash(cfg):
    V.validate_stash(cfg, _stash(), 5, rank=1)
    V.validate_stash(cfg, _stash(rows=0), 0)
    with pytest.raises(DTypeError, match="^" + re.escape("rank 1: fc1_c must have dtype bfloat16; got float32") + "$"):
        V.validate_stash(cfg, _stash(c_dtype=np.float32), 5, rank=1)
    with pytest.raises(DTypeError, match=re.escape("fc1_c must have dtype bfloat16; got NoneType")):
        V.validate_stash(cfg, Stash(fc1_c=None, route_metadata=np.zeros((5, 4), np.int32)), 5)
    with pytest.raises(DTypeError, match=re.escape("route_metadata must have dtype int32; got int64")) as ei:
        V.validate_stash(cfg, _stash(m_dtype=np.int64), 5)
    assert ei.value.name == "route_metadata" and ei.value.expected == "int32"
    with pytest.raises(ShapeError, match=re.escape(
        "rank 0: fc1_c must have shape (rows, 2 * intermediate) = (5, 64); got (4, 64)"
    )):
        V.validate_stash(cfg, _stash(c_shape=(4, 2 * I)), 5, rank=0)
    with pytest.raises(ShapeError, match=re.escape("route_metadata must have shape (rows, 4) = (5, 4); got (5, 3)")):
        V.validate_stash(cfg, _stash(m_shape=(5, 3)), 5)
    with pytest.raises(DTypeError, match=re.escape("rank 2: stash must be a Stash; got tuple")):
        V.validate_stash(cfg, (1, 2), 5, rank=2)


def _handle(rank=1, rows=7):
    return DispatchHandle(
        rank=rank,
        num_ranks=RANKS,
        num_tokens=3,
        num_topk=K,
        route_metadata=np.zeros((rows, 4), np.int32),
        tokens_per_expert=np.zeros(EL, np.int64),
        expert_offsets=np.zeros(EL + 1, np.int64),
    )


def test_validate_expert_out(cfg):
    out = np.zeros((7, H), BF16)
    assert V.validate_expert_out(cfg, out, _handle()) is out
    with pytest.raises(ShapeError, match="^" + re.escape(
        "rank 1: expert_out must have shape (received rows, hidden) = (7, 64); got (6, 64)"
    ) + "$"):
        V.validate_expert_out(cfg, np.zeros((6, H), np.float32), _handle())
    with pytest.raises(DTypeError, match=re.escape(
        "rank 0: expert_out must have dtype in (float32, float16, bfloat16); got float64"
    )):
        V.validate_expert_out(cfg, np.zeros((7, H)), _handle(rank=0))
    with pytest.raises(DTypeError, match=re.escape("handle must be a DispatchHandle; got str")):
        V.validate_expert_out(cfg, out, "h")


# ============================================================================ inputs are not modified


def _snapshot(inp):
    return copy.deepcopy(inp)


def _assert_same(a, b):
    if isinstance(a, BlockScaledTensor):
        np.testing.assert_array_equal(a.data_codes(), b.data_codes())
        np.testing.assert_array_equal(a.scale_codes(), b.scale_codes())
        assert (a.shape, a.axis, a.format) == (b.shape, b.axis, b.format)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_validation_does_not_modify_inputs(cfg):
    rng = np.random.default_rng(5)
    act = quantize(rng.standard_normal((T, H)), "nvfp4", axis=1)
    inp = rank_inputs(activation=act, topk_idx=rng.integers(-1, E, (T, K)).astype(np.int64))
    before = _snapshot(inp)
    assert V.validate_rank_inputs(cfg, inp, rank=0) == T
    for f in ("activation", "fc1_weight", "fc2_weight", "topk_idx", "topk_weights"):
        _assert_same(getattr(inp, f), getattr(before, f))
    assert inp.activation is act

    d = dispatch_inputs()
    before = _snapshot(d)
    V.validate_dispatch_inputs(cfg, d)
    for f in ("tokens", "topk_idx", "topk_weights"):
        _assert_same(getattr(d, f), getattr(before, f))

    # a failing validation leaves its input alone too
    idx = idx_with((3, 1), -2)
    bad = rank_inputs(topk_idx=idx)
    with pytest.raises(RoutingIndexError):
        V.validate_rank_inputs(cfg, bad)
    assert idx[3, 1] == -2 and (np.delete(idx.ravel(), 3 * K + 1) == 0).all()


def test_validation_accepts_read_only_arrays(cfg):
    inp = rank_inputs()
    for f in ("activation", "fc1_weight", "fc2_weight", "topk_idx", "topk_weights"):
        getattr(inp, f).flags.writeable = False
    assert V.validate_rank_inputs(cfg, inp) == T
    st = _stash()
    st.fc1_c.flags.writeable = False
    st.route_metadata.flags.writeable = False
    V.validate_stash(cfg, st, 5)


# ============================================================================ non-native byte order


@pytest.mark.parametrize("which", ["activation", "topk_idx"])
def test_non_native_byte_order_message_is_not_self_contradictory(cfg, which):
    if which == "activation":
        inp = rank_inputs(activation=np.zeros((T, H), np.dtype(np.float32).newbyteorder()))
    else:
        inp = rank_inputs(topk_idx=np.zeros((T, K), np.dtype(np.int32).newbyteorder()))
    try:
        V.validate_rank_inputs(cfg, inp)
    except DTypeError as exc:  # rejecting is fine, but the message must say what is wrong
        assert not re.search(r"got (float32|int32)$", str(exc)), str(exc)
