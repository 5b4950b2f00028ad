"""The reference's layered primitives: dispatch, combine and their backward passes."""

from __future__ import annotations

import numpy as np
import pytest

from moe_ep_spec import BlockScaledTensor, DispatchInputs, MoeEpConfig
from moe_ep_spec.formats import BF16, dequantize, quantize, round_to_bf16
from moe_ep_reference import ReferenceBackend

try:  # tests/ may or may not be a package
    from . import naive
except ImportError:
    import naive

REF = ReferenceBackend()
TOKENS = {1: [6], 2: [5, 0], 4: [3, 0, 4, 2]}
LAYOUTS = {"dynamic": dict(), "static-align1": dict(recv_capacity=48), "static-align4": dict(recv_capacity=64, expert_alignment=4)}


def cfg(**kw) -> MoeEpConfig:
    base = dict(num_experts=8, hidden=16, intermediate=8, num_topk=3, num_ranks=2)
    base.update(kw)
    return MoeEpConfig(**base)


def routing(config, seed, tokens, duplicates=True, unused_prob=0.25):
    """topk_idx and topk_weights for every rank (ids may repeat within a token)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in tokens:
        idx = rng.integers(0, config.num_experts, size=(n, config.num_topk))
        if not duplicates:
            idx = np.stack([rng.permutation(config.num_experts)[: config.num_topk] for _ in range(n)]).reshape(n, -1)
        idx = np.where(rng.random(idx.shape) < unused_prob, -1, idx)
        out.append((idx.astype(np.int64), rng.uniform(0.1, 1.0, size=idx.shape).astype(np.float32)))
    return out


def grid_tokens(rng, n, h):
    """float32 multiples of 1/4 in [-2, 2]: 3 x any of them is exact in bf16."""
    return (rng.integers(-8, 9, size=(n, h)) / 4.0).astype(np.float32)


def encode_tokens(x, encoding):
    if encoding in ("mxfp8", "nvfp4"):
        return quantize(x, encoding, axis=1)
    return x.astype({"float32": np.float32, "bf16": BF16}[encoding])


def dispatch_world(config, seed, tokens, encoding="float32", duplicates=True):
    rng = np.random.default_rng(seed + 1000)
    routes = routing(config, seed, tokens, duplicates)
    xs = [encode_tokens(grid_tokens(rng, n, config.hidden), encoding) for n in tokens]
    inputs = [DispatchInputs(x, idx, w) for x, (idx, w) in zip(xs, routes)]
    return inputs, REF.dispatch(config, inputs)


def decoded(t) -> np.ndarray:
    return dequantize(t, np.float64) if isinstance(t, BlockScaledTensor) else np.asarray(t).astype(np.float64)


# ---------------------------------------------------------------- dispatch + combine


@pytest.mark.parametrize("encoding", ["float32", "bf16", "mxfp8"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
def test_identity_expert_returns_token_times_valid_slots(num_ranks, layout, encoding):
    config = cfg(num_ranks=num_ranks, hidden=32, **LAYOUTS[layout])
    inputs, results = dispatch_world(config, num_ranks, TOKENS[num_ranks], encoding)
    expert_out = [decoded(res.tokens).astype(np.float32) for res in results]
    out = REF.combine(config, [res.handle for res in results], expert_out)
    for r, inp in enumerate(inputs):
        n_valid = (inp.topk_idx >= 0).sum(axis=1)
        expected = decoded(inp.tokens) * n_valid[:, None]
        assert np.array_equal(round_to_bf16(expected).astype(np.float64), expected), "test tokens must be exact"
        assert out[r].dtype == BF16 and out[r].shape == expected.shape
        np.testing.assert_array_equal(out[r].astype(np.float64), expected, err_msg=f"rank {r}")
    assert any((inp.topk_idx < 0).any() for inp in inputs), "the world must have unused slots"


@pytest.mark.parametrize("hidden", [32, 40], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("encoding", ["mxfp8", "nvfp4", "float32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_dispatch_moves_tokens_unchanged(layout, encoding, hidden):
    config = cfg(num_ranks=2, hidden=hidden, **LAYOUTS[layout])
    rng = np.random.default_rng(3)
    routes = routing(config, 4, [5, 4])
    xs = [encode_tokens(rng.normal(size=(n, hidden)) * 3.0, encoding) for n in (5, 4)]
    inputs = [DispatchInputs(x, idx, w) for x, (idx, w) in zip(xs, routes)]
    results = REF.dispatch(config, inputs)
    plans = naive.naive_plan(config, [idx for idx, _ in routes])
    for d, (res, plan) in enumerate(zip(results, plans)):
        meta = res.route_metadata
        np.testing.assert_array_equal(meta, plan.rows)
        np.testing.assert_array_equal(res.tokens_per_expert, plan.counts)
        np.testing.assert_array_equal(res.expert_offsets, plan.offsets)
        assert res.topk_weights.dtype == np.float32 and res.topk_weights.shape == (meta.shape[0],)
        valid = meta[:, 0] >= 0
        src, tok, slot = meta[valid, 1], meta[valid, 2], meta[valid, 3]
        w_expected = np.array([routes[s][1][t, k] for s, t, k in zip(src, tok, slot)], np.float32)
        np.testing.assert_array_equal(res.topk_weights[valid], w_expected)
        if isinstance(xs[0], BlockScaledTensor):
            got = res.tokens
            assert isinstance(got, BlockScaledTensor) and got.format is xs[0].format
            assert got.shape == (meta.shape[0], hidden) and got.axis == 1
            if valid.any():
                data = np.stack([xs[s].data_codes()[t] for s, t in zip(src, tok)])
                scale = np.stack([xs[s].scale_codes()[t] for s, t in zip(src, tok)])
                np.testing.assert_array_equal(got.data_codes()[valid], data)
                np.testing.assert_array_equal(got.scale_codes()[valid], scale)
            assert not got.data_codes()[~valid].any() and not got.scale_codes()[~valid].any()
        else:
            got = res.tokens
            assert got.dtype == xs[0].dtype and got.shape == (meta.shape[0], hidden)
            bits = np.uint32 if got.dtype == np.float32 else np.uint16
            if valid.any():
                expected = np.stack([xs[s][t] for s, t in zip(src, tok)])
                np.testing.assert_array_equal(got[valid].view(bits), expected.view(bits))
            assert not got[~valid].view(bits).any(), "padding rows must be +0"


@pytest.mark.parametrize("alignment", [1, 3, 4], ids=lambda a: f"align{a}")
@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
def test_static_layout_padding_and_offsets(num_ranks, alignment):
    config = cfg(num_ranks=num_ranks, recv_capacity=70, expert_alignment=alignment)
    inputs, results = dispatch_world(config, 11, TOKENS[num_ranks])
    for d, res in enumerate(results):
        meta, h = res.route_metadata, res.handle
        assert meta.shape == (70, 4) and meta.dtype == np.int32 and h.num_recv_rows == 70
        offsets, counts = res.expert_offsets, res.tokens_per_expert
        assert offsets.shape == (config.num_local_experts + 1,) and offsets[0] == 0
        assert np.all(offsets % alignment == 0)
        assert np.all(offsets[1:] - offsets[:-1] == -(-counts // alignment) * alignment)
        valid = np.zeros(70, bool)
        for le in range(config.num_local_experts):
            sl = slice(int(offsets[le]), int(offsets[le] + counts[le]))
            assert np.all(meta[sl, 0] == le)
            valid[sl] = True
        np.testing.assert_array_equal(h.valid_rows, valid)
        assert np.all(meta[~valid] == -1)
        assert np.all(res.topk_weights[~valid] == 0) and not np.any(res.tokens[~valid].view(np.uint32))
        assert counts.sum() == sum(int((inp.topk_idx // config.num_local_experts == d).sum()) for inp in inputs)


# ---------------------------------------------------------------- fused = combine . experts . dispatch

FUSED_CASES = {
    "bf16": dict(),
    "out-mxfp8-combine-nvfp4": dict(hidden=32, output_format="mxfp8", combine_format="nvfp4"),
    "out-nvfp4-combine-mxfp8-inter-nvfp4": dict(hidden=32, intermediate=16, output_format="nvfp4", combine_format="mxfp8", intermediate_format="nvfp4"),
    "weight-in-fc2-inter-bf16-clamp": dict(apply_topk_in_fc1=False, intermediate_format="bf16", gate_up_clamp=0.5),
    "static-align4": dict(recv_capacity=64, expert_alignment=4),
    "block-inputs": dict(hidden=32, world=dict(activation_format="nvfp4", weight_format="mxfp8")),
}


@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
@pytest.mark.parametrize("case", list(FUSED_CASES), ids=list(FUSED_CASES))
def test_fused_forward_equals_combine_of_experts_of_dispatch(case, num_ranks):
    kw = dict(FUSED_CASES[case])
    world_kw = kw.pop("world", {})
    config = cfg(num_ranks=num_ranks, **kw)
    world = naive.make_world(config, 61, TOKENS[num_ranks], routing="duplicates", act_scale=1.5, **world_kw)
    fused = REF.forward(config, world)
    dispatched = REF.dispatch(config, [DispatchInputs(w.activation, w.topk_idx, w.topk_weights) for w in world])
    expert_out = []
    for d, res in enumerate(dispatched):
        x = decoded(res.tokens)
        fc1, fc2 = naive.decode(world[d].fc1_weight), naive.decode(world[d].fc2_weight)
        y = np.full((x.shape[0], config.hidden), np.nan)  # padding rows: never read
        for j, row in enumerate(res.route_metadata):
            le = int(row[0])
            if le >= 0:
                y[j], _ = naive.route_forward(config, x[j], float(res.topk_weights[j]), fc1[le], fc2[le])
        expert_out.append(y.astype(np.float32))  # combine-format values: exact in float32
    combined = REF.combine(config, [res.handle for res in dispatched], expert_out)
    for r, (a, b) in enumerate(zip(fused, combined)):
        assert all(np.array_equal(p, q) for p, q in zip(naive.output_bits(a.output), naive.output_bits(b))), f"rank {r}"


# ---------------------------------------------------------------- adjoints


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
def test_dispatch_backward_is_the_adjoint_of_dispatch(num_ranks, layout):
    config = cfg(num_ranks=num_ranks, **LAYOUTS[layout])
    inputs, results = dispatch_world(config, 71, TOKENS[num_ranks])
    rng = np.random.default_rng(72)
    # Cotangents on a coarse grid: every sum below is exact in float32 and float64.
    gt = [(rng.integers(-16, 17, size=(res.handle.num_recv_rows, config.hidden)) / 8).astype(np.float32) for res in results]
    gw = [(rng.integers(-16, 17, size=(res.handle.num_recv_rows,)) / 8).astype(np.float32) for res in results]
    lhs = sum(
        float(np.sum(res.tokens.astype(np.float64) * g)) + float(np.dot(res.topk_weights.astype(np.float64), w))
        for res, g, w in zip(results, gt, gw)
    )
    grads = REF.dispatch_backward(config, [res.handle for res in results], gt, gw)
    rhs = sum(
        float(np.sum(inp.tokens.astype(np.float64) * g.grad_tokens))
        + float(np.sum(inp.topk_weights.astype(np.float64) * g.grad_topk_weights))
        for inp, g in zip(inputs, grads)
    )
    assert abs(lhs) > 1.0
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)
    for inp, g in zip(inputs, grads):
        assert g.grad_tokens.dtype == np.float32 and g.grad_tokens.shape == inp.tokens.shape
        assert g.grad_topk_weights.dtype == np.float32 and g.grad_topk_weights.shape == inp.topk_idx.shape
        assert np.all(g.grad_topk_weights[inp.topk_idx < 0] == 0.0)
    if config.static_layout:
        # Padding rows' cotangents are ignored.
        for res, g, w in zip(results, gt, gw):
            pad = ~res.handle.valid_rows
            g[pad] = 1e30
            w[pad] = np.nan
        again = REF.dispatch_backward(config, [res.handle for res in results], gt, gw)
        for a, b in zip(grads, again):
            np.testing.assert_array_equal(a.grad_tokens, b.grad_tokens)
            np.testing.assert_array_equal(a.grad_topk_weights, b.grad_topk_weights)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("num_ranks", [1, 2, 4], ids=lambda n: f"ranks{n}")
def test_combine_backward_is_the_adjoint_of_combine(num_ranks, layout):
    config = cfg(num_ranks=num_ranks, **LAYOUTS[layout])
    inputs, results = dispatch_world(config, 81, TOKENS[num_ranks])
    handles = [res.handle for res in results]
    rng = np.random.default_rng(82)
    # Expert outputs on a grid where the bf16 combine and output roundings are exact.
    ys = [(rng.integers(-32, 33, size=(h.num_recv_rows, config.hidden)) / 8).astype(np.float32) for h in handles]
    gs = [rng.normal(size=(inp.topk_idx.shape[0], config.hidden)).astype(np.float32) for inp in inputs]
    out = REF.combine(config, handles, ys)
    lhs = sum(float(np.sum(o.astype(np.float64) * g.astype(np.float64))) for o, g in zip(out, gs))
    back = REF.combine_backward(config, handles, gs)
    rhs = sum(float(np.sum(y.astype(np.float64) * b.astype(np.float64))) for y, b in zip(ys, back))
    assert abs(lhs) > 1.0
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)
    for h, b, g, inp in zip(handles, back, gs, inputs):
        assert b.dtype == np.float32 and b.shape == (h.num_recv_rows, config.hidden)
        assert not b[~h.valid_rows].any(), "padding rows of combine_backward must be zero"
    # combine_backward is a dispatch of the cotangent: each row is its token's row.
    for h, b in zip(handles, back):
        meta = h.route_metadata
        for j in np.nonzero(h.valid_rows)[0]:
            np.testing.assert_array_equal(b[j], gs[meta[j, 1]][meta[j, 2]])


# ---------------------------------------------------------------- NaN in padding


@pytest.mark.parametrize(
    "output_format,combine_format",
    [("bf16", "bf16"), ("mxfp8", "nvfp4"), ("nvfp4", "mxfp8")],
    ids=["out-bf16-combine-bf16", "out-mxfp8-combine-nvfp4", "out-nvfp4-combine-mxfp8"],
)
@pytest.mark.parametrize("num_ranks", [1, 2], ids=lambda n: f"ranks{n}")
def test_nan_in_padded_rows_never_reaches_the_output(num_ranks, output_format, combine_format):
    config = cfg(num_ranks=num_ranks, hidden=32, recv_capacity=64, expert_alignment=4,
                 output_format=output_format, combine_format=combine_format)
    inputs, results = dispatch_world(config, 91, TOKENS[num_ranks])
    handles = [res.handle for res in results]
    rng = np.random.default_rng(92)
    clean = [np.where(h.valid_rows[:, None], rng.normal(size=(h.num_recv_rows, 32)), 0.0).astype(np.float32) for h in handles]
    dirty = []
    for h, y in zip(handles, clean):
        d = y.copy()
        pad = np.nonzero(~h.valid_rows)[0]
        assert pad.size > 0
        d[pad] = np.nan
        d[pad[0], 0] = np.inf
        dirty.append(d)
    a, b = REF.combine(config, handles, clean), REF.combine(config, handles, dirty)
    for x, y in zip(a, b):
        assert np.all(np.isfinite(decoded(y)))
        assert all(np.array_equal(p, q) for p, q in zip(naive.output_bits(x), naive.output_bits(y)))
    # The fused forward in the same static layout is finite too (its padding rows are zero).
    world = naive.make_world(config, 93, TOKENS[num_ranks])
    for res in REF.forward(config, world):
        assert np.all(np.isfinite(decoded(res.output)))
