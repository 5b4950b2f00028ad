"""The reference backward against central finite differences of the exact forward.

The backward is straight-through: every rounding point is the identity, and it
recomputes from the bf16 stash ``fc1_c``. The finite differences therefore use
the naive forward with no rounding at all (``exact=True``) on float64 copies of
the inputs, and the worlds are built so that ``c`` is exactly representable in
bf16 (``naive.grid_world``): then ``fc1_c == c`` and the backward is the exact
gradient of the exact forward.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from moe_ep_spec import MoeEpConfig, RankInputs, ShapeError, Stash, StashError
from moe_ep_reference import ReferenceBackend

try:  # tests/ may or may not be a package
    from . import naive
except ImportError:
    import naive

REF = ReferenceBackend()
EPS = 1e-6
# A clamp limit 1/64 away from every multiple of 1/32 (the grid of c).
LIMIT = 33 / 64
TOKENS = {1: [5], 2: [4, 0], 4: [2, 0, 3, 1]}
FIELDS = ("activation", "fc1_weight", "fc2_weight", "topk_weights")


def cfg(**kw) -> MoeEpConfig:
    base = dict(num_experts=4, hidden=8, intermediate=4, num_topk=2, num_ranks=2, generate_c=True)
    base.update(kw)
    return MoeEpConfig(**base)


def grads_of(config, world, grad_output):
    fwd = REF.forward(config, world)
    return fwd, REF.backward(config, world, grad_output, [f.stash for f in fwd])


def random_grad_output(world, hidden, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(inp.topk_idx.shape[0], hidden)).astype(np.float32) for inp in world]


def finite_differences(config, world, grad_output):
    """Central differences of L = sum_r <grad_output_r, exact_output_r> with respect
    to every entry of the four differentiable inputs, in float64."""
    w64 = {f: [np.array(getattr(inp, f), dtype=np.float64) for inp in world] for f in FIELDS}
    gy = [g.astype(np.float64) for g in grad_output]

    def loss() -> float:
        inputs = [
            RankInputs(w64["activation"][r], w64["fc1_weight"][r], w64["fc2_weight"][r], world[r].topk_idx,
                       w64["topk_weights"][r])
            for r in range(len(world))
        ]
        outs = naive.naive_forward(config, inputs, exact=True)
        return float(sum(np.sum(g * o.output) for g, o in zip(gy, outs)))

    fd = {f: [np.zeros_like(a) for a in w64[f]] for f in FIELDS}
    for f in FIELDS:
        for r, arr in enumerate(w64[f]):
            flat, out = arr.reshape(-1), fd[f][r].reshape(-1)
            for j in range(flat.size):
                keep = flat[j]
                flat[j] = keep + EPS
                up = loss()
                flat[j] = keep - EPS
                down = loss()
                flat[j] = keep
                out[j] = (up - down) / (2 * EPS)
    return fd


def assert_close_to_fd(got, fd, what):
    scale = max(float(np.max(np.abs(fd), initial=0.0)), 1e-3)
    assert got.dtype == np.float32 and got.shape == fd.shape, what
    np.testing.assert_allclose(got, fd, rtol=2e-5, atol=2e-6 * scale, err_msg=what)


@pytest.mark.parametrize("placement", [True, False], ids=["weight-in-fc1", "weight-in-fc2"])
@pytest.mark.parametrize("clamp", [None, LIMIT], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
def test_backward_matches_finite_differences(num_ranks, clamp, placement):
    config = cfg(num_ranks=num_ranks, gate_up_clamp=clamp, apply_topk_in_fc1=placement)
    world = naive.grid_world(config, seed=100 + num_ranks, tokens_per_rank=TOKENS[num_ranks], clamp_columns=clamp is not None)
    gy = random_grad_output(world, config.hidden, seed=num_ranks)
    fwd, grads = grads_of(config, world, gy)
    exact = naive.naive_forward(config, world, exact=True)
    for f, e in zip(fwd, exact):  # the grid makes the bf16 stash exact
        np.testing.assert_array_equal(f.fc1_c.astype(np.float64), e.c)
    fd = finite_differences(config, world, gy)
    names = dict(zip(FIELDS, ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")))
    for r, g in enumerate(grads):
        for f, gname in names.items():
            assert_close_to_fd(getattr(g, gname), fd[f][r], f"rank {r} {gname}")
        unused = world[r].topk_idx < 0
        assert np.all(g.grad_topk_weights[unused] == 0.0)
        assert np.all(fd["topk_weights"][r][unused] == 0.0)
    assert any((inp.topk_idx < 0).any() for inp in world)
    if clamp is not None:
        i = config.intermediate
        c = np.concatenate([e.c for e in exact])
        assert (c[:, 1:i] > clamp).any() and (np.abs(c[:, i + 2 :]) > clamp).any(), "clamp not hit off the bias columns"
        assert np.all(c[:, 0] > clamp) and np.all(c[:, i + 1] < -clamp)
        used = 0
        for r, g in enumerate(grads):
            for le in range(config.num_local_experts):
                # Every route of every expert is clamped in gate column 0 and up column
                # i+1: those columns of c get exactly zero gradient.
                assert np.all(g.grad_fc1_weight[le][:, 0] == 0.0) and np.all(g.grad_fc1_weight[le][:, i + 1] == 0.0)
                assert np.all(fd["fc1_weight"][r][le][:, [0, i + 1]] == 0.0)
                used += int(np.any(g.grad_fc1_weight[le] != 0))
        assert used > 0


@pytest.mark.parametrize("placement", [True, False], ids=["weight-in-fc1", "weight-in-fc2"])
@pytest.mark.parametrize(
    "gate,up,gate_passes,up_passes",
    [
        (LIMIT, LIMIT, True, True),
        (LIMIT, -LIMIT, True, True),
        (LIMIT + 1 / 32, LIMIT + 1 / 32, False, False),
        (LIMIT + 1 / 32, -LIMIT - 1 / 32, False, False),
        (-4.0, 0.25, True, True),  # the gate clamp is an upper bound only
    ],
    ids=["at-limit", "up-at-minus-limit", "beyond", "up-below-minus-limit", "gate-far-negative"],
)
def test_clamp_masks_are_inclusive(gate, up, gate_passes, up_passes, placement):
    """One route, H = I = 1, x = 1, W2 = 1, w = 1/2, dY = 1: dW1 = dc exactly."""
    config = MoeEpConfig(num_experts=1, hidden=1, intermediate=1, num_topk=1, gate_up_clamp=LIMIT,
                         apply_topk_in_fc1=placement, generate_c=True)
    inp = RankInputs(
        np.ones((1, 1), np.float32), np.array([[[gate, up]]], np.float32), np.ones((1, 1, 1), np.float32),
        np.zeros((1, 1), np.int64), np.full((1, 1), 0.5, np.float32),
    )
    _, grads = grads_of(config, [inp], [np.ones((1, 1), np.float32)])
    g, u = min(gate, LIMIT), min(max(up, -LIMIT), LIMIT)
    sig = 1 / (1 + np.exp(-g))
    dg = 0.5 * u * sig * (1 + g * (1 - sig)) if gate_passes else 0.0
    du = 0.5 * g * sig if up_passes else 0.0
    got = grads[0].grad_fc1_weight[0, 0]
    np.testing.assert_allclose(got, [dg, du], rtol=1e-6)
    assert (got[0] == 0.0) == (not gate_passes) and (got[1] == 0.0) == (not up_passes)
    np.testing.assert_allclose(grads[0].grad_topk_weights, [[g * sig * u]], rtol=1e-6)


BACKWARD_CASES = {
    "plain": dict(),
    "clamp-weight-in-fc2": dict(gate_up_clamp=0.5, apply_topk_in_fc1=False),
    "block-inputs": dict(world=dict(activation_format="mxfp8", fc1_format="nvfp4", fc2_format="mxfp8"), hidden=32, intermediate=32),
    "formats-ignored": dict(output_format="nvfp4", combine_format="mxfp8", intermediate_format="mxfp8", hidden=32, intermediate=32),
    "static-layout": dict(recv_capacity=40, expert_alignment=4, gate_up_clamp=0.75),
    "duplicates": dict(world=dict(routing="duplicates"), num_topk=3),
}


@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
@pytest.mark.parametrize("case", list(BACKWARD_CASES), ids=list(BACKWARD_CASES))
def test_backward_matches_naive_per_route(case, num_ranks):
    """Generic (non-grid) worlds: the reference against section 3 of the brief
    applied route by route to the same stash."""
    kw = dict(BACKWARD_CASES[case])
    world_kw = kw.pop("world", {})
    config = cfg(**{"num_experts": 8, "hidden": 16, "intermediate": 8, "num_ranks": num_ranks, **kw})
    world = naive.make_world(config, 200 + num_ranks, TOKENS[num_ranks], act_scale=1.5, **world_kw)
    gy = random_grad_output(world, config.hidden, seed=7)
    fwd, grads = grads_of(config, world, gy)
    expected = naive.naive_backward(
        config, world, gy, [f.fc1_c for f in fwd], [f.route_metadata for f in fwd]
    )
    for r, (g, e) in enumerate(zip(grads, expected)):
        for name in ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"):
            got, exp = getattr(g, name), getattr(e, name)
            assert got.dtype == np.float32 and got.shape == exp.shape, name
            scale = max(float(np.max(np.abs(exp), initial=0.0)), 1e-6)
            np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6 * scale, err_msg=f"rank {r} {name}")
        assert np.all(g.grad_topk_weights[world[r].topk_idx < 0] == 0.0)


def test_backward_of_zero_grad_output_is_zero():
    config = cfg(num_ranks=2)
    world = naive.make_world(config, 5, [3, 2])
    _, grads = grads_of(config, world, [np.zeros((n, 8), np.float32) for n in (3, 2)])
    for g in grads:
        for a in (g.grad_activation, g.grad_fc1_weight, g.grad_fc2_weight, g.grad_topk_weights):
            assert not np.any(a)


# ---------------------------------------------------------------- errors


def _setup_errors():
    config = cfg(num_ranks=2)
    world = naive.make_world(config, 3, [4, 3], unused_prob=0.0)
    fwd = REF.forward(config, world)
    gy = random_grad_output(world, config.hidden, 1)
    return config, world, fwd, gy


def test_backward_rejects_reordered_route_metadata():
    config, world, fwd, gy = _setup_errors()
    good = fwd[1].route_metadata
    assert good.shape[0] >= 2 and not np.array_equal(good[0], good[1])
    bad = good.copy()
    bad[[0, 1]] = bad[[1, 0]]
    stash = [fwd[0].stash, Stash(fwd[1].fc1_c, bad)]
    expected = (
        f"rank 1: route_metadata must equal the forward's routing of topk_idx; row 0 is "
        f"{tuple(int(v) for v in bad[0])}, the routing gives {tuple(int(v) for v in good[0])}"
    )
    with pytest.raises(StashError, match=re.escape(expected)):
        REF.backward(config, world, gy, stash)


def test_backward_rejects_stash_of_other_routing():
    config, world, fwd, gy = _setup_errors()
    # Same number of routes per rank, different slots: swap the two slots of every token.
    swapped = [
        RankInputs(w.activation, w.fc1_weight, w.fc2_weight, w.topk_idx[:, ::-1].copy(), w.topk_weights[:, ::-1].copy())
        for w in world
    ]
    other = REF.forward(config, swapped)
    with pytest.raises(StashError, match=r"^rank 0: route_metadata must equal the forward's routing of topk_idx; row \d+ is "):
        REF.backward(config, world, gy, [o.stash for o in other])


def test_backward_rejects_wrong_grad_output_shape():
    config, world, fwd, gy = _setup_errors()
    gy[0] = gy[0][:, :7]
    with pytest.raises(ShapeError, match=re.escape("rank 0: grad_output must have shape (num_tokens, hidden) = (4, 8); got (4, 7)")):
        REF.backward(config, world, gy, [f.stash for f in fwd])


def test_backward_rejects_stash_with_missing_rows():
    config, world, fwd, gy = _setup_errors()
    rows = fwd[1].fc1_c.shape[0]
    stash = [fwd[0].stash, Stash(fwd[1].fc1_c[:-1], fwd[1].route_metadata[:-1])]
    with pytest.raises(
        ShapeError, match=re.escape(f"rank 1: fc1_c must have shape (rows, 2 * intermediate) = ({rows}, 8); got ({rows - 1}, 8)")
    ):
        REF.backward(config, world, gy, stash)
