"""The native layer's backward with ``backward_operand_format="bf16"`` (docs/spec.md 9.2):
its CPU implementation against the formulas (R_bf16 of dY, of dc and of w*h before their
GEMMs, dw = <a, h> in both placements), the accumulate-into-main_grad flag, the
configuration field's ABI; on a CUDA machine, the tensor-core path (four bf16 grouped
GEMMs and one fused SwiGLU pass) against the CPU implementation."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("moe_ep_native")

from moe_ep_native._capi import Format, LayerConfig, call, has_cuda  # noqa: E402
from moe_ep_native.layer import Layer, layer_config  # noqa: E402
from moe_ep_spec import MoeEpConfig, NativeArgumentError  # noqa: E402
from moe_ep_spec.formats import BF16  # noqa: E402


def _ptr(a):
    return a.ctypes.data if a is not None and a.size else None


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16) if a.dtype == BF16 else np.ascontiguousarray(a)


def _r(a):
    """R_bf16 (nearest even) as float64 values (through float32, exact for float32 inputs)."""
    return np.asarray(a, np.float32).astype(BF16).astype(np.float64)


CONFIGS = {
    "fc1-clamp": dict(num_experts=3, hidden=48, intermediate=24, num_topk=2, num_ranks=1, gate_up_clamp=0.7),
    "fc2": dict(num_experts=3, hidden=64, intermediate=32, num_topk=2, num_ranks=1, apply_topk_in_fc1=False),
    "fc2-clamp-int_mxfp8": dict(num_experts=2, hidden=64, intermediate=32, num_topk=2, num_ranks=1,
                                apply_topk_in_fc1=False, gate_up_clamp=0.5, intermediate_format="mxfp8",
                                combine_format="mxfp8", output_format="mxfp8"),
}


def _config(name, mode="bf16"):
    return MoeEpConfig(**CONFIGS[name], backward_operand_format=mode)


def _case(config, sizes, seed=0):
    rng = np.random.default_rng(seed)
    e, h, i = config.num_local_experts, config.hidden, config.intermediate
    rows = sum(sizes) + 3  # rows past the slabs belong to no expert
    x = rng.standard_normal((rows, h)).astype(np.float32).astype(BF16)
    x[sum(sizes):] = 0
    w = rng.uniform(0.1, 1.0, rows).astype(np.float32)
    fc1 = (rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)).astype(np.float32).astype(BF16)
    fc2 = (rng.standard_normal((e, i, h)) / np.sqrt(i)).astype(np.float32).astype(BF16)
    # The stash: FC1 outputs of a plausible size, some beyond the clamp.
    c = (rng.standard_normal((rows, 2 * i)) * 0.8).astype(np.float32).astype(BF16)
    c[sum(sizes):] = 0
    dy = rng.standard_normal((rows, h)).astype(np.float32)
    return x, w, fc1, fc2, np.asarray(sizes, np.int32), c, dy


def _model(config, x, w, fc1, fc2, sizes, c, dy, magnitudes=False):
    """The bf16-operand backward of docs/spec.md 9.2 in float64 (the roundings in bf16).
    magnitudes: every sum over the absolute values of its terms instead (for error bounds)."""
    i_ = config.intermediate
    f = (lambda a: np.abs(np.asarray(a, np.float64))) if magnitudes else (lambda a: np.asarray(a, np.float64))  # noqa: E731
    m = np.abs if magnitudes else (lambda a: a)  # noqa: E731
    x, w, fc1, fc2, c = f(x), f(w), f(fc1), f(fc2), np.asarray(c, np.float64)
    dyb = m(_r(dy))
    rows = x.shape[0]
    dx = np.zeros((rows, config.hidden))
    dw = np.zeros(rows)
    dfc1 = np.zeros(fc1.shape)
    dfc2 = np.zeros(fc2.shape)
    lim = config.gate_up_clamp
    r0 = 0
    for e, n in enumerate(sizes):
        sl = slice(r0, r0 + n)
        r0 += n
        g_raw, u_raw = c[sl, :i_], c[sl, i_:]
        if lim is None:
            g, u, mg, mu = g_raw, u_raw, 1.0, 1.0
        else:
            mg = (g_raw <= lim).astype(np.float64)
            mu = ((u_raw >= -lim) & (u_raw <= lim)).astype(np.float64)
            g, u = np.minimum(g_raw, lim), np.clip(u_raw, -lim, lim)
        sig = 1.0 / (1.0 + np.exp(-g))
        s = g * sig
        h = m(s * u)
        a = dyb[sl] @ fc2[e].T
        dh = w[sl, None] * a
        dg = m(dh * u * sig * (1.0 + g * (1.0 - sig)) * mg)
        du = m(dh * s * mu)
        dcb = m(_r(np.concatenate([dg, du], axis=1)))
        dfc1[e] = x[sl].T @ dcb
        dx[sl] = dcb @ fc1[e].T
        dfc2[e] = m(_r(w[sl, None] * h)).T @ dyb[sl]
        dw[sl] = np.sum(a * h, axis=1)
    return dx, dw, dfc1, dfc2


def _backward(layer, config, x, w, fc1, fc2, gs, c, dy, *, dy_bf16=False, init=None, accumulate=False):
    rows = x.shape[0]
    shapes = [(rows, config.hidden), (rows,), fc1.shape, fc2.shape]
    outs = [np.full(s, np.nan, np.float32) for s in shapes]
    if init is not None:
        outs[2][...] = init[0]
        outs[3][...] = init[1]
    d = np.ascontiguousarray(dy.astype(BF16)).view(np.uint16) if dy_bf16 else dy
    layer.experts_backward(None, rows, _ptr(_bits(x)), _ptr(w), _ptr(_bits(fc1)), _ptr(_bits(fc2)),
                           _ptr(_bits(c)), _ptr(d), _ptr(gs), *[_ptr(o) for o in outs], dy_bf16=dy_bf16,
                           accumulate=accumulate)
    return outs


def _bounds(config, x, w, fc1, fc2, sizes, c, dy):
    """Per-element bounds of float32 accumulation: n * 2^-23 of the sum of the magnitudes of the
    terms (n the longest sum), and those magnitudes."""
    mags = _model(config, x, w, fc1, fc2, sizes, c, dy, magnitudes=True)
    k = 2.0 ** -23 * (max(config.hidden, 2 * config.intermediate, max(sizes)) + 8)
    return [k * mag + 1e-30 for mag in mags], mags


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cpu_bf16_backward_follows_the_formulas(name) -> None:
    config = _config(name)
    sizes = [5, 0, 7][: config.num_local_experts]
    x, w, fc1, fc2, gs, c, dy = _case(config, sizes)
    layer = Layer(layer_config(config, max_rows=x.shape[0] + 2, cuda_device=None, bf16_operands=True,
                               with_backward=True))
    got = _backward(layer, config, x, w, fc1, fc2, gs, c, dy)
    want = _model(config, x, w, fc1, fc2, sizes, c, dy)
    bounds, _ = _bounds(config, x, w, fc1, fc2, sizes, c, dy)
    for g, m, b, label in zip(got, want, bounds, ["dx", "dw", "dfc1", "dfc2"]):
        err = np.abs(g.astype(np.float64) - m)
        assert np.all(err <= b), f"{label}: off the bf16-operand formulas by {np.max(err - b):.3g} past the bound"
    rows_done = sum(sizes)
    assert not np.any(got[0][rows_done:]) and not np.any(got[1][rows_done:]), "rows of no expert: dx and dw zero"

    # The mode matters: the exact backward is further from these formulas than the bounds allow.
    exact = Layer(layer_config(_config(name, None), max_rows=x.shape[0], cuda_device=None, bf16_operands=True,
                               with_backward=True))
    ex = _backward(exact, config, x, w, fc1, fc2, gs, c, dy)
    far = [np.any(np.abs(e.astype(np.float64) - m) > b) for e, m, b in zip(ex, want, bounds)]
    assert far[0] and far[2] and far[3], "the exact backward must differ from the bf16-operand one (dx, dfc1, dfc2)"


def test_bf16_cotangent_is_its_own_rounding() -> None:
    config = _config("fc2")
    x, w, fc1, fc2, gs, c, dy = _case(config, [4, 3, 2], seed=2)
    layer = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True, with_backward=True))
    f32 = _backward(layer, config, x, w, fc1, fc2, gs, c, dy)
    b16 = _backward(layer, config, x, w, fc1, fc2, gs, c, dy, dy_bf16=True)
    for a, b, label in zip(f32, b16, ["dx", "dw", "dfc1", "dfc2"]):
        np.testing.assert_array_equal(a, b, err_msg=f"{label}: R_bf16(dY) of a float32 dY is its bf16 encoding")


@pytest.mark.parametrize("mode", [None, "bf16"])
def test_accumulate_adds_the_weight_gradients_to_what_the_buffers_hold(mode) -> None:
    config = _config("fc1-clamp", mode)
    x, w, fc1, fc2, gs, c, dy = _case(config, [3, 0, 4], seed=4)
    layer = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True, with_backward=True))
    plain = _backward(layer, config, x, w, fc1, fc2, gs, c, dy)
    rng = np.random.default_rng(9)
    init = [rng.standard_normal(fc1.shape).astype(np.float32), rng.standard_normal(fc2.shape).astype(np.float32)]
    acc = _backward(layer, config, x, w, fc1, fc2, gs, c, dy, init=init, accumulate=True)
    np.testing.assert_array_equal(acc[0], plain[0], err_msg="dx is written, not accumulated")
    np.testing.assert_array_equal(acc[1], plain[1], err_msg="dw is written, not accumulated")
    np.testing.assert_array_equal(acc[2], init[0] + plain[2], err_msg="dfc1 += the gradient")
    np.testing.assert_array_equal(acc[3], init[1] + plain[3], err_msg="dfc2 += the gradient")
    assert np.array_equal(acc[2][1], init[0][1]), "an expert with no rows keeps what it held"


def test_the_field_is_checked_and_old_callers_get_the_exact_backward() -> None:
    config = _config("fc1-clamp")
    cfg = layer_config(config, max_rows=8, cuda_device=None, bf16_operands=True, with_backward=True)
    assert cfg.backward_operand_format == Format.BF16
    cfg.backward_operand_format = int(Format.MXFP8)
    with pytest.raises(NativeArgumentError, match=r"backward_operand_format must be MOE_EP_FORMAT_NONE .*; got 2"):
        Layer(cfg)
    cfg = layer_config(config, max_rows=8, cuda_device=None, bf16_operands=True, with_backward=True)
    cfg.reserved1 = 3
    with pytest.raises(NativeArgumentError, match=r"reserved1 must be 0; got 3"):
        Layer(cfg)
    layer = Layer(layer_config(config, max_rows=0, cuda_device=None, bf16_operands=True, with_backward=True))
    with pytest.raises(NativeArgumentError, match=r"flags must be 0 or MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS"):
        call("moe_ep_layer_experts_backward_ex", layer._handle, None, 0, None, None, None, None, None, None, 0,
             None, None, None, None, None, 4)

    # A caller built against the ABI 7 header (its struct ends before the new field): the exact backward.
    x, w, fc1, fc2, gs, c, dy = _case(config, [3, 2, 2], seed=6)
    cfg = layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True, with_backward=True)
    cfg.struct_size = LayerConfig.backward_operand_format.offset
    old = Layer(cfg)
    exact = Layer(layer_config(_config("fc1-clamp", None), max_rows=x.shape[0], cuda_device=None, bf16_operands=True,
                               with_backward=True))
    for a, b in zip(_backward(old, config, x, w, fc1, fc2, gs, c, dy), _backward(exact, config, x, w, fc1, fc2, gs, c, dy)):
        np.testing.assert_array_equal(a, b, err_msg="fields past an old caller's struct_size read as 0 (exact)")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return has_cuda() and torch.cuda.is_available()


CUDA_CONFIGS = {
    **{n: CONFIGS[n] for n in ("fc1-clamp", "fc2")},
    "wide-fc1": dict(num_experts=3, hidden=512, intermediate=256, num_topk=2, num_ranks=1),
}


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device and a native build with CUDA")
@pytest.mark.parametrize("operands", ["bf16", "f32"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("dy_bf16", [False, True], ids=["dy_f32", "dy_bf16"])
@pytest.mark.parametrize("name", sorted(CUDA_CONFIGS))
def test_cuda_bf16_backward_follows_the_formulas(name, dy_bf16, accumulate, operands) -> None:
    """The CUDA layer in the bf16-operand mode against the formulas: bf16 operands on sm_90 with
    CUTLASS run on tensor cores (four bf16 grouped GEMMs and the fused SwiGLU pass), float32
    operands (and other devices) the float32 kernels; within the bounds of float32 summation
    order and of dc values near a bf16 tie."""
    import torch

    config = MoeEpConfig(**CUDA_CONFIGS[name], backward_operand_format="bf16")
    sizes = [130, 0, 257][: config.num_local_experts]
    x, w, fc1, fc2, gs, c, dy = _case(config, sizes, seed=3)
    if dy_bf16:
        dy = dy.astype(BF16).astype(np.float32)
    rows = x.shape[0]
    dev = torch.device("cuda", torch.cuda.current_device())
    b16 = operands == "bf16"
    layer = Layer(layer_config(config, max_rows=rows, cuda_device=dev.index, bf16_operands=b16, with_backward=True))
    if b16 and torch.cuda.get_device_capability(dev) == (9, 0):
        assert layer.info.tensor_cores, "an sm_90 device with the CUTLASS build must take the tensor-core path"
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    op = _bits if b16 else (lambda a: np.asarray(a, np.float32))  # noqa: E731
    xt, f1t, f2t, ct = t(op(x)), t(op(fc1)), t(op(fc2)), t(_bits(c))
    wt, gst = t(w), t(gs)
    dyt = t(np.ascontiguousarray(dy.astype(BF16)).view(np.uint16)) if dy_bf16 else t(dy)
    rng = np.random.default_rng(11)
    init = [rng.standard_normal(fc1.shape).astype(np.float32), rng.standard_normal(fc2.shape).astype(np.float32)]
    outs = [torch.full(s, float("nan"), device=dev) for s in [(rows, config.hidden), (rows,), fc1.shape, fc2.shape]]
    if accumulate:
        outs[2].copy_(t(init[0]))
        outs[3].copy_(t(init[1]))
    stream = torch.cuda.current_stream(dev).cuda_stream
    p = lambda a: a.data_ptr() if a.numel() else None  # noqa: E731
    layer.experts_backward(stream, rows, p(xt), p(wt), p(f1t), p(f2t), p(ct), p(dyt), p(gst), *[p(o) for o in outs],
                           dy_bf16=dy_bf16, accumulate=accumulate)
    torch.cuda.synchronize()
    got = [o.cpu().numpy().astype(np.float64) for o in outs]
    if accumulate:
        got[2] -= init[0]
        got[3] -= init[1]
    want = _model(config, x, w, fc1, fc2, sizes, c, dy)
    bounds, mags = _bounds(config, x, w, fc1, fc2, sizes, c, dy)
    for g, m, b, mag, label in zip(got, want, bounds, mags, ["dx", "dw", "dfc1", "dfc2"]):
        # The addition to init (accumulate) rounds once more; a dc or w*h value within float32
        # noise of a bf16 tie may round the other way than in the float64 model (rare: at most
        # one bf16 step of the terms, in a few elements).
        tight = b + 2.0 ** -23 * (np.abs(m) + (np.abs(init[0 if label == "dfc1" else 1]) if accumulate and
                                                 label.startswith("dfc") else 0.0))
        err = np.abs(g - m)
        assert np.all(np.isfinite(g)), f"{label} must be written everywhere"
        assert np.all(err <= tight + 2.0 ** -8 * mag), f"{label}: off the bf16-operand formulas beyond a bf16 step"
        assert np.mean(err > tight) <= 1e-3, f"{label}: more than 0.1% of the elements off float32 accumulation"
    assert not np.any(got[0][sum(sizes):]) and not np.any(got[1][sum(sizes):]), "rows of no expert: dx and dw zero"
    layer.close()
