"""``moe_ep_spec.tolerance``: compare(), rounding_error_bound() and whether the budgets mean
something: a float32 implementation of the spec passes them, wrong results fail."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest

from moe_ep_spec import MoeEpConfig
from moe_ep_spec.formats import BF16, dequantize, quantize, round_trip
from moe_ep_spec.tolerance import compare, gamma, rounding_error_bound
from moe_ep_reference import ReferenceBackend

try:  # tests/ may or may not be a package
    from . import naive
except ImportError:
    import naive

REF = ReferenceBackend()
f32 = np.float32


# ---------------------------------------------------------------- compare


def test_compare_equal_is_ok_with_ratio_zero():
    a = np.arange(6.0).reshape(2, 3)
    c = compare("same", a, a.copy(), 0.0)
    assert c.ok and c.ratio == 0.0 and c.max_abs_error == 0.0 and c.detail == ""


def test_compare_ratio_and_worst_index():
    ref = np.zeros((3, 4))
    got = ref.copy()
    got[0, 1] = 0.5
    got[2, 3] = -0.3
    budget = np.full((3, 4), 0.1)
    budget[2, 3] = 0.05  # 0.3 / 0.05 = 6 beats 0.5 / 0.1 = 5
    c = compare("x", got, ref, budget)
    assert not c.ok
    assert c.worst_index == (2, 3)
    assert c.ratio == pytest.approx(6.0)
    assert c.max_abs_error == pytest.approx(0.5)
    assert (c.worst_got, c.worst_ref, c.worst_budget) == (-0.3, 0.0, 0.05)
    assert c.describe() == "x: worst element (2, 3): got -0.3, reference 0.0, error 0.3 = 6 x budget 0.05"


def test_compare_passes_at_exactly_the_budget_and_broadcasts():
    ref = np.array([1.0, 2.0, 4.0])
    got = ref + np.array([0.25, -0.5, 0.0])
    c = compare("edge", got, ref, np.array([0.25, 0.5, 0.0]))
    assert c.ok and c.ratio == 1.0
    assert not compare("edge", got, ref, 0.4).ok  # scalar budget broadcasts: 0.5 / 0.4
    assert compare("edge", got, ref, 0.4).ratio == pytest.approx(1.25)


def test_compare_error_where_budget_is_zero_is_infinite():
    c = compare("z", np.array([1.0, 2.0 + 1e-300]), np.array([1.0, 2.0]), 0.0)
    assert c.ok  # 2 + 1e-300 == 2 in float64
    c = compare("z", np.array([1.0, 2.5]), np.array([1.0, 2.0]), 0.0)
    assert not c.ok and c.ratio == math.inf and c.worst_index == (1,)


def test_compare_nan_must_match_exactly():
    ref = np.array([1.0, np.nan, 3.0])
    assert compare("n", np.array([1.0, np.nan, 3.0]), ref, 0.0).ok
    c = compare("n", np.array([1.0, 2.0, np.nan]), ref, 10.0)
    assert not c.ok and c.ratio == math.inf and c.worst_index == (1,)
    assert re.fullmatch(
        r"2 element\(s\) with NaN/inf where the reference differs, first at \(1,\): "
        r"got (np\.float64\()?2\.0\)?, reference (np\.float64\()?nan\)?",
        c.detail,
    ), c.detail
    assert c.describe() == "n: " + c.detail  # a NaN mismatch is described by where it is


def test_compare_nan_detail_prints_plain_numbers():
    c = compare("n", np.array([1.0, 2.0, np.nan]), np.array([1.0, np.nan, 3.0]), 10.0)
    assert c.detail == "2 element(s) with NaN/inf where the reference differs, first at (1,): got 2.0, reference nan"


def test_compare_infinities_must_match_exactly():
    ref = np.array([np.inf, -np.inf, 1.0])
    with np.errstate(invalid="ignore"):
        assert compare("i", ref.copy(), ref, 0.0).ok
        c = compare("i", np.array([np.inf, np.inf, 1.0]), ref, 1e300)
        assert not c.ok and c.worst_index == (1,) and c.ratio == math.inf
        assert not compare("i", np.array([np.inf, -np.inf, np.inf]), ref, 1e300).ok


def test_compare_matching_infinities_emit_no_warning():
    ref = np.array([np.inf, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compare("i", ref.copy(), ref, 0.0).ok


def test_compare_shape_mismatch_and_empty():
    c = compare("s", np.zeros(2), np.zeros(3), 1.0)
    assert not c.ok and c.ratio == math.inf and c.worst_index is None
    assert c.detail == "shape (2,) != reference (3,)"
    e = compare("e", np.zeros((0, 4)), np.zeros((0, 4)), 1.0)
    assert e.ok and e.ratio == 0.0 and e.worst_index is None
    assert e.describe() == "e: empty, nothing to compare"


def test_compare_decodes_block_scaled_tensors_and_bf16():
    x = np.linspace(-3, 3, 32).reshape(1, 32)
    q = quantize(x, "mxfp8", axis=1)
    assert compare("q", q, dequantize(q, np.float64), 0.0).ok
    assert compare("bf16", x.astype(BF16), x.astype(BF16).astype(np.float64), 0.0).ok
    c = compare("q", q, x, 0.0)
    assert not c.ok and c.ratio == math.inf


# ---------------------------------------------------------------- rounding_error_bound


def test_bound_is_zero_away_from_bf16_boundaries_and_one_step_across():
    v = np.array([1.0, 1.0 + 2.0**-8, 3.0, -3.0 - 2.0**-6])
    # 1.0 + 2^-8 is a bf16 tie (between 1 and 1 + 2^-7): any error may move it either way.
    d = np.full(4, 2.0**-12)
    np.testing.assert_array_equal(rounding_error_bound(v, d, "bf16"), [0.0, 2.0**-7, 0.0, 0.0])
    # An error of half a step reaches the boundaries of 1.0 (step 2^-7) but not of 3.0
    # (step 2^-6): 1.0 + d rounds up a step, 3.0 +- d still rounds to 3.0.
    d = np.full(4, 2.0**-8)
    np.testing.assert_array_equal(rounding_error_bound(v, d, "bf16"), [2.0**-7, 2.0**-7, 0.0, 0.0])


def test_bound_with_no_rounding_is_the_error_itself():
    d = np.array([0.5, 0.0])
    np.testing.assert_array_equal(rounding_error_bound(np.array([1.0, 2.0]), d, None), d)


def test_bound_mxfp8_fixed_scale_is_elementwise():
    block = np.zeros((1, 32))
    block[0, :4] = [256.0, 1.0, 1.0 + 2.0**-4, 0.3]  # scale 1 (224 < amax <= 448); 1 + 2^-4 is an E4M3 tie
    b = rounding_error_bound(block, 1e-9, "mxfp8", axis=1)
    np.testing.assert_array_equal(b[0, :4], [0.0, 0.0, 0.125, 0.0])
    assert (b[0, 4:] == 0).all()


def test_bound_mxfp8_scale_may_change_near_448():
    block = np.zeros((1, 32))
    block[0, :2] = [448.0, 3.0]  # amax exactly on the scale boundary: +d doubles the scale
    b = rounding_error_bound(block, 1e-6, "mxfp8", axis=1)
    # d + half a gap at scale 2 (3 / 2 = 1.5: E4M3 gap 0.125, times 2, halved: 0.125)
    # + half a gap at scale 1 (3: E4M3 gap 0.25, halved: 0.125)
    assert b[0, 1] == pytest.approx(1e-6 + 0.25, rel=1e-12)
    far = np.zeros((1, 32))
    far[0, :2] = [300.0, 3.0]
    assert rounding_error_bound(far, 1e-6, "mxfp8", axis=1)[0, 1] == 0.0


def test_bound_nvfp4_ties_and_zero_scale():
    b1 = np.array([6.0, 1.0, 2.5, 0.2] + [0.0] * 12)  # scale 1; 2.5 is an E2M1 tie
    bound = rounding_error_bound(b1.reshape(1, 16), 1e-9, "nvfp4", axis=1)[0]
    np.testing.assert_array_equal(bound[:4], [0.0, 0.0, 1.0, 0.0])


def test_gamma():
    u = 2.0**-24
    assert gamma(10) == pytest.approx(2 * 10 * u / (1 - 10 * u), rel=1e-15)
    assert gamma(0) == gamma(1)


# ---------------------------------------------------------------- float32 re-implementation


def _decode32(t):
    return naive.decode(t).astype(f32)


def float32_forward(config: MoeEpConfig, world, swap_gate_up=False, skip_clamp=False, scale=1.0):
    """The spec with float32 arithmetic everywhere and the spec's roundings."""
    el, i_size, h_size, k_top = config.num_local_experts, config.intermediate, config.hidden, config.num_topk
    plans = naive.naive_plan(config, [w.topk_idx for w in world])
    per_slot = [np.zeros((w.topk_idx.shape[0], k_top, h_size), f32) for w in world]
    xs = [_decode32(w.activation) for w in world]
    ws = [np.asarray(w.topk_weights).astype(f32) for w in world]
    for d, plan in enumerate(plans):
        fc1, fc2 = _decode32(world[d].fc1_weight), _decode32(world[d].fc2_weight)
        for le in range(el):
            rows = plan.rows[plan.rows[:, 0] == le]
            if not len(rows):
                continue
            x = np.stack([xs[s][t] for _, s, t, _ in rows])
            w = np.array([ws[s][t, k] for _, s, t, k in rows], f32)[:, None]
            c = x @ fc1[le]
            g, u = c[:, :i_size], c[:, i_size:]
            if swap_gate_up:
                g, u = u, g
            L = config.gate_up_clamp
            if L is not None and not skip_clamp:
                g, u = np.minimum(g, f32(L)), np.clip(u, f32(-L), f32(L))
            h = g * (f32(1) / (f32(1) + np.exp(-g))) * u
            if config.apply_topk_in_fc1:
                z = round_trip(w * h, config.intermediate_format, axis=-1).astype(f32) @ fc2[le]
            else:
                z = w * (round_trip(h, config.intermediate_format, axis=-1).astype(f32) @ fc2[le])
            y = round_trip(z, config.combine_format, axis=-1).astype(f32)
            for (_, s, t, k), row in zip(rows, y):
                per_slot[s][t, k] = row
    outs = []
    for p in per_slot:
        acc = np.zeros(p.shape[::2], f32)
        for k in range(k_top):
            acc = acc + p[:, k]
        outs.append(quantize(acc.astype(np.float64) * scale, config.output_format, axis=1))
    return outs


FWD_CASES = {
    "bf16-ranks2": dict(num_ranks=2),
    "bf16-wide-ranks1": dict(num_ranks=1, hidden=128, intermediate=96, num_topk=4, tokens=[24]),
    "out-mxfp8-combine-nvfp4-inter-mxfp8-ranks4": dict(num_ranks=4, hidden=32, intermediate=32, output_format="mxfp8", combine_format="nvfp4", intermediate_format="mxfp8"),
    "out-nvfp4-inter-nvfp4-weight-in-fc2-clamp": dict(num_ranks=2, hidden=32, intermediate=32, output_format="nvfp4", intermediate_format="nvfp4", apply_topk_in_fc1=False, gate_up_clamp=0.75),
    "combine-mxfp8-inter-bf16-block-inputs-static": dict(num_ranks=2, hidden=64, combine_format="mxfp8", intermediate_format="bf16", recv_capacity=64, expert_alignment=4, world=dict(activation_format="mxfp8", weight_format="nvfp4")),
    "bf16-clamp-duplicates": dict(num_ranks=2, gate_up_clamp=0.5, world=dict(routing="duplicates")),
}


def _fwd_case(name, seed):
    kw = dict(FWD_CASES[name])
    world_kw = kw.pop("world", {})
    tokens = kw.pop("tokens", None)
    base = dict(num_experts=8, hidden=32, intermediate=16, num_topk=3)
    config = MoeEpConfig(**{**base, **kw})
    if tokens is None:
        tokens = [7, 0, 5, 9][: config.num_ranks] if config.num_ranks > 1 else [9]
    world = naive.make_world(config, seed, tokens, act_scale=2.0, **world_kw)
    return config, world


@pytest.mark.parametrize("seed", [1, 2], ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("case", list(FWD_CASES), ids=list(FWD_CASES))
def test_float32_forward_passes_the_budget(case, seed):
    config, world = _fwd_case(case, seed)
    ref = REF.forward(config, world)
    budgets = [b.output for b in REF.forward_budget(config, world)]
    got = float32_forward(config, world)
    for r, (g, rr, b) in enumerate(zip(got, ref, budgets)):
        assert b.shape == (world[r].topk_idx.shape[0], config.hidden) and np.all(b >= 0)
        cmp = compare(f"rank {r} output", g, rr.output, b)
        assert cmp.ok, cmp.describe()


def test_float32_forward_differs_from_the_reference_somewhere():
    """The budget is exercised: float32 lands on other bf16 codes than float64 here."""
    config, world = _fwd_case("bf16-wide-ranks1", 1)
    ref = REF.forward(config, world)[0].output
    got = float32_forward(config, world)[0]
    c = compare("wide", got, ref, REF.forward_budget(config, world)[0].output)
    assert c.ok and 0.0 < c.ratio <= 1.0, c.describe()


def _forward_ratio(config, world, **wrong) -> float:
    ref = REF.forward(config, world)
    budgets = [b.output for b in REF.forward_budget(config, world)]
    got = float32_forward(config, world, **wrong)
    return max(compare(f"rank {r}", g, rr.output, b).ratio for r, (g, rr, b) in enumerate(zip(got, ref, budgets)))


WRONG_FORWARD = [
    ("bf16-ranks2", "times-1.02"),
    ("bf16-wide-ranks1", "times-1.02"),
    ("bf16-clamp-duplicates", "times-1.02"),
    ("bf16-ranks2", "swap-gate-up"),
    ("bf16-wide-ranks1", "swap-gate-up"),
    ("out-mxfp8-combine-nvfp4-inter-mxfp8-ranks4", "swap-gate-up"),
    ("combine-mxfp8-inter-bf16-block-inputs-static", "swap-gate-up"),
    ("out-nvfp4-inter-nvfp4-weight-in-fc2-clamp", "no-clamp"),
    ("bf16-clamp-duplicates", "no-clamp"),
]
WRONG_KW = {
    "times-1.01": dict(scale=1.01),
    "times-1.02": dict(scale=1.02),
    "swap-gate-up": dict(swap_gate_up=True),
    "no-clamp": dict(skip_clamp=True),
}


@pytest.mark.parametrize("seed", [1, 2], ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("case,wrong", WRONG_FORWARD, ids=[f"{c}-{w}" for c, w in WRONG_FORWARD])
def test_wrong_forward_fails_the_budget(case, wrong, seed):
    config, world = _fwd_case(case, seed)
    assert _forward_ratio(config, world, **WRONG_KW[wrong]) > 1.0


def test_output_times_1_01_fails_the_budget_with_k3():
    """K = 3, bf16 output and combine: a 1% scaling fails the budget (the budget
    allows no error away from rounding boundaries)."""
    config = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=3, num_ranks=2)
    world = naive.make_world(config, 2, [16, 12], act_scale=2.0, unused_prob=0.0)
    assert _forward_ratio(config, world, scale=1.01) > 1.0


@pytest.mark.parametrize("seed", [1, 2, 3], ids=lambda s: f"seed{s}")
def test_output_times_1_01_fails_the_budget_with_k1(seed):
    config = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=1, num_ranks=2)
    world = naive.make_world(config, seed, [16, 12], act_scale=2.0, unused_prob=0.0)
    assert _forward_ratio(config, world, scale=1.01) > 1.0


@pytest.mark.parametrize("seed", [1, 2, 3], ids=lambda s: f"seed{s}")
def test_swapped_gate_up_fails_the_budget_with_nvfp4_intermediate(seed):
    config = MoeEpConfig(num_experts=8, hidden=32, intermediate=32, num_topk=3, num_ranks=2,
                         output_format="nvfp4", intermediate_format="nvfp4")
    world = naive.make_world(config, seed, [7, 5])
    assert _forward_ratio(config, world, swap_gate_up=True) > 1.0


def test_swapped_gate_up_fails_the_budget_with_nvfp4_output_only():
    config = MoeEpConfig(num_experts=8, hidden=32, intermediate=32, num_topk=3, num_ranks=2, output_format="nvfp4")
    world = naive.make_world(config, 1, [7, 5])
    assert _forward_ratio(config, world, swap_gate_up=True) > 1.0


# ---------------------------------------------------------------- backward


def float32_backward(config: MoeEpConfig, world, grad_output, stash, skip_mask=False, unweighted_dw2=False):
    """Section 3 of the brief with float32 arithmetic, per local expert."""
    el, i_size, L = config.num_local_experts, config.intermediate, config.gate_up_clamp
    xs = [_decode32(w.activation) for w in world]
    ws = [np.asarray(w.topk_weights).astype(f32) for w in world]
    dys = [np.asarray(g).astype(f32) for g in grad_output]
    dx_slots = [np.zeros(w.topk_idx.shape + (config.hidden,), f32) for w in world]
    dws = [np.zeros(w.topk_idx.shape, f32) for w in world]
    dfc1s, dfc2s = [], []
    for d, st in enumerate(stash):
        fc1, fc2 = _decode32(world[d].fc1_weight), _decode32(world[d].fc2_weight)
        dfc1, dfc2 = np.zeros_like(fc1), np.zeros_like(fc2)
        for le in range(el):
            sel = st.route_metadata[:, 0] == le
            rows = st.route_metadata[sel]
            if not len(rows):
                continue
            c = st.fc1_c[sel].astype(f32)
            x = np.stack([xs[s][t] for _, s, t, _ in rows])
            w = np.array([ws[s][t, k] for _, s, t, k in rows], f32)[:, None]
            dy = np.stack([dys[s][t] for _, s, t, _ in rows])
            g, u = c[:, :i_size], c[:, i_size:]
            gm = um = np.ones_like(g)
            if L is not None:
                if not skip_mask:
                    gm, um = (g <= L).astype(f32), ((u >= -L) & (u <= L)).astype(f32)
                g, u = np.minimum(g, f32(L)), np.clip(u, f32(-L), f32(L))
            sig = f32(1) / (f32(1) + np.exp(-g))
            s = g * sig
            h = s * u
            dyw2 = dy @ fc2[le].T
            if config.apply_topk_in_fc1:
                dfc2[le] = (h if unweighted_dw2 else w * h).T @ dy
                dw = np.sum(dyw2 * h, axis=1)
            else:
                dfc2[le] = h.T @ (dy if unweighted_dw2 else w * dy)
                dw = np.sum(dy * (h @ fc2[le]), axis=1)
            dh = dyw2 * w
            dc = np.concatenate([dh * u * sig * (f32(1) + g * (f32(1) - sig)) * gm, dh * s * um], axis=1)
            dfc1[le] = x.T @ dc
            dx = dc @ fc1[le].T
            for j, (_, s_, t, k) in enumerate(rows):
                dx_slots[s_][t, k] = dx[j]
                dws[s_][t, k] = dw[j]
        dfc1s.append(dfc1)
        dfc2s.append(dfc2)
    out = []
    for r in range(len(world)):
        acc = np.zeros((dx_slots[r].shape[0], config.hidden), f32)
        for k in range(config.num_topk):
            acc = acc + dx_slots[r][:, k]
        out.append((acc, dfc1s[r], dfc2s[r], dws[r]))
    return out


NAMES = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")
BWD_CASES = {
    "ranks2": dict(num_ranks=2),
    "ranks4-clamp-weight-in-fc2": dict(num_ranks=4, gate_up_clamp=0.75, apply_topk_in_fc1=False),
    "ranks1-wide-clamp": dict(num_ranks=1, hidden=128, intermediate=64, gate_up_clamp=1.0, tokens=[24]),
    "block-inputs-static": dict(num_ranks=2, recv_capacity=64, expert_alignment=4, world=dict(activation_format="nvfp4", weight_format="mxfp8")),
}


def _bwd_case(name, seed):
    kw = dict(BWD_CASES[name])
    world_kw = kw.pop("world", {})
    tokens = kw.pop("tokens", None)
    config = MoeEpConfig(**{**dict(num_experts=8, hidden=32, intermediate=16, num_topk=3, generate_c=True), **kw})
    if tokens is None:
        tokens = [7, 0, 5, 9][: config.num_ranks] if config.num_ranks > 1 else [9]
    world = naive.make_world(config, seed, tokens, act_scale=2.0, **world_kw)
    rng = np.random.default_rng(seed)
    gy = [rng.normal(size=(n, config.hidden)).astype(f32) for n in tokens]
    stash = [f.stash for f in REF.forward(config, world)]
    return config, world, gy, stash


@pytest.mark.parametrize("seed", [1, 2], ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("case", list(BWD_CASES), ids=list(BWD_CASES))
def test_float32_backward_passes_the_budget(case, seed):
    config, world, gy, stash = _bwd_case(case, seed)
    ref = REF.backward(config, world, gy, stash)
    budgets = REF.backward_budget(config, world, gy, stash)
    got = float32_backward(config, world, gy, stash)
    worst = 0.0
    for r in range(config.num_ranks):
        for j, name in enumerate(NAMES):
            b = getattr(budgets[r], name)
            assert b.shape == getattr(ref[r], name).shape and np.all(b >= 0)
            cmp = compare(f"rank {r} {name}", got[r][j], getattr(ref[r], name), b)
            assert cmp.ok, cmp.describe()
            worst = max(worst, cmp.ratio)
    assert worst > 0.0  # float32 does differ from the reference somewhere


@pytest.mark.parametrize(
    "case,wrong",
    [
        ("ranks2", "times-1.001"),
        ("ranks4-clamp-weight-in-fc2", "no-clamp-mask"),
        ("ranks1-wide-clamp", "no-clamp-mask"),
        ("ranks2", "unweighted-dW2"),
    ],
    ids=lambda v: v,
)
def test_wrong_backward_fails_the_budget(case, wrong):
    config, world, gy, stash = _bwd_case(case, 1)
    ref = REF.backward(config, world, gy, stash)
    budgets = REF.backward_budget(config, world, gy, stash)
    if wrong == "times-1.001":
        got = [tuple(a * f32(1.001) for a in g) for g in float32_backward(config, world, gy, stash)]
    else:
        kw = {"no-clamp-mask": dict(skip_mask=True), "unweighted-dW2": dict(unweighted_dw2=True)}[wrong]
        got = float32_backward(config, world, gy, stash, **kw)
    ratios = [
        compare(name, got[r][j], getattr(ref[r], name), getattr(budgets[r], name)).ratio
        for r in range(config.num_ranks)
        for j, name in enumerate(NAMES)
    ]
    assert max(ratios) > 1.0, ratios


# ---------------------------------------------------------------- exact reductions, underflow (issue 17)

from moe_ep_spec import DispatchInputs, RankInputs  # noqa: E402
from moe_ep_spec.tolerance import (  # noqa: E402
    FP32_MIN_SUBNORMAL,
    dot_quantum,
    exact_reduction,
    min_quantum,
    quantum,
    reduction_bound,
    underflow,
)


def test_quantum_is_the_last_significant_bit():
    got = quantum(np.array([1.0, 3.0, 0.75, -6.5, 2.0**-149, 1 + 2.0**-52, 0.0, -0.0, np.nan, np.inf]))
    want = [1.0, 1.0, 0.25, 0.5, 2.0**-149, 2.0**-52, np.inf, np.inf, np.nan, np.nan]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(min_quantum(np.array([[1.5, 0.0], [0.0, -0.0]]), axis=1), [[0.5], [np.inf]])
    a, b = np.array([[1.0, 0.0], [0.5, 3.0]]), np.array([[0.75, 1.0], [2.0**-20, 0.0]])
    np.testing.assert_array_equal(dot_quantum(a, b), [[0.25, 1.0], [2.0**-20, 0.5]])
    np.testing.assert_array_equal(dot_quantum(a, b, max_work=0), [[2.0**-20, 1.0], [2.0**-21, 0.5]])


def test_exact_reduction_needs_24_bits_and_the_float32_range():
    # 1 + 2^-8 (two bf16 values) is exact; 2^24 * q is not; an all-zero sum is;
    # a common quantum below float32's subnormals or a NaN term is not.
    abs_sum = np.array([1 + 2.0**-8, 2.0**24, 0.0, 2.0**-140, 1.0, 2.0**200])
    q = np.array([2.0**-8, 1.0, np.inf, 2.0**-150, np.nan, 2.0**180])
    assert exact_reduction(abs_sum, q).tolist() == [True, False, True, False, False, False]


def test_reduction_bound_is_zero_only_where_exact():
    b = reduction_bound(np.array([1.0, 1.0]), 4, np.array([True, False]))
    assert b[0] == 0.0 and b[1] == gamma(4) + underflow(4)
    assert underflow(3) == 2 * 3 * FP32_MIN_SUBNORMAL and underflow(0) == underflow(1)


def _combine_budget(config, rows_per_rank, topk_idx):
    """The reference's combine output and budget for given expert rows (one rank)."""
    t = topk_idx.shape[0]
    tokens = np.zeros((t, config.hidden), np.float32)
    d = REF.dispatch(config, [DispatchInputs(tokens, topk_idx, np.ones(topk_idx.shape, np.float32))])
    rows = [np.asarray(rows_per_rank, np.float32)]
    return REF.combine(config, [d[0].handle], rows)[0], REF.combine_budget(config, [d[0].handle], rows)[0]


def test_exact_slot_sum_gets_no_gamma_k_budget():
    """K = 1, and K = 2 with two bf16 terms that fit 24 bits: the slot sum is exact
    in float32 whatever the order, so an output tie allows only the tie's code."""
    cfg = MoeEpConfig(num_experts=2, hidden=2, intermediate=2, num_topk=2)
    # token 0: 1 + 2^-8 (a bf16 tie: rounds to even, 1.0); token 1: 1 + 3 * 2^-8 (rounds up)
    idx = np.array([[0, 1], [0, 1]], np.int32)
    rows = [[1.0, 1.0], [1.0, 1.0], [2.0**-8, -(2.0**-8)], [3 * 2.0**-8, 0.0]]  # expert-major: e0 t0, e0 t1, e1 t0, e1 t1
    out, budget = _combine_budget(cfg, rows, idx)
    np.testing.assert_array_equal(budget.output, np.zeros((2, 2)))
    assert out.astype(np.float64).tolist() == [[1.0, 1.0 - 2.0**-8], [1.0 + 2.0**-6, 1.0]]
    # K = 3, terms 1, 2^-8, 2^-30 need 31 bits: a float32 sum may drop 2^-30 and land
    # on the tie (1.0) where the exact sum rounds up: both codes are allowed.
    cfg3 = MoeEpConfig(num_experts=3, hidden=2, intermediate=2, num_topk=3)
    rows = [[1.0, 1.0], [2.0**-8, 0.0], [2.0**-30, 0.0]]
    out, budget = _combine_budget(cfg3, rows, np.array([[0, 1, 2]], np.int32))
    assert out.astype(np.float64).tolist() == [[1.0 + 2.0**-7, 1.0]]
    assert budget.output.tolist() == [[2.0**-7, 0.0]]
    # K = 1: any single term is exact.
    cfg1 = cfg.replace(num_topk=1)
    _, budget = _combine_budget(cfg1, [[1.0 + 2.0**-8, 3.0e38]], np.array([[1]], np.int32))
    np.testing.assert_array_equal(budget.output, np.zeros((1, 2)))


def test_exact_fc1_gets_no_stash_budget():
    """One-hot activations and float32 weights: FC1 is exact, so fc1_c must be
    the bf16 rounding of the exact value, ties included (budget 0)."""
    cfg = MoeEpConfig(num_experts=1, hidden=4, intermediate=2, num_topk=1, generate_c=True)
    act = np.eye(4, dtype=np.float32)
    fc1 = np.zeros((1, 4, 4), np.float32)
    fc1[0, :, 0] = [1 + 2.0**-8, -(1 + 2.0**-8), 1 + 3 * 2.0**-8, 2.0**-134]  # ties to even, subnormal tie
    fc2 = np.ones((1, 2, 4), np.float32)
    world = [RankInputs(act, fc1, fc2, np.zeros((4, 1), np.int32), np.ones((4, 1), np.float32))]
    res, budget = REF.forward_and_budget(cfg, world)
    np.testing.assert_array_equal(budget[0].fc1_c, np.zeros((4, 4)))
    got = res[0].fc1_c[:, 0].view(np.uint16).tolist()
    assert got == [0x3F80, 0xBF80, 0x3F82, 0x0000], [hex(c) for c in got]


def _deep_negative_gate_world(config):
    """g = -100 (float32 sigmoid underflows to 0) and u = 1e30: h = s * u is about
    -3.7e-12 in exact arithmetic and exactly 0 in float32."""
    h, i = config.hidden, config.intermediate
    act = np.zeros((2, h), np.float32)
    act[:, 0] = 1.0
    fc1 = np.zeros((1, h, 2 * i), np.float32)
    fc1[0, 0, :i] = -100.0
    fc1[0, 0, i:] = 1e30
    fc2 = np.full((1, i, h), 0.5, np.float32)
    return [RankInputs(act, fc1, fc2, np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32))]


def test_float32_silu_underflow_passes_the_budget():
    """Spec 13.1: results below 2^-126 get an absolute allowance; a float32 SiLU
    whose sigmoid underflows to 0 (g below about -88.7) conforms."""
    cfg = MoeEpConfig(num_experts=1, hidden=4, intermediate=2, num_topk=1)
    world = _deep_negative_gate_world(cfg)
    ref = REF.forward(cfg, world)[0].output
    assert np.all(ref.astype(np.float64) < 0)  # the exact result is not zero
    with np.errstate(over="ignore"):
        got = float32_forward(cfg, world)[0]
    assert np.all(got.astype(np.float64) == 0)
    c = compare("underflow", got, ref, REF.forward_budget(cfg, world)[0].output)
    assert c.ok, c.describe()


def test_mxfp8_beyond_float32_decodes_to_inf():
    """Spec 8.5: an mxfp8 input value of 2^128 or more decodes to +-inf (float32),
    in the reference as on a float32 backend."""
    from moe_ep_reference import world as W

    from moe_ep_spec.formats import FLOAT8_E4M3, FLOAT8_E8M0, BlockScaledTensor

    codes = np.zeros((1, 32), np.uint8)
    codes[0, :3] = [0x40, 0xC8, 0x3C]  # E4M3 2.0, -4.0, 1.5
    scale = np.array([[0xFE]], np.uint8)  # 2^127
    t = BlockScaledTensor(codes.view(FLOAT8_E4M3), scale.view(FLOAT8_E8M0), "mxfp8", (1, 32), axis=1)
    got = W.decode(t)[0, :3]
    assert got.tolist() == [np.inf, -np.inf, 1.5 * 2.0**127]
