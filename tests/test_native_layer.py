"""The native layer object (``moe_ep_layer_*``): its stages against the float32
expert entry points they build on, its configuration versioning and its checks;
on a CUDA machine, the tensor-core path against the CPU implementation."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("moe_ep_native")

from moe_ep_native import host  # noqa: E402
from moe_ep_native._capi import LayerConfig, call, has_cuda  # noqa: E402
from moe_ep_native.layer import Layer, layer_config  # noqa: E402
from moe_ep_spec import MoeEpConfig, NativeArgumentError, NativeError  # noqa: E402
from moe_ep_spec import formats as F  # noqa: E402
from moe_ep_spec.formats import BF16  # noqa: E402


def _ptr(a):
    return a.ctypes.data if a is not None and a.size else None


def _case(config: MoeEpConfig, sizes, seed=0, rows=None):
    rng = np.random.default_rng(seed)
    e, h, i = config.num_local_experts, config.hidden, config.intermediate
    rows = sum(sizes) + 3 if rows is None else rows  # rows past the slabs belong to no expert
    bf = lambda a: a.astype(BF16)  # noqa: E731
    x = bf(rng.standard_normal((rows, h)).astype(np.float32))
    x[sum(sizes):] = 0
    w = rng.uniform(0.1, 1.0, rows).astype(np.float32)
    fc1 = bf((rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)).astype(np.float32))
    fc2 = bf((rng.standard_normal((e, i, h)) / np.sqrt(i)).astype(np.float32))
    gs = np.asarray(sizes, np.int32)
    dy = rng.standard_normal((rows, h)).astype(np.float32)
    return x, w, fc1, fc2, gs, dy


def _layer_forward(layer, x, w, fc1, fc2, gs, config):
    rows = x.shape[0]
    y = np.full((rows, config.hidden), np.nan, np.float32)
    c = np.full((rows, 2 * config.intermediate), 0xFFFF, np.uint16)
    bits = lambda a: np.ascontiguousarray(a).view(np.uint16) if a.dtype == BF16 else np.ascontiguousarray(a)  # noqa: E731
    xs, f1, f2 = bits(x), bits(fc1), bits(fc2)
    layer.experts_forward(None, rows, _ptr(xs), _ptr(w), _ptr(f1), _ptr(f2), _ptr(gs), _ptr(y), _ptr(c))
    return y, c


CONFIGS = {
    "fc1-clamp-int_none-comb_bf16": MoeEpConfig(num_experts=3, hidden=48, intermediate=24, num_topk=2, num_ranks=1,
                                                gate_up_clamp=0.7),
    "fc2-int_mxfp8-comb_mxfp8": MoeEpConfig(num_experts=3, hidden=64, intermediate=64, num_topk=2, num_ranks=1,
                                            apply_topk_in_fc1=False, intermediate_format="mxfp8",
                                            combine_format="mxfp8", output_format="mxfp8"),
    "fc1-int_nvfp4-comb_nvfp4": MoeEpConfig(num_experts=2, hidden=32, intermediate=16, num_topk=1, num_ranks=1,
                                            intermediate_format="nvfp4", combine_format="nvfp4",
                                            output_format="nvfp4"),
}
# The CUDA tests' configurations: CONFIGS and one wide enough that the forward's kNN GEMMs
# take the cooperative 1x2 kernel (n = 2I = 512 and n = H = 512: two 256-column tiles each),
# whose groups of 130 and 257 rows are 2 and 3 row tiles.
CUDA_CONFIGS = {
    **CONFIGS,
    "wide-fc1-comb_bf16": MoeEpConfig(num_experts=3, hidden=512, intermediate=256, num_topk=2, num_ranks=1),
}


@pytest.mark.parametrize("bf16_operands", [True, False], ids=["bf16_operands", "f32_operands"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cpu_layer_forward_and_backward_equal_the_expert_entry_points(name, bf16_operands) -> None:
    config = CONFIGS[name]
    sizes = [5, 0, 7][: config.num_local_experts]
    x, w, fc1, fc2, gs, dy = _case(config, sizes)
    if not bf16_operands:
        x, fc1, fc2 = (a.astype(np.float32) for a in (x, fc1, fc2))
    layer = Layer(layer_config(config, max_rows=x.shape[0] + 4, cuda_device=None, bf16_operands=bf16_operands,
                               with_backward=True))
    assert not layer.info.tensor_cores, "the CPU implementation has no tensor-core path"
    y, c = _layer_forward(layer, x, w, fc1, fc2, gs, config)

    want = host.expert_forward(config, x, w, fc1, fc2, gs)
    want_y = host.dequantize(host.quantize(want.y, config.combine_format))
    want_c = np.asarray(host.quantize(want.c, "bf16")).view(np.uint16)
    np.testing.assert_array_equal(y, want_y, err_msg="y must be the expert output after the combine round trip")
    np.testing.assert_array_equal(c, want_c, err_msg="fc1_c must be the bf16 rounding of the FC1 output")

    rows = x.shape[0]
    outs = [np.full(s, np.nan, np.float32) for s in
            [(rows, config.hidden), (rows,), fc1.shape, fc2.shape]]
    bits = lambda a: np.ascontiguousarray(a).view(np.uint16) if a.dtype == BF16 else np.ascontiguousarray(a)  # noqa: E731
    xs, f1, f2 = bits(x), bits(fc1), bits(fc2)
    layer.experts_backward(None, rows, _ptr(xs), _ptr(w), _ptr(f1), _ptr(f2), _ptr(c), _ptr(dy), _ptr(gs),
                           *[_ptr(o) for o in outs])
    grads = host.expert_backward(config, x, w, fc1, fc2, c.view(BF16), dy, gs)
    for got, ref, label in zip(outs, [grads.dx, grads.dw, grads.dfc1, grads.dfc2], ["dx", "dw", "dfc1", "dfc2"]):
        np.testing.assert_array_equal(got, ref, err_msg=f"{label} must equal moe_ep_expert_backward's")
    layer.close()
    assert layer.closed


def test_layer_with_zero_rows_gives_zero_weight_gradients() -> None:
    config = CONFIGS["fc1-clamp-int_none-comb_bf16"]
    x, w, fc1, fc2, gs, dy = _case(config, [0, 0, 0], rows=0)
    layer = Layer(layer_config(config, max_rows=0, cuda_device=None, bf16_operands=True, with_backward=True))
    y, c = _layer_forward(layer, x, w, fc1, fc2, gs, config)
    assert y.shape == (0, config.hidden) and c.shape == (0, 2 * config.intermediate)
    dfc1 = np.full(fc1.shape, np.nan, np.float32)
    dfc2 = np.full(fc2.shape, np.nan, np.float32)
    f1, f2 = fc1.view(np.uint16), fc2.view(np.uint16)
    layer.experts_backward(None, 0, None, None, _ptr(f1), _ptr(f2), None, None, _ptr(gs), None, None, _ptr(dfc1),
                           _ptr(dfc2))
    assert not np.any(dfc1) and not np.any(dfc2), "an expert with no rows has zero weight gradients"


def test_layer_rejects_more_rows_than_it_was_made_for_and_a_backward_it_was_not_made_for() -> None:
    config = CONFIGS["fc1-clamp-int_none-comb_bf16"]
    x, w, fc1, fc2, gs, dy = _case(config, [2, 2, 2])
    layer = Layer(layer_config(config, max_rows=4, cuda_device=None, bf16_operands=True, with_backward=False))
    with pytest.raises(NativeArgumentError, match=r"num_rows must be <= the layer's max_rows = 4"):
        _layer_forward(layer, x, w, fc1, fc2, gs, config)
    rows = 4
    with pytest.raises(NativeArgumentError, match="with_backward = 1"):
        layer.experts_backward(None, rows, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)


def test_layer_config_is_versioned_by_its_size() -> None:
    config = CONFIGS["fc1-clamp-int_none-comb_bf16"]
    cfg = layer_config(config, max_rows=8, cuda_device=None, bf16_operands=True, with_backward=False)
    handle = ctypes.c_void_p()
    cfg.struct_size = 2
    with pytest.raises(NativeArgumentError, match=r"struct_size must be sizeof\(moe_ep_layer_config\)"):
        call("moe_ep_layer_create", ctypes.byref(cfg), ctypes.byref(handle))

    # A caller built against a newer header: unknown fields must be zero (the defaults).
    class Newer(ctypes.Structure):
        _fields_ = LayerConfig._fields_ + [("future_field", ctypes.c_int64)]

    newer = Newer()
    ctypes.memmove(ctypes.byref(newer), ctypes.byref(cfg), ctypes.sizeof(LayerConfig))
    newer.struct_size = ctypes.sizeof(Newer)
    as_config = ctypes.cast(ctypes.pointer(newer), ctypes.POINTER(LayerConfig))
    call("moe_ep_layer_create", as_config, ctypes.byref(handle))
    call("moe_ep_layer_destroy", handle)
    newer.future_field = 1
    with pytest.raises(NativeError, match="older than the caller's header"):
        call("moe_ep_layer_create", as_config, ctypes.byref(handle))

    # An older caller: the fields past its size read as 0 (with_backward = 0 here).
    cfg.struct_size = LayerConfig.with_backward.offset
    call("moe_ep_layer_create", ctypes.byref(cfg), ctypes.byref(handle))
    call("moe_ep_layer_destroy", handle)


def test_layer_rejects_a_bad_configuration_with_the_rule() -> None:
    config = CONFIGS["fc1-clamp-int_none-comb_bf16"]
    cfg = layer_config(config, max_rows=8, cuda_device=None, bf16_operands=True, with_backward=False)
    cfg.combine_format = 7
    with pytest.raises(NativeArgumentError, match=r"combine_format must be a moe_ep_format .*; got 7"):
        Layer(cfg)
    cfg = layer_config(config, max_rows=8, cuda_device=None, bf16_operands=True, with_backward=False)
    cfg.operand_dtype = 5
    with pytest.raises(NativeArgumentError, match=r"operand_dtype must be .*; got 5"):
        Layer(cfg)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return has_cuda() and torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device and a native build with CUDA")
@pytest.mark.parametrize("name", sorted(CUDA_CONFIGS))
def test_cuda_tensor_core_layer_matches_the_cpu_float32_kernels(name) -> None:
    """On sm_90 with CUTLASS the bf16 layer runs on tensor cores; its results agree with the
    CPU float32 kernels to float32 accumulation accuracy (other summation order)."""
    import torch

    config = CUDA_CONFIGS[name]
    sizes = [130, 0, 257][: config.num_local_experts]
    x, w, fc1, fc2, gs, dy = _case(config, sizes, seed=3)
    rows = x.shape[0]
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = Layer(layer_config(config, max_rows=rows, cuda_device=dev.index, bf16_operands=True, with_backward=True))
    if torch.cuda.get_device_capability(dev) == (9, 0):
        assert layer.info.tensor_cores, "an sm_90 device with the CUTLASS build must take the tensor-core path"
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    xt, f1t, f2t = t(x.view(np.uint16)), t(fc1.view(np.uint16)), t(fc2.view(np.uint16))
    wt, gst, dyt = t(w), t(gs), t(dy)
    y = torch.full((rows, config.hidden), float("nan"), device=dev)
    c = torch.zeros((rows, 2 * config.intermediate), dtype=torch.int16, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    p = lambda a: a.data_ptr() if a.numel() else None  # noqa: E731
    layer.experts_forward(stream, rows, p(xt), p(wt), p(f1t), p(f2t), p(gst), p(y), p(c))
    outs = [torch.full(s, float("nan"), device=dev) for s in [(rows, config.hidden), (rows,), fc1.shape, fc2.shape]]
    layer.experts_backward(stream, rows, p(xt), p(wt), p(f1t), p(f2t), p(c), p(dyt), p(gst), *[p(o) for o in outs])
    torch.cuda.synchronize()

    cpu = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=True, with_backward=True))
    y_ref, c_ref = _layer_forward(cpu, x, w, fc1, fc2, gs, config)
    c_got = c.cpu().numpy().view(np.uint16)
    # The stash rounds the FC1 output: a different summation order may land on the other side of a bf16 tie.
    c_diff = np.abs(c_got.view(BF16).astype(np.float64) - c_ref.view(BF16).astype(np.float64))
    scale = np.abs(x.astype(np.float64)) @ np.abs(fc1.astype(np.float64)).max(axis=0) + 1e-30
    assert np.all(c_diff <= 2.0 ** -7 * scale), "fc1_c differs from the CPU stash by more than one bf16 step"
    y_got = y.cpu().numpy()
    assert np.all(np.isfinite(y_got)), "y must be written everywhere (padding rows zero)"
    assert np.all(y_got[sum(sizes):] == 0), "rows of no expert are zero"
    np.testing.assert_allclose(y_got, y_ref, rtol=0.02, atol=0.02, err_msg="y (after the combine round trip)")
    grads_ref = host.expert_backward(config, x, w, fc1, fc2, c_got.view(BF16), dy, gs)
    for got, ref, label in zip(outs, [grads_ref.dx, grads_ref.dw, grads_ref.dfc1, grads_ref.dfc2],
                               ["dx", "dw", "dfc1", "dfc2"]):
        got = got.cpu().numpy()
        mag = np.abs(ref).max() + 1e-30
        assert np.all(np.isfinite(got)), f"{label} must be written everywhere"
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * mag, err_msg=f"{label} vs the CPU float32 kernels")
    layer.close()


def test_a_bf16_cotangent_gives_what_its_float32_values_give() -> None:
    config = CONFIGS["fc1-clamp-int_none-comb_bf16"]
    x, w, fc1, fc2, gs, dy = _case(config, [4, 3, 0], seed=5)
    dy_bf16 = dy.astype(BF16)
    layer = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True, with_backward=True))
    _, c = _layer_forward(layer, x, w, fc1, fc2, gs, config)
    rows = x.shape[0]
    results = []
    for d, as_bf16 in ((dy_bf16.astype(np.float32), False), (np.ascontiguousarray(dy_bf16).view(np.uint16), True)):
        outs = [np.full(s, np.nan, np.float32) for s in [(rows, config.hidden), (rows,), fc1.shape, fc2.shape]]
        layer.experts_backward(None, rows, _ptr(x.view(np.uint16)), _ptr(w), _ptr(fc1.view(np.uint16)),
                               _ptr(fc2.view(np.uint16)), _ptr(c), _ptr(d), _ptr(gs), *[_ptr(o) for o in outs],
                               dy_bf16=as_bf16)
        results.append(outs)
    for got, want, label in zip(results[1], results[0], ["dx", "dw", "dfc1", "dfc2"]):
        np.testing.assert_array_equal(got, want, err_msg=f"{label}: a bf16 cotangent is its float32 values")


@pytest.mark.parametrize("name", ["fc1-clamp-int_none-comb_bf16", "fc1-int_nvfp4-comb_nvfp4"])
@pytest.mark.parametrize("weight_in_fc1", [True, False], ids=["weight_fc1", "weight_fc2"])
def test_bf16_expert_output_rows_are_the_bf16_encoding_of_the_float32_ones(name, weight_in_fc1) -> None:
    """expert_out_dtype bf16 (combine_format bf16 or nvfp4): the same numbers as the float32
    rows, which are bf16 values already, in half the bytes; rows of no expert zero."""
    config = CONFIGS[name].replace(apply_topk_in_fc1=weight_in_fc1)
    x, w, fc1, fc2, gs, dy = _case(config, [3, 0, 5], seed=4)
    rows = x.shape[0]
    f32 = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=True, with_backward=False))
    b16 = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=True, with_backward=False,
                             bf16_expert_out=True))
    assert b16.bf16_expert_out and not f32.bf16_expert_out
    y_ref, c_ref = _layer_forward(f32, x, w, fc1, fc2, gs, config)
    y = np.full((rows, config.hidden), 0xFFFF, np.uint16)
    c = np.full((rows, 2 * config.intermediate), 0xFFFF, np.uint16)
    xs, f1, f2 = x.view(np.uint16), fc1.view(np.uint16), fc2.view(np.uint16)
    b16.experts_forward(None, rows, _ptr(xs), _ptr(w), _ptr(f1), _ptr(f2), _ptr(gs), _ptr(y), _ptr(c))
    assert y_ref.astype(BF16).astype(np.float32).tobytes() == y_ref.tobytes(), "float32 rows are bf16 values"
    np.testing.assert_array_equal(y.view(BF16).astype(np.float32), y_ref, err_msg="bf16 rows vs float32 rows")
    np.testing.assert_array_equal(c, c_ref, err_msg="the stash does not depend on the rows' dtype")
    assert not np.any(y[sum(gs):]), "rows of no expert are zero"


def test_bf16_expert_output_rows_need_a_bf16_or_nvfp4_combine_format() -> None:
    config = CONFIGS["fc2-int_mxfp8-comb_mxfp8"]
    with pytest.raises(NativeArgumentError, match=r"combine_format must be MOE_EP_FORMAT_BF16 \(1\) or "
                                                  r"MOE_EP_FORMAT_NVFP4 \(3\) when config->expert_out_dtype is "
                                                  r"MOE_EP_DTYPE_BF16 .*; got 2"):
        Layer(layer_config(config, max_rows=8, cuda_device=None, bf16_operands=True, with_backward=False,
                           bf16_expert_out=True))
    # MoeEpConfig itself keeps nvfp4's blocks whole; the C ABI checks it again for direct callers
    nv = layer_config(CONFIGS["fc1-int_nvfp4-comb_nvfp4"], max_rows=8, cuda_device=None, bf16_operands=True,
                      with_backward=False, bf16_expert_out=True)
    nv.hidden = 40
    with pytest.raises(NativeArgumentError, match=r"config->hidden must be a multiple of 16 \(whole nvfp4 blocks in a "
                                                  r"row\) when .*; got 40"):
        Layer(nv)
    cfg = layer_config(CONFIGS["fc1-clamp-int_none-comb_bf16"], max_rows=8, cuda_device=None, bf16_operands=True,
                       with_backward=False)
    cfg.expert_out_dtype = 3
    with pytest.raises(NativeArgumentError, match=r"expert_out_dtype must be .*; got 3"):
        Layer(cfg)


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device and a native build with CUDA")
@pytest.mark.parametrize("name,weight_in_fc1", [("fc1-clamp-int_none-comb_bf16", True),
                                                ("fc1-clamp-int_none-comb_bf16", False),
                                                ("fc1-int_nvfp4-comb_nvfp4", True), ("fc1-int_nvfp4-comb_nvfp4", False),
                                                ("wide-fc1-comb_bf16", True)])
def test_cuda_bf16_expert_output_rows_equal_the_float32_rows(name, weight_in_fc1) -> None:
    import torch

    config = CUDA_CONFIGS[name].replace(apply_topk_in_fc1=weight_in_fc1)
    sizes = [130, 0, 257]
    x, w, fc1, fc2, gs, dy = _case(config, sizes, seed=5)
    rows = x.shape[0]
    dev = torch.device("cuda", torch.cuda.current_device())
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    xt, f1t, f2t, wt, gst = t(x.view(np.uint16)), t(fc1.view(np.uint16)), t(fc2.view(np.uint16)), t(w), t(gs)
    stream = torch.cuda.current_stream(dev).cuda_stream
    p = lambda a: a.data_ptr() if a.numel() else None  # noqa: E731
    outs = {}
    for bf16_out in (False, True):
        layer = Layer(layer_config(config, max_rows=rows, cuda_device=dev.index, bf16_operands=True,
                                   with_backward=False, bf16_expert_out=bf16_out))
        y = torch.full((rows, config.hidden), float("nan"), dtype=torch.bfloat16 if bf16_out else torch.float32,
                       device=dev)
        c = torch.zeros((rows, 2 * config.intermediate), dtype=torch.int16, device=dev)
        layer.experts_forward(stream, rows, p(xt), p(wt), p(f1t), p(f2t), p(gst), p(y), p(c))
        torch.cuda.synchronize()
        outs[bf16_out] = (y.float().cpu(), c.cpu())
        layer.close()
    assert torch.equal(outs[True][0], outs[False][0]), "bf16 rows must hold exactly the float32 rows' values"
    assert torch.equal(outs[True][1], outs[False][1]), "the stash does not depend on the rows' dtype"


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device and a native build with CUDA")
@pytest.mark.parametrize("y_rows", ["bf16", "f32_unrounded", "f32"])
def test_cuda_exchange_layer_experts_forward_equals_the_plain_layers(y_rows) -> None:
    """After a one-rank dispatch, the exchange layer's experts forward (its rows past the last
    slab zeroed by the kernel that finishes the stage, its offsets made by FC1's launch) gives
    the bits of a layer without an exchange on the same rows: y and the stash, every row past
    the slabs zero."""
    import torch

    from moe_ep_native.exchange import ExchangeLayer, with_exchange

    config = CUDA_CONFIGS["wide-fc1-comb_bf16"]  # 3 local experts, H 512, I 256, top-2
    t, k, e, h, align = 100, config.num_topk, config.num_local_experts, config.hidden, 8
    cap = t * k + e * align + 61  # rows past the slabs
    rng = np.random.default_rng(11)
    idx = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    idx[rng.random((t, k)) < 0.1] = -1
    tw = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    tok = (rng.standard_normal((t, h)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    fc1 = ((rng.standard_normal((e, h, 2 * config.intermediate)) / np.sqrt(h)).astype(np.float32)).astype(BF16)
    fc2 = ((rng.standard_normal((e, config.intermediate, h)) / np.sqrt(h)).astype(np.float32)).astype(BF16)
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(dev).cuda_stream
    put = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16) if a.dtype in (np.uint16, BF16)  # noqa: E731
                                     else np.ascontiguousarray(a)).to(dev)
    p = lambda a: a.data_ptr() if a.numel() else None  # noqa: E731
    base = layer_config(config, max_rows=cap, cuda_device=dev.index, bf16_operands=True, with_backward=False,
                        bf16_expert_out=y_rows == "bf16")
    if y_rows == "f32_unrounded":  # the rows as FC2 writes them (the combine's own round trip's layer)
        base.combine_format = 0
    ex = ExchangeLayer(with_exchange(base, num_ranks=1, rank=0, num_topk=k, max_tokens=t, token_bytes=2 * h,
                                     expert_alignment=align))
    plain = Layer(base)
    try:
        ex.set_peers([ex.exchange_info()[1]])
        x = torch.zeros((cap, h), dtype=torch.int16, device=dev)
        w_buf = torch.zeros(cap, dtype=torch.float32, device=dev)
        meta = torch.zeros((cap, 4), dtype=torch.int32, device=dev)
        gs, tpe, err = (torch.zeros(n, dtype=torch.int32, device=dev) for n in (e, e, 1))
        tok_d, idx_d, tw_d = put(tok), put(idx), put(tw)  # alive until the stream is done with them
        ex.dispatch(stream, t, 2 * h, p(tok_d), p(idx_d), p(tw_d), p(x), p(w_buf), p(meta), p(gs), p(tpe), p(err))
        f1, f2 = put(fc1), put(fc2)
        outs = {}
        for name, layer in (("exchange", ex), ("plain", plain)):
            y = torch.full((cap, h), float("nan"), device=dev,
                           dtype=torch.bfloat16 if y_rows == "bf16" else torch.float32)
            c = torch.full((cap, 2 * config.intermediate), -1, dtype=torch.int16, device=dev)
            layer.experts_forward(stream, cap, p(x), p(w_buf), p(f1), p(f2), p(gs), p(y), p(c))
            torch.cuda.synchronize(dev)
            outs[name] = (y.float().cpu().numpy(), c.cpu().numpy())
        used = int(gs.sum().item())
    finally:
        ex.close()
        plain.close()
    assert int(err.item()) == 0 and 0 < used < cap, (int(err.item()), used, cap)
    (y_ex, c_ex), (y_plain, c_plain) = outs["exchange"], outs["plain"]
    assert np.all(y_ex[used:] == 0), f"{y_rows}: rows past the slabs ({used} of {cap}) must be zero"
    assert np.all(np.isfinite(y_ex)), f"{y_rows}: every row of y must be written"
    np.testing.assert_array_equal(y_ex.view(np.uint32), y_plain.view(np.uint32), err_msg=f"{y_rows}: y")
    np.testing.assert_array_equal(c_ex, c_plain, err_msg=f"{y_rows}: the stash")


@pytest.mark.parametrize("on", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_available(), reason="needs a CUDA device and a native build with CUDA"))])
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_fc2_epilogue_round_trip_is_the_specs_bit_for_bit(on, fmt) -> None:
    """The tensor-core FC2 epilogue's combine round trip (mxfp8 through the hardware's E4M3
    converts) equals the spec's numpy round trip of the same layer's unrounded rows, bit for
    bit: the router weight in FC2 (the epilogue multiplies it in, then rounds) spans 2^-140
    to 2^100, so blocks land on every scale, subnormal ones included; a row of +inf and one
    of NaN weights give NaN blocks."""
    config = MoeEpConfig(num_experts=2, hidden=64, intermediate=32, num_topk=1, num_ranks=1, combine_format=fmt,
                         intermediate_format="bf16", apply_topk_in_fc1=False)
    sizes = [150, 170]
    x, w, fc1, fc2, gs, _ = _case(config, sizes, seed=9)
    rows = x.shape[0]
    rng = np.random.default_rng(10)
    w = (rng.uniform(1, 2, rows) * np.exp2(rng.integers(-140, 100, rows))).astype(np.float32)
    w[[0, 1, 2]] = [np.inf, np.nan, 2.0**-149]
    ys = {}
    for combine in (fmt, None):
        if on == "cpu":
            cfg = layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=True, with_backward=False)
            if combine is None:
                cfg.combine_format = 0  # MOE_EP_FORMAT_NONE: the unrounded w * z
            layer = Layer(cfg)
            with np.errstate(all="ignore"):
                ys[combine] = _layer_forward(layer, x, w, fc1, fc2, gs, config)[0]
            layer.close()
            continue
        import torch

        dev = torch.device("cuda", torch.cuda.current_device())
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        xt, f1t, f2t, wt, gst = t(x.view(np.uint16)), t(fc1.view(np.uint16)), t(fc2.view(np.uint16)), t(w), t(gs)
        stream = torch.cuda.current_stream(dev).cuda_stream
        p = lambda a: a.data_ptr() if a.numel() else None  # noqa: E731
        cfg = layer_config(config, max_rows=rows, cuda_device=dev.index, bf16_operands=True, with_backward=False)
        if combine is None:
            cfg.combine_format = 0  # MOE_EP_FORMAT_NONE: the unrounded w * z
        layer = Layer(cfg)
        if torch.cuda.get_device_capability(dev) == (9, 0):
            assert layer.info.tensor_cores, "sm_90 with the CUTLASS build: the tensor-core epilogue is the one tested"
        y = torch.full((rows, config.hidden), float("nan"), device=dev)
        c = torch.zeros((rows, 2 * config.intermediate), dtype=torch.int16, device=dev)
        layer.experts_forward(stream, rows, p(xt), p(wt), p(f1t), p(f2t), p(gst), p(y), p(c))
        torch.cuda.synchronize()
        ys[combine] = y.cpu().numpy()
        layer.close()
    raw = ys[None][: sum(sizes)]
    with np.errstate(all="ignore"):
        want = F.dequantize(F.quantize(raw, fmt, axis=-1), np.float32)
    got = ys[fmt][: sum(sizes)]
    assert np.isnan(got[:2]).all() and np.isnan(want[:2]).all(), "an inf or NaN weight makes its row's blocks NaN"
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.argwhere(~same)
    assert same.all(), f"{len(bad)} values differ from the spec's round trip; first at {bad[:3].tolist()}: " \
                       f"got {got[tuple(bad[0])] if len(bad) else None!r}, want {want[tuple(bad[0])] if len(bad) else None!r}"
    assert not np.any(ys[fmt][sum(sizes):]), "rows of no expert are zero"
