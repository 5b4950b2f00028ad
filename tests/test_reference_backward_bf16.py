"""The reference's bf16-operand backward (``backward_operand_format = "bf16"``,
spec section 9.2) against golden data from an independent implementation
(``tests/golden_backward_bf16.py``, stored in ``tests/data/golden_backward_bf16.npz``),
and what the mode leaves alone."""

from __future__ import annotations

import numpy as np
import pytest

import moe_ep_reference.world as W
from moe_ep_spec import DispatchInputs, MoeEpConfig, MoeFormat, Stash
from moe_ep_spec.formats import BF16, round_to_bf16
from moe_ep_spec.inputs import random_world
from moe_ep_reference import ReferenceBackend

try:  # tests/ may or may not be a package
    from . import golden_backward_bf16 as G
    from . import mutants
except ImportError:
    import golden_backward_bf16 as G
    import mutants

REF = ReferenceBackend()
CASES = G.load()


def _run(case, backend=REF):
    config, inputs, grads, fc1_c, meta, golden = CASES[case]
    return backend.backward(config, inputs, grads, [Stash(c, m) for c, m in zip(fc1_c, meta)]), golden


def test_golden_file_is_what_its_generator_writes():
    fresh = G.generate()
    stored = np.load(G.GOLDEN)
    assert set(fresh) == set(stored.files)
    for key, value in fresh.items():
        assert np.array_equal(stored[key], value), key


@pytest.mark.parametrize("case", ["ties_weights_in_fc1", "ties_weights_in_fc2"])
def test_tie_cases_hold_ties_where_the_tie_rule_matters(case):
    *_, golden = CASES[case]
    for key in ("dc", "wh"):
        v = golden[key][0]
        ties = G.is_bf16_tie(v)
        assert ties.sum() >= 20, (key, int(ties.sum()))
        # Half away from zero would differ from half to even at some of them.
        away = np.sign(v) * (np.abs(v) + 0.5 * np.abs(v - G.rne_bf16(v)))
        assert (G.rne_bf16(v)[ties] != G.rne_bf16(away)[ties]).any(), key


def test_the_two_bf16_roundings_agree():
    """The golden generator's rounding and moe_ep_spec.formats.round_to_bf16 are
    written separately; they agree on the golden operands and on hard values."""
    values = [np.concatenate([g[k][r].ravel() for k in ("dc", "wh") for r in range(len(g[k]))]) for *_, g in CASES.values()]
    rng = np.random.default_rng(5)
    special = np.array([1 + 2.0**-8, -(1 + 2.0**-8), 1 + 3 * 2.0**-8, 2.0**-133, 1.5 * 2.0**-133, 2.0**-134, 3.3961e38,
                        3.4e38, 0.0, -0.0, 2.0**-126 * (1 - 2.0**-9)])
    v = np.concatenate(values + [special, rng.normal(size=1000) * 2.0 ** rng.integers(-140, 120, 1000)])
    ours = G.rne_bf16(v)
    theirs = round_to_bf16(v).astype(np.float64)
    assert np.array_equal(ours, theirs) and np.array_equal(np.signbit(ours), np.signbit(theirs))


@pytest.mark.parametrize("case", G.CASES)
def test_reference_matches_the_golden_data(case):
    config, inputs, grads, fc1_c, meta, golden = CASES[case]
    assert config.backward_operand_format is MoeFormat.BF16
    # The stored stash (naive forward) is the reference forward's, bit for bit.
    for f, c, m in zip(REF.forward(config, inputs), fc1_c, meta):
        assert np.array_equal(f.fc1_c.view(np.uint16), c.view(np.uint16)) and np.array_equal(f.route_metadata, m)
    results, _ = _run(case)
    for r, res in enumerate(results):
        for name in G.GRADS:
            got, want = getattr(res, name), golden[name][r]
            assert got.dtype == np.float32 and got.shape == want.shape, name
            # float64 on both sides, summed in other orders: the float32 result is the
            # golden value's float32 rounding (within float64 noise of a tie).
            assert np.all(np.abs(got - want) <= 2.0**-24 * np.abs(want) * (1 + 1e-9)), (case, r, name)
            assert np.array_equal(got, want.astype(np.float32)), (case, r, name)


@pytest.mark.parametrize("case", ["ties_weights_in_fc1", "ties_weights_in_fc2"])
def test_golden_ties_catch_another_tie_rule(case):
    """Rounding the operands half away from zero changes the tie cases' gradients."""

    def away(values):
        v = np.asarray(values, dtype=np.float64)
        r = round_to_bf16(v).astype(np.float64)
        tie = G.is_bf16_tie(v)
        step = 2 * np.abs(v - r)
        return np.where(tie & (np.abs(r) < np.abs(v)), r + np.sign(v) * step, r)

    with mutants.patched([(W, "bf16_operand", lambda orig: away)]):
        results, golden = _run(case)
    differ = [name for name in G.GRADS if not np.array_equal(getattr(results[0], name), golden[name][0].astype(np.float32))]
    assert {"grad_activation", "grad_fc1_weight", "grad_fc2_weight"} <= set(differ), differ


@pytest.mark.parametrize("case", G.CASES)
def test_exact_mode_differs_from_the_golden_data(case):
    config, inputs, grads, fc1_c, meta, golden = CASES[case]
    stash = [Stash(c, m) for c, m in zip(fc1_c, meta)]
    exact = REF.backward(config.replace(backward_operand_format=None), inputs, grads, stash)
    assert any(
        not np.array_equal(getattr(exact[r], n), golden[n][r].astype(np.float32))
        for r in range(config.num_ranks)
        for n in ("grad_activation", "grad_fc2_weight")
    )


def test_bf16_cotangent_and_its_float32_copy_give_the_same_gradients():
    config, inputs, grads, fc1_c, meta, _ = CASES["random_ep2_clamp"]
    stash = [Stash(c, m) for c, m in zip(fc1_c, meta)]
    as_bf16 = [g.astype(BF16) for g in grads]
    a = REF.backward(config, inputs, as_bf16, stash)
    b = REF.backward(config, inputs, [g.astype(np.float32) for g in as_bf16], stash)
    for x, y in zip(a, b):
        for n in G.GRADS:
            assert np.array_equal(getattr(x, n), getattr(y, n)), n


def test_budgets_of_the_bf16_mode():
    """Zero where a rounded operand cannot move and its GEMM is exact in float32;
    one bf16 step of an operand where a tie lies within the float32 error."""
    config, inputs, grads, fc1_c, meta, golden = CASES["ties_weights_in_fc1"]
    stash = [Stash(c, m) for c, m in zip(fc1_c, meta)]
    _, budget = REF.backward_and_budget(config, inputs, grads, stash)
    b = budget[0]
    # One-hot activations: dW1 = x^T dc_b sums one or two rows of bf16 values.
    dc_ties = G.is_bf16_tie(golden["dc"][0]).any(axis=0)  # columns of dW1 a tie can move
    assert (b.grad_fc1_weight[:, :, ~dc_ties] == 0).mean() > 0.5
    assert (b.grad_fc1_weight[:, :, dc_ties].max(axis=(0, 1)) > 0).all()
    # Random inputs: the bf16 mode's dW2 budget is float32 accumulation on bf16
    # operands, 0 where that is exact and far below a bf16 step elsewhere.
    config, inputs, grads, fc1_c, meta, golden = CASES["random_ep2_clamp"]
    stash = [Stash(c, m) for c, m in zip(fc1_c, meta)]
    results, budget = REF.backward_and_budget(config, inputs, grads, stash)
    for res, bud in zip(results, budget):
        mag = np.abs(res.grad_fc2_weight)
        assert np.all(bud.grad_fc2_weight <= 2.0**-9 * mag + 1e-30)
        assert (bud.grad_fc2_weight == 0).mean() > 0.5


def test_forward_and_layered_primitives_ignore_the_field():
    base = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2, generate_c=True)
    bf = base.replace(backward_operand_format="bf16")
    world = random_world(base, num_tokens=[5, 3], seed=7)
    for a, b in zip(REF.forward(base, world), REF.forward(bf, world)):
        assert np.array_equal(a.output.view(np.uint16), b.output.view(np.uint16))
        assert np.array_equal(a.fc1_c.view(np.uint16), b.fc1_c.view(np.uint16))
    dispatched = REF.dispatch(bf, [DispatchInputs(w.activation, w.topk_idx, w.topk_weights) for w in world])
    handles = [d.handle for d in dispatched]
    rng = np.random.default_rng(8)
    rows = [rng.normal(size=(h.num_recv_rows, 32)).astype(np.float32) for h in handles]
    wts = [rng.normal(size=h.num_recv_rows).astype(np.float32) for h in handles]
    cot = [rng.normal(size=(h.num_tokens, 32)).astype(np.float32) for h in handles]
    for cfg_a, cfg_b in ((base, bf),):
        for x, y in zip(REF.dispatch_backward(cfg_a, handles, rows, wts), REF.dispatch_backward(cfg_b, handles, rows, wts)):
            assert np.array_equal(x.grad_tokens, y.grad_tokens) and np.array_equal(x.grad_topk_weights, y.grad_topk_weights)
        for x, y in zip(REF.combine_backward(cfg_a, handles, cot), REF.combine_backward(cfg_b, handles, cot)):
            assert np.array_equal(x, y)


def test_bf16_operand_rounds_to_nearest_even():
    v = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 64.25, 64.75, 1 + 2.0**-9, np.nan, np.inf, -0.0])
    got = W.bf16_operand(v)
    assert got.dtype == np.float64
    want = np.array([1.0, 1 + 2.0**-6, -1.0, 64.0, 65.0, 1.0, np.nan, np.inf, -0.0])
    assert np.array_equal(got, want, equal_nan=True) and np.signbit(got[-1])


def test_static_and_dynamic_layouts_agree_in_the_bf16_mode():
    config, inputs, grads, *_ = CASES["random_ep2_static_bf16_cotangent"]
    dynamic = config.replace(recv_capacity=None, expert_alignment=1)
    out = []
    for cfg in (config, dynamic):
        stash = [f.stash for f in REF.forward(cfg, inputs)]
        out.append(REF.backward(cfg, inputs, grads, stash))
    for a, b in zip(*out):
        for n in G.GRADS:
            assert np.array_equal(getattr(a, n), getattr(b, n)), n


def test_product_bound():
    """``P(A, B; dA, dB)`` of spec section 13.1: 0 for an exact float32 product of
    error-free operands, the float32 accumulation bound otherwise, plus the
    operands' errors propagated through the other operand's magnitudes."""
    from moe_ep_spec.tolerance import gamma, product_bound, underflow

    a = np.array([[1.0, 2.0**-8], [3.0, 0.1]])
    b = np.array([[1.0, -1.0], [1.0, 0.5]])
    p = product_bound(a, b)
    assert p[0, 0] == 0 and p[0, 1] == 0  # 1 + 2^-8 and -1 + 2^-9: exact in float32
    assert p[1, 0] == pytest.approx(gamma(2) * (3.0 + 0.1) + underflow(2))  # 0.1 is no multiple of a common quantum
    e = product_bound(a, b, lhs_error=np.array([[0.0, 0.0], [2.0**-10, 0.0]]))
    assert e[0, 0] == 0 and e[0, 1] == 0  # row 0 of A is error-free
    assert e[1, 0] == pytest.approx(2.0**-10 * 1.0 + p[1, 0])
    f = product_bound(a, b, rhs_error=np.array([[0.0, 0.0], [0.0, 2.0**-12]]))
    assert f[0, 0] == 0 and f[0, 1] > 0 and f[0, 1] == pytest.approx(2.0**-8 * 2.0**-12 + gamma(2) * (1 + 2.0**-9) + underflow(2))
