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


def _backward(layer, config, x, w, fc1, fc2, gs, c, dy, *, dy_bf16=False, init=None, accumulate=False,
              weight_grads_bf16=False, rows=None):
    """dx, dw, dfc1, dfc2 as numpy arrays (dfc1 and dfc2 as uint16 bf16 bit patterns with
    weight_grads_bf16); rows: the rows passed (x's by default)."""
    rows = x.shape[0] if rows is None else rows
    shapes = [(rows, config.hidden), (rows,), fc1.shape, fc2.shape]
    outs = [np.full(s, np.nan, np.float32) for s in shapes]
    if weight_grads_bf16:  # NaN bits until written
        outs[2], outs[3] = np.full(fc1.shape, 0x7FC0, np.uint16), np.full(fc2.shape, 0x7FC0, np.uint16)
    if init is not None:
        outs[2][...] = init[0]
        outs[3][...] = init[1]
    d = np.ascontiguousarray(dy.astype(BF16)).view(np.uint16) if dy_bf16 else dy
    layer.experts_backward(None, rows, _ptr(_bits(x)), _ptr(w), _ptr(_bits(fc1)), _ptr(_bits(fc2)),
                           _ptr(_bits(c)), _ptr(d), _ptr(gs), *[_ptr(o) for o in outs], dy_bf16=dy_bf16,
                           accumulate=accumulate, weight_grads_bf16=weight_grads_bf16)
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
    with pytest.raises(NativeArgumentError, match=r"flags must be 0, MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS \(1\) or "
                                                  r"MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 \(2\); got 4"):
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


def _bf16_bits(a):
    """The float32 array rounded to bf16 (nearest even), as uint16 bit patterns: what a cast gives."""
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(BF16)).view(np.uint16)


@pytest.mark.parametrize("mode", [None, "bf16"])
@pytest.mark.parametrize("name", ["fc1-clamp", "fc2"])
def test_bf16_weight_grads_are_the_rounding_of_the_float32_ones(name, mode) -> None:
    """MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 on the CPU layer: dfc1 and dfc2 written as the bf16
    bits of the float32 gradients (an expert with no rows: zeros), dx and dw as without it;
    the layer's staged weights it computes in are staged again at the next call."""
    config = _config(name, mode)
    x, w, fc1, fc2, gs, c, dy = _case(config, [4, 0, 5][: config.num_local_experts], seed=12)
    layer = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True, with_backward=True))
    plain = _backward(layer, config, x, w, fc1, fc2, gs, c, dy)
    for dy_bf16 in (False, True):
        want = _backward(layer, config, x, w, fc1, fc2, gs, c, dy, dy_bf16=dy_bf16)
        got = _backward(layer, config, x, w, fc1, fc2, gs, c, dy, dy_bf16=dy_bf16, weight_grads_bf16=True)
        np.testing.assert_array_equal(got[0], want[0], err_msg="dx as without the flag")
        np.testing.assert_array_equal(got[1], want[1], err_msg="dw as without the flag")
        np.testing.assert_array_equal(got[2], _bf16_bits(want[2]), err_msg="dfc1: the bf16 rounding of the float32 one")
        np.testing.assert_array_equal(got[3], _bf16_bits(want[3]), err_msg="dfc2: the bf16 rounding of the float32 one")
        assert not np.any(got[2][1]) and not np.any(got[3][1]), "an expert with no rows: bf16 zeros"
    again = _backward(layer, config, x, w, fc1, fc2, gs, c, dy)
    for a, b, label in zip(again, plain, ["dx", "dw", "dfc1", "dfc2"]):
        np.testing.assert_array_equal(a, b, err_msg=f"{label}: a later call stages the weights again")
    none = _backward(layer, config, x, w, fc1, fc2, np.zeros_like(gs), c, dy, weight_grads_bf16=True, rows=0)
    assert not np.any(none[2]) and not np.any(none[3]), "no rows: every weight gradient bf16 zero"


def test_bf16_weight_grads_are_refused_with_accumulate_and_float32_weights() -> None:
    config = _config("fc1-clamp", None)
    x, w, fc1, fc2, gs, c, dy = _case(config, [3, 2, 2], seed=13)
    layer = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True, with_backward=True))
    with pytest.raises(NativeArgumentError, match=r"MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 \(2\) cannot be combined with "
                                                  r"MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS \(1\).*; got 3"):
        _backward(layer, config, x, w, fc1, fc2, gs, c, dy, accumulate=True, weight_grads_bf16=True)
    f32 = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=False, with_backward=True))
    with pytest.raises(NativeArgumentError, match=r"MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 needs a layer of operand_dtype "
                                                  r"MOE_EP_DTYPE_BF16 \(1\).*; got 0"):
        rows = x.shape[0]
        f32.experts_backward(None, rows, _ptr(np.asarray(x, np.float32)), _ptr(w), _ptr(np.asarray(fc1, np.float32)),
                             _ptr(np.asarray(fc2, np.float32)), _ptr(_bits(c)), _ptr(dy), _ptr(gs),
                             _ptr(np.zeros((rows, config.hidden), np.float32)), _ptr(np.zeros(rows, np.float32)),
                             _ptr(np.zeros(fc1.shape, np.uint16)), _ptr(np.zeros(fc2.shape, np.uint16)),
                             weight_grads_bf16=True)


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


WEIGHT_GRAD_CONFIGS = {
    **CUDA_CONFIGS,
    # 390 rows, hidden 160: the exact backward sums two experts at a time, then the third.
    "groups-of-2": dict(num_experts=3, hidden=160, intermediate=64, num_topk=2, num_ranks=1),
    # intermediate 20: rows of 20 elements, not a multiple of 8: no tensor cores.
    "staged": dict(num_experts=3, hidden=48, intermediate=20, num_topk=2, num_ranks=1, gate_up_clamp=0.7),
}


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device and a native build with CUDA")
@pytest.mark.parametrize("dy_bf16", [False, True], ids=["dy_f32", "dy_bf16"])
@pytest.mark.parametrize("mode", [None, "bf16"], ids=["exact", "bf16"])
@pytest.mark.parametrize("name", sorted(WEIGHT_GRAD_CONFIGS))
def test_cuda_bf16_weight_grads_are_the_rounding_of_the_float32_ones(name, mode, dy_bf16) -> None:
    """MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 on the CUDA layer: dfc1 and dfc2 bit for bit the bf16
    rounding (nearest even) of the float32 gradients the same layer writes without the flag,
    dx and dw unchanged. On tensor cores the bf16 mode's weight-gradient GEMMs round in their
    epilogue (the same CUTLASS kernel as the float32 one, the same summation order, one
    rounding of the float32 accumulator); the exact mode sums its bf16 planes rows / hidden
    experts at a time in a float32 buffer ("wide-fc1": rows < hidden, one expert at a time in
    a buffer of its own; the others reuse the forward's FC1 output: all experts at once, or
    "groups-of-2") and rounds each sum once; "staged" (no tensor cores) runs the float32
    kernels into the layer's staged weights and rounds those. An expert with no rows: bf16
    zeros."""
    import torch

    config = MoeEpConfig(**WEIGHT_GRAD_CONFIGS[name], backward_operand_format=mode)
    sizes = [130, 0, 257][: config.num_local_experts]
    x, w, fc1, fc2, gs, c, dy = _case(config, sizes, seed=5)
    rows = x.shape[0]
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = Layer(layer_config(config, max_rows=rows, cuda_device=dev.index, bf16_operands=True, with_backward=True))
    if name == "staged":
        assert not layer.info.tensor_cores, "row lengths not multiples of 8 take the float32 kernels"
    elif torch.cuda.get_device_capability(dev) == (9, 0):
        assert layer.info.tensor_cores, "an sm_90 device with the CUTLASS build must take the tensor-core path"
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    xt, f1t, f2t, ct, wt, gst = t(_bits(x)), t(_bits(fc1)), t(_bits(fc2)), t(_bits(c)), t(w), t(gs)
    dyt = t(np.ascontiguousarray(dy.astype(BF16)).view(np.uint16)) if dy_bf16 else t(dy)
    stream = torch.cuda.current_stream(dev).cuda_stream
    p = lambda a: a.data_ptr() if a.numel() else None  # noqa: E731

    def run(bf16_grads, num_rows=rows, group_sizes=gst):
        g = torch.bfloat16 if bf16_grads else torch.float32
        outs = [torch.full((num_rows, config.hidden), float("nan"), device=dev),
                torch.full((num_rows,), float("nan"), device=dev),
                torch.full(fc1.shape, float("nan"), device=dev, dtype=g),
                torch.full(fc2.shape, float("nan"), device=dev, dtype=g)]
        layer.experts_backward(stream, num_rows, p(xt), p(wt), p(f1t), p(f2t), p(ct), p(dyt), p(group_sizes),
                               *[p(o) for o in outs], dy_bf16=dy_bf16, weight_grads_bf16=bf16_grads)
        torch.cuda.synchronize()
        return outs

    want, got = run(False), run(True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "dx and dw as without the flag"
    for g, f, label in zip(got[2:], want[2:], ["dfc1", "dfc2"]):
        assert g.dtype == torch.bfloat16
        assert torch.equal(g.view(torch.int16), f.to(torch.bfloat16).view(torch.int16)), (
            f"{label}: the bf16 rounding of the float32 gradient, bit for bit "
            f"({int((g.view(torch.int16) != f.to(torch.bfloat16).view(torch.int16)).sum())} elements differ)")
        assert not torch.any(g[1].float()), f"{label}: an expert with no rows gets bf16 zeros"
    none = run(True, num_rows=0, group_sizes=torch.zeros_like(gst))
    assert not torch.any(none[2].float()) and not torch.any(none[3].float()), "no rows: bf16 zeros everywhere"
    if layer.info.tensor_cores:
        misaligned = torch.zeros(fc1.size + 8, dtype=torch.bfloat16, device=dev)[1:1 + fc1.size]
        with pytest.raises(NativeArgumentError, match=r"dfc1 must be 16-byte aligned on the tensor-core path"):
            layer.experts_backward(stream, rows, p(xt), p(wt), p(f1t), p(f2t), p(ct), p(dyt), p(gst),
                                   p(want[0]), p(want[1]), p(misaligned), p(got[3]), dy_bf16=dy_bf16,
                                   weight_grads_bf16=True)
    layer.close()
