"""``moe_ep_layer_experts_forward_block_scaled`` with nvfp4 expert weights read as they are
stored. On CPU it equals, bit for bit, ``moe_ep_layer_experts_forward`` on the weights' bf16
decode (every nvfp4 value is a bf16 value: the inexact flag never moves); its checks leave
the outputs untouched. On CUDA (the tensor cores read the codes: the nvfp4-weights GEMM) it
agrees with the bf16 path to float32 accumulation accuracy, with NaN exactly where a NaN
scale block reaches, over every scale the kernel treats apart (magnitudes below 2, 2 and
more, negative, zero, NaN) and the E2M1 subnormal; the cuda-nccl front-end takes it at few
rows."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("moe_ep_native")

from coded_weights_common import forward_decoded, needs_cuda, outputs, ptr  # noqa: E402

from moe_ep_native._capi import Format  # noqa: E402
from moe_ep_native.layer import Layer, layer_config  # noqa: E402
from moe_ep_spec import MoeEpConfig, NativeArgumentError, NativeError  # noqa: E402
from moe_ep_spec import formats as F  # noqa: E402
from moe_ep_spec.formats import BF16  # noqa: E402

NVFP4 = int(Format.NVFP4)

CONFIGS = {
    "fc1-clamp-int_bf16-comb_bf16": MoeEpConfig(num_experts=3, hidden=64, intermediate=32, num_topk=2, num_ranks=1,
                                                gate_up_clamp=0.7, intermediate_format="bf16", combine_format="bf16"),
    "fc2-int_nvfp4-comb_nvfp4": MoeEpConfig(num_experts=3, hidden=64, intermediate=48, num_topk=2, num_ranks=1,
                                            apply_topk_in_fc1=False, intermediate_format="nvfp4",
                                            combine_format="nvfp4", output_format="nvfp4"),
    "fc1-int_none-comb_mxfp8": MoeEpConfig(num_experts=2, hidden=32, intermediate=16, num_topk=1, num_ranks=1,
                                           combine_format="mxfp8", output_format="mxfp8"),
}



def _weight(rng, e, k, n):
    """An nvfp4 weight of logical shape [e, k, n] stored transposed ([e, n, k], blocked along
    k): (codes [e, n, k / 2] uint8, scales [e, n, k / 16] uint8)."""
    stored = F.quantize((rng.standard_normal((e, n, k)) / np.sqrt(k)).astype(np.float32), "nvfp4", axis=-1)
    codes = np.ascontiguousarray(stored.data).view(np.uint8).copy()
    scales = np.ascontiguousarray(stored.scale).view(np.uint8).copy()
    return codes, scales


def _decoded(codes, scales):
    """[e, n, k / 2] codes and [e, n, k / 16] scales -> [e, k, n] float32: the decode's values
    (the spec's: E2M1 x E4M3, NaN for a NaN scale; every one a bf16 value)."""
    import ml_dtypes

    e, n, half = codes.shape
    t = F.BlockScaledTensor(data=codes, scale=scales.view(ml_dtypes.float8_e4m3fn), format=F.MoeFormat.NVFP4,
                            shape=(e, n, 2 * half), axis=2)
    v = F.dequantize(t, np.float32)
    assert np.all((v.view(np.uint32)[~np.isnan(v)] & 0xFFFF) == 0), "nvfp4 values are bf16 values"
    return np.ascontiguousarray(v.transpose(0, 2, 1))


def _case(config, sizes, seed):
    rng = np.random.default_rng(seed)
    e, h, i = config.num_local_experts, config.hidden, config.intermediate
    rows = sum(sizes) + 3  # rows past the slabs belong to no expert
    x = rng.standard_normal((rows, h)).astype(np.float32).astype(BF16)
    x[sum(sizes):] = 0
    w = rng.uniform(0.1, 1.0, rows).astype(np.float32)
    return x, w, _weight(rng, e, h, 2 * i), _weight(rng, e, i, h), np.asarray(sizes, np.int32)



def _forward_nvfp4(layer, x, w, fc1, fc2, gs, config, flag=None):
    y, c = outputs(x.shape[0], config)
    layer.experts_forward_block_scaled(None, NVFP4, x.shape[0], ptr(x.view(np.uint16)), ptr(w), ptr(fc1[0]),
                                       ptr(fc1[1]), ptr(fc2[0]), ptr(fc2[1]), ptr(gs), ptr(y), ptr(c), ptr(flag))
    return y, c



def _plant_scales(fc, expert):
    """Every kind of scale the CUDA kernel treats apart, in `expert`'s weight rows (one row
    each, block 0, whose codes all become the E2M1 subnormal +-0.5 where set below):
    magnitude below 2 (0x30), 2 and more (0x48: 2.5, 0x7E: 448), negative (0xB0, 0xC8),
    zero (0x00), NaN (0x7F and 0xFF)."""
    codes, scales = (a.copy() for a in fc)
    for row, code in enumerate((0x30, 0x48, 0x7E, 0xB0, 0xC8, 0x00, 0x7F, 0xFF)):
        scales[expert, row, 0] = code
        codes[expert, row, :8] = 0x91  # element 2j: +0.5 (code 1), 2j + 1: -0.5 (code 9)
    return codes, scales


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cpu_nvfp4_weights_forward_is_the_forward_on_their_bf16_decode_bit_for_bit(name) -> None:
    config = CONFIGS[name]
    sizes = [5, 0, 9][: config.num_local_experts]
    x, w, fc1, fc2, gs = _case(config, sizes, seed=1)
    fc1 = _plant_scales(fc1, expert=config.num_local_experts - 1)
    layer = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True,
                               with_backward=False))
    flag = np.zeros(1, np.int32)
    y, c = _forward_nvfp4(layer, x, w, fc1, fc2, gs, config, flag)
    y_ref, c_ref = forward_decoded(layer, x, w, _decoded(*fc1), _decoded(*fc2), gs, config)
    np.testing.assert_array_equal(y, y_ref, err_msg="y: the nvfp4-weights forward vs the forward on the bf16 decode")
    nan = np.isnan(c_ref.view(BF16).astype(np.float32))
    np.testing.assert_array_equal(np.isnan(c.view(BF16).astype(np.float32)), nan, err_msg="fc1_c: NaN in the same places")
    np.testing.assert_array_equal(c[~nan], c_ref[~nan], err_msg="fc1_c: the nvfp4-weights forward vs the forward on "
                                                                "the decode (bits; NaN payloads aside)")
    assert flag[0] == 0, "every nvfp4 value is a bf16 value: the inexact flag stays 0"
    assert np.all(y[sum(sizes):] == 0), "rows of no expert are zero"
    last = slice(sum(sizes[:-1]), sum(sizes))
    stash = c.view(BF16).astype(np.float32)
    assert np.all(np.isnan(stash[last, 6])) and np.all(np.isnan(stash[last, 7])), (
        "the NaN-scale weight rows 6 and 7 of the last expert make FC1 columns 6 and 7 NaN for its rows")
    assert not np.any(np.isnan(stash[: sizes[0]])), "the NaN stays in that expert's rows"


def test_block_scaled_forward_checks_leave_the_outputs_untouched() -> None:
    config = CONFIGS["fc1-clamp-int_bf16-comb_bf16"]
    x, w, fc1, fc2, gs = _case(config, [3, 1, 2], seed=3)
    rows = x.shape[0]
    y, c = outputs(rows, config)
    args = lambda n: (n, ptr(x.view(np.uint16)), ptr(w), ptr(fc1[0]), ptr(fc1[1]), ptr(fc2[0]), ptr(fc2[1]),  # noqa: E731
                      ptr(gs), ptr(y), ptr(c), None)
    f32_layer = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=False, with_backward=False))
    with pytest.raises(NativeArgumentError, match="operand_dtype must be MOE_EP_DTYPE_BF16"):
        f32_layer.experts_forward_block_scaled(None, NVFP4, *args(rows))
    layer = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=True, with_backward=False))
    for bad in (int(Format.BF16), int(Format.NONE), 7):
        with pytest.raises(NativeArgumentError,
                           match=rf"weight_format must be MOE_EP_FORMAT_MXFP8 \(2\) or MOE_EP_FORMAT_NVFP4 \(3\); "
                                 rf"got {bad}"):
            layer.experts_forward_block_scaled(None, bad, *args(rows))
    with pytest.raises(NativeArgumentError, match="fc2_scales must not be NULL"):
        layer.experts_forward_block_scaled(None, NVFP4, rows, ptr(x.view(np.uint16)), ptr(w), ptr(fc1[0]), ptr(fc1[1]),
                                           ptr(fc2[0]), None, ptr(gs), ptr(y), ptr(c), None)
    with pytest.raises(NativeArgumentError, match="num_rows must be <= the layer's max_rows"):
        layer.experts_forward_block_scaled(None, NVFP4, *args(rows + 1))
    assert np.all(np.isnan(y)) and np.all(c == 0xFFFF), "a rejected call writes nothing"
    odd = MoeEpConfig(num_experts=2, hidden=40, intermediate=32, num_topk=1, num_ranks=1)
    odd_layer = Layer(layer_config(odd, max_rows=4, cuda_device=None, bf16_operands=True, with_backward=False))
    with pytest.raises(NativeArgumentError, match=r"multiples of 16 \(the nvfp4 block along K\)"):
        odd_layer.experts_forward_block_scaled(None, NVFP4, 0, None, None, None, None, None, None, None, None, None,
                                               None)
    sixteen = MoeEpConfig(num_experts=2, hidden=48, intermediate=16, num_topk=1, num_ranks=1)
    nv_layer = Layer(layer_config(sixteen, max_rows=4, cuda_device=None, bf16_operands=True, with_backward=False))
    with pytest.raises(NativeArgumentError, match=r"multiples of 32 \(the mxfp8 block along K\)"):
        nv_layer.experts_forward_block_scaled(None, int(Format.MXFP8), 0, None, None, None, None, None, None, None,
                                              None, None, None)


# ----------------------------------------------------------------------------- CUDA



CUDA_CONFIGS = {
    "fc1-int_bf16-comb_bf16": MoeEpConfig(num_experts=3, hidden=256, intermediate=128, num_topk=2, num_ranks=1,
                                          intermediate_format="bf16", combine_format="bf16"),
    # The exact FC2 operand (three bf16 planes in one pass at few rows, a launch a plane at
    # many) with the router weight in FC2 and an nvfp4 combine.
    "fc2-int_none-comb_nvfp4": MoeEpConfig(num_experts=3, hidden=128, intermediate=256, num_topk=2, num_ranks=1,
                                           apply_topk_in_fc1=False, combine_format="nvfp4", output_format="nvfp4"),
    "fc2-clamp-int_nvfp4-comb_bf16": MoeEpConfig(num_experts=3, hidden=128, intermediate=256, num_topk=2,
                                                 num_ranks=1, apply_topk_in_fc1=False, gate_up_clamp=0.7,
                                                 intermediate_format="nvfp4", combine_format="bf16"),
}


@needs_cuda
@pytest.mark.parametrize("sizes", [[33, 0, 70], [300, 1, 200]], ids=["few_rows", "many_rows"])
@pytest.mark.parametrize("name", sorted(CUDA_CONFIGS))
def test_cuda_nvfp4_weights_forward_agrees_with_the_bf16_decode_path(name, sizes) -> None:
    """The tensor cores on the codes against the CPU float32 kernels on the same decoded
    values: float32 accumulation in another order, so within float32 summation's bound;
    NaN in the same places (the planted NaN scales)."""
    import torch

    config = CUDA_CONFIGS[name]
    x, w, fc1, fc2, gs = _case(config, sizes, seed=4)
    fc1 = _plant_scales(fc1, expert=2)
    fc2 = _plant_scales(fc2, expert=0)
    rows = x.shape[0]
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = Layer(layer_config(config, max_rows=rows, cuda_device=dev.index, bf16_operands=True, with_backward=False))
    if torch.cuda.get_device_capability(dev) == (9, 0):
        assert layer.info.tensor_cores
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    xt, wt, gst = t(x.view(np.uint16)), t(w), t(gs)
    c1, s1, c2, s2 = t(fc1[0]), t(fc1[1]), t(fc2[0]), t(fc2[1])
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    y = torch.full((rows, config.hidden), float("nan"), device=dev)
    c = torch.zeros((rows, 2 * config.intermediate), dtype=torch.int16, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    p = lambda a: a.data_ptr()  # noqa: E731
    layer.experts_forward_block_scaled(stream, NVFP4, rows, p(xt), p(wt), p(c1), p(s1), p(c2), p(s2), p(gst), p(y),
                                       p(c), p(flag))
    torch.cuda.synchronize()
    assert int(flag.item()) == 0, "nvfp4 never sets the inexact flag"

    cpu = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=True, with_backward=False))
    y_ref, c_ref = _forward_nvfp4(cpu, x, w, fc1, fc2, gs, config)
    c_got = c.cpu().numpy().view(np.uint16).view(BF16).astype(np.float64)
    c_want = c_ref.view(BF16).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(c_got), np.isnan(c_want), err_msg="fc1_c: NaN in the same places")
    assert np.isnan(c_want).any(), "the planted NaN scales reach the stash"
    f1 = _decoded(*fc1)
    scale = np.abs(x.astype(np.float64)) @ np.nan_to_num(np.abs(f1.astype(np.float64))).max(axis=0) + 1e-30
    ok = np.isnan(c_want) | (np.abs(np.nan_to_num(c_got) - np.nan_to_num(c_want)) <= 2.0 ** -7 * scale)
    bad = np.argwhere(~ok)
    assert not bad.size, (f"fc1_c differs from the CPU stash by more than one bf16 step at {bad[:5].tolist()} "
                          f"(got {c_got[tuple(bad[0])]}, want {c_want[tuple(bad[0])]})" if bad.size else "")
    y_got = y.cpu().numpy()
    np.testing.assert_array_equal(np.isnan(y_got), np.isnan(y_ref), err_msg="y: NaN in the same places")
    assert np.all(y_got[sum(sizes):] == 0), "rows of no expert are zero"
    fin = ~np.isnan(y_ref)
    np.testing.assert_allclose(y_got[fin], y_ref[fin], rtol=0.02, atol=0.02, err_msg="y (after the combine round trip)")
    layer.close()


@needs_cuda
def test_cuda_nvfp4_weights_forward_needs_multiples_of_128() -> None:
    import torch

    config = CONFIGS["fc1-clamp-int_bf16-comb_bf16"]  # hidden 64
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = Layer(layer_config(config, max_rows=4, cuda_device=dev.index, bf16_operands=True, with_backward=False))
    with pytest.raises(NativeError, match="multiples of 128"):
        layer.experts_forward_block_scaled(torch.cuda.current_stream(dev).cuda_stream, NVFP4, 0, None, None, None,
                                           None, None, None, None, None, None, None)


@needs_cuda
def test_cuda_nccl_front_end_reads_nvfp4_weight_codes_at_few_rows(monkeypatch) -> None:
    """By default (and with MOE_EP_CUDA_NCCL_NVFP4_WEIGHTS=1), prims.expert_forward with nvfp4
    weights at few rows takes the block-scaled-weights forward (no kept decode is made) and
    agrees with the bf16-decode path (the switch at 0) to float32 accumulation accuracy; at
    many rows it takes the bf16 path."""
    import torch

    from moe_ep_cuda_nccl import prims
    from moe_ep_torch import formats as TF

    config = CUDA_CONFIGS["fc1-int_bf16-comb_bf16"]
    sizes = [20, 5, 31]
    x, w, fc1, fc2, gs = _case(config, sizes, seed=5)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    weight = lambda f, k: TF.TorchBlockScaled(  # noqa: E731
        data=t(f[0]), scale=t(f[1]).view(torch.float8_e4m3fn), format=F.MoeFormat.NVFP4, n=k)
    w1 = prims.BlockScaledOperand(weight(fc1, config.hidden), weight=True)
    w2 = prims.BlockScaledOperand(weight(fc2, config.intermediate), weight=True)
    xt = t(x.view(np.uint16)).view(torch.bfloat16)
    wt, gst = t(w), t(gs)
    prims.forget_decoded_weights()
    monkeypatch.delenv(prims.NVFP4_WEIGHTS_ENV, raising=False)
    assert prims.coded_weights_path(config, xt, w1, w2, host_check=True), "on by default at few rows, no verdict needed"
    many = torch.zeros((prims.CODED_WEIGHTS_MAX_ROWS_PER_EXPERT * config.num_local_experts + 1, config.hidden),
                       dtype=torch.bfloat16, device=dev)
    assert not prims.coded_weights_path(config, many, w1, w2, host_check=False), "many rows: the bf16 GEMMs"
    monkeypatch.setenv(prims.MXFP8_WEIGHTS_ENV, "0")
    assert prims.coded_weights_path(config, xt, w1, w2, host_check=False), "the mxfp8 switch leaves nvfp4 alone"
    y, c = prims.expert_forward(config, xt, wt, w1, w2, gst)
    assert not prims._DECODED, "the nvfp4-weights forward makes no kept bf16 decode"
    monkeypatch.setenv(prims.NVFP4_WEIGHTS_ENV, "0")
    assert not prims.coded_weights_path(config, xt, w1, w2, host_check=False)
    y_ref, c_ref = prims.expert_forward(config, xt, wt, w1, w2, gst)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4, msg="y: codes read directly vs the kept bf16 decode")
    diff = (c.float() - c_ref.float()).abs()
    assert torch.all(diff <= 2.0 ** -7 * c_ref.float().abs().clamp_min(1e-3)), "fc1_c within one bf16 step"
    prims.forget_decoded_weights()
