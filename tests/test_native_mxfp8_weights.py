"""``moe_ep_layer_experts_forward_mxfp8``: the layer's forward with mxfp8 expert weights
read as they are stored. On CPU it equals, bit for bit, ``moe_ep_layer_experts_forward``
on the weights' bf16 decode (NaN where bf16 cannot hold a value, with the inexact flag);
its checks leave the outputs untouched. On CUDA (the tensor cores read the codes) it
agrees with the bf16 path to float32 accumulation accuracy, and the cuda-nccl front-end
takes it at few rows."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("moe_ep_native")

from coded_weights_common import forward_decoded, needs_cuda, outputs, ptr  # noqa: E402

from moe_ep_native.layer import Layer, layer_config  # noqa: E402
from moe_ep_spec import MoeEpConfig, NativeArgumentError, NativeError  # noqa: E402
from moe_ep_spec import formats as F  # noqa: E402
from moe_ep_spec.formats import BF16  # noqa: E402

CONFIGS = {
    "fc1-clamp-int_bf16-comb_bf16": MoeEpConfig(num_experts=3, hidden=64, intermediate=32, num_topk=2, num_ranks=1,
                                                gate_up_clamp=0.7, intermediate_format="bf16", combine_format="bf16"),
    "fc2-int_mxfp8-comb_mxfp8": MoeEpConfig(num_experts=3, hidden=64, intermediate=64, num_topk=2, num_ranks=1,
                                            apply_topk_in_fc1=False, intermediate_format="mxfp8",
                                            combine_format="mxfp8", output_format="mxfp8"),
    "fc1-int_none-comb_nvfp4": MoeEpConfig(num_experts=2, hidden=32, intermediate=32, num_topk=1, num_ranks=1,
                                           combine_format="nvfp4", output_format="nvfp4"),
}



def _weight(rng, e, k, n):
    """An mxfp8 weight of logical shape [e, k, n] stored transposed ([e, n, k], blocked along
    k): (codes uint8, scales uint8, its decoded values [e, k, n] float32)."""
    stored = F.quantize((rng.standard_normal((e, n, k)) / np.sqrt(k)).astype(np.float32), "mxfp8", axis=-1)
    codes = np.ascontiguousarray(stored.data).view(np.uint8).copy()
    scales = np.ascontiguousarray(stored.scale).view(np.uint8).copy()
    return codes, scales


def _decode_bf16_values(codes, scales):
    """[e, n, k] codes and scales -> [e, k, n] float32: the bf16 decode's values (NaN where
    bf16 cannot hold one), and whether some value was not a bf16 value."""
    t = F.BlockScaledTensor(data=_e4m3(codes), scale=_e8m0(scales), format=F.MoeFormat.MXFP8, shape=codes.shape,
                            axis=2)
    v = F.dequantize(t, np.float32)
    bits = v.view(np.uint32)
    inexact = ((bits & 0xFFFF) != 0) & ~np.isnan(v)
    v = np.where(inexact, np.float32(np.nan), v)
    return np.ascontiguousarray(v.transpose(0, 2, 1)), bool(inexact.any())


def _e4m3(codes):
    import ml_dtypes

    return codes.view(ml_dtypes.float8_e4m3fn)


def _e8m0(scales):
    import ml_dtypes

    return scales.view(ml_dtypes.float8_e8m0fnu)


def _case(config, sizes, seed):
    rng = np.random.default_rng(seed)
    e, h, i = config.num_local_experts, config.hidden, config.intermediate
    rows = sum(sizes) + 3  # rows past the slabs belong to no expert
    x = rng.standard_normal((rows, h)).astype(np.float32).astype(BF16)
    x[sum(sizes):] = 0
    w = rng.uniform(0.1, 1.0, rows).astype(np.float32)
    c1, s1 = _weight(rng, e, h, 2 * i)
    c2, s2 = _weight(rng, e, i, h)
    return x, w, (c1, s1), (c2, s2), np.asarray(sizes, np.int32)



def _forward_mxfp8(layer, x, w, fc1, fc2, gs, config, flag):
    y, c = outputs(x.shape[0], config)
    layer.experts_forward_mxfp8(None, x.shape[0], ptr(x.view(np.uint16)), ptr(w), ptr(fc1[0]), ptr(fc1[1]), ptr(fc2[0]),
                                ptr(fc2[1]), ptr(gs), ptr(y), ptr(c), ptr(flag))
    return y, c



@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cpu_mxfp8_weights_forward_is_the_forward_on_their_bf16_decode_bit_for_bit(name) -> None:
    config = CONFIGS[name]
    sizes = [5, 0, 9][: config.num_local_experts]
    x, w, fc1, fc2, gs = _case(config, sizes, seed=1)
    layer = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True,
                               with_backward=False))
    flag = np.zeros(1, np.int32)
    y, c = _forward_mxfp8(layer, x, w, fc1, fc2, gs, config, flag)
    f1, bad1 = _decode_bf16_values(*fc1)
    f2, bad2 = _decode_bf16_values(*fc2)
    assert not (bad1 or bad2), "the random weights' scales are far from bf16's subnormal range"
    y_ref, c_ref = forward_decoded(layer, x, w, f1, f2, gs, config)
    np.testing.assert_array_equal(y, y_ref, err_msg="y: the mxfp8-weights forward vs the forward on the bf16 decode")
    np.testing.assert_array_equal(c, c_ref, err_msg="fc1_c: the mxfp8-weights forward vs the forward on the decode")
    assert flag[0] == 0, "no weight value is outside bf16: the inexact flag must stay 0"
    assert np.all(y[sum(sizes):] == 0), "rows of no expert are zero"


def _plant_inexact(fc1, expert, row):
    """Scale code 0 for block 0 of weight row `row` of `expert` (2^-127: most E4M3 values
    then fall off bf16's subnormal grid)."""
    codes, scales = fc1
    scales = scales.copy()
    scales[expert, row, 0] = 0
    codes = codes.copy()
    codes[expert, row, 0] = 0x01  # 2^-9 * 2^-127 = 2^-136: below bf16's smallest subnormal 2^-133
    return codes, scales


def test_cpu_mxfp8_weight_value_outside_bf16_is_nan_and_flagged() -> None:
    config = CONFIGS["fc1-clamp-int_bf16-comb_bf16"]
    sizes = [4, 6, 2]
    x, w, fc1, fc2, gs = _case(config, sizes, seed=2)
    fc1 = _plant_inexact(fc1, expert=1, row=3)
    layer = Layer(layer_config(config, max_rows=x.shape[0], cuda_device=None, bf16_operands=True,
                               with_backward=False))
    flag = np.zeros(1, np.int32)
    y, c = _forward_mxfp8(layer, x, w, fc1, fc2, gs, config, flag)
    assert flag[0] == 1, "a weight value bf16 cannot hold must set the inexact flag"
    f1, bad = _decode_bf16_values(*fc1)
    assert bad
    y_ref, c_ref = forward_decoded(layer, x, w, f1, _decode_bf16_values(*fc2)[0], gs, config)
    np.testing.assert_array_equal(y, y_ref, err_msg="y with a NaN-decoded weight value")
    np.testing.assert_array_equal(c, c_ref, err_msg="fc1_c with a NaN-decoded weight value")
    stash = c.view(BF16).astype(np.float32)
    expert1 = slice(sizes[0], sizes[0] + sizes[1])
    assert np.all(np.isnan(stash[expert1, 3])), "column 3 of FC1 is NaN for every row of expert 1"
    others = np.r_[0:sizes[0], sizes[0] + sizes[1]:sum(sizes)]
    assert not np.any(np.isnan(stash[others])), "the NaN stays in expert 1's rows"


def test_mxfp8_weights_forward_checks_leave_the_outputs_untouched() -> None:
    config = CONFIGS["fc1-clamp-int_bf16-comb_bf16"]
    x, w, fc1, fc2, gs = _case(config, [3, 1, 2], seed=3)
    rows = x.shape[0]
    f32_layer = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=False, with_backward=False))
    y, c = outputs(rows, config)
    with pytest.raises(NativeArgumentError, match="operand_dtype must be MOE_EP_DTYPE_BF16"):
        f32_layer.experts_forward_mxfp8(None, rows, ptr(x.view(np.uint16)), ptr(w), ptr(fc1[0]), ptr(fc1[1]), ptr(fc2[0]),
                                        ptr(fc2[1]), ptr(gs), ptr(y), ptr(c), None)
    layer = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=True, with_backward=False))
    with pytest.raises(NativeArgumentError, match="fc2_scales must not be NULL"):
        layer.experts_forward_mxfp8(None, rows, ptr(x.view(np.uint16)), ptr(w), ptr(fc1[0]), ptr(fc1[1]), ptr(fc2[0]),
                                    None, ptr(gs), ptr(y), ptr(c), None)
    with pytest.raises(NativeArgumentError, match="num_rows must be <= the layer's max_rows"):
        layer.experts_forward_mxfp8(None, rows + 1, ptr(x.view(np.uint16)), ptr(w), ptr(fc1[0]), ptr(fc1[1]),
                                    ptr(fc2[0]), ptr(fc2[1]), ptr(gs), ptr(y), ptr(c), None)
    assert np.all(np.isnan(y)) and np.all(c == 0xFFFF), "a rejected call writes nothing"
    odd = MoeEpConfig(num_experts=2, hidden=48, intermediate=32, num_topk=1, num_ranks=1)
    odd_layer = Layer(layer_config(odd, max_rows=4, cuda_device=None, bf16_operands=True, with_backward=False))
    with pytest.raises(NativeArgumentError, match="multiples of 32"):
        odd_layer.experts_forward_mxfp8(None, 0, None, None, None, None, None, None, None, None, None, None)


# ----------------------------------------------------------------------------- CUDA



CUDA_CONFIGS = {
    "fc1-int_bf16-comb_bf16": MoeEpConfig(num_experts=3, hidden=256, intermediate=128, num_topk=2, num_ranks=1,
                                          intermediate_format="bf16", combine_format="bf16"),
    # One FC2 plane (bf16 intermediate) with the router weight in FC2 and an mxfp8 combine:
    # the epilogue kernel's multiply and block round trip on the GEMM's float32 rows.
    "fc2-int_bf16-comb_mxfp8": MoeEpConfig(num_experts=3, hidden=256, intermediate=128, num_topk=2, num_ranks=1,
                                           apply_topk_in_fc1=False, intermediate_format="bf16",
                                           combine_format="mxfp8", output_format="mxfp8"),
    "fc2-clamp-int_mxfp8-comb_mxfp8": MoeEpConfig(num_experts=3, hidden=128, intermediate=256, num_topk=2,
                                                  num_ranks=1, apply_topk_in_fc1=False, gate_up_clamp=0.7,
                                                  intermediate_format="mxfp8", combine_format="mxfp8",
                                                  output_format="mxfp8"),
}


@needs_cuda
@pytest.mark.parametrize("plant", [False, True], ids=["exact", "inexact_value"])
@pytest.mark.parametrize("name", sorted(CUDA_CONFIGS))
def test_cuda_mxfp8_weights_forward_agrees_with_the_bf16_decode_path(name, plant) -> None:
    """The tensor cores on the codes against the CPU float32 kernels on the same decoded
    values: float32 accumulation in another order, so within float32 summation's bound;
    a weight value bf16 cannot hold: NaN in the same places and the flag set."""
    import torch

    config = CUDA_CONFIGS[name]
    sizes = [33, 0, 70]  # 33: one pass of 64 rows; 70: a pass of 64 and one of 6
    x, w, fc1, fc2, gs = _case(config, sizes, seed=4)
    if plant:
        fc1 = _plant_inexact(fc1, expert=2, row=5)
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
    layer.experts_forward_mxfp8(stream, rows, p(xt), p(wt), p(c1), p(s1), p(c2), p(s2), p(gst), p(y), p(c), p(flag))
    torch.cuda.synchronize()
    assert int(flag.item()) == int(plant), "the inexact flag is set exactly when a weight value is outside bf16"

    cpu = Layer(layer_config(config, max_rows=rows, cuda_device=None, bf16_operands=True, with_backward=False))
    ref_flag = np.zeros(1, np.int32)
    y_ref, c_ref = _forward_mxfp8(cpu, x, w, fc1, fc2, gs, config, ref_flag)
    assert ref_flag[0] == int(plant)
    c_got = c.cpu().numpy().view(np.uint16).view(BF16).astype(np.float64)
    c_want = c_ref.view(BF16).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(c_got), np.isnan(c_want), err_msg="fc1_c: NaN in the same places")
    f1, _ = _decode_bf16_values(*fc1)
    scale = np.abs(x.astype(np.float64)) @ np.nan_to_num(np.abs(f1.astype(np.float64))).max(axis=0) + 1e-30
    ok = np.isnan(c_want) | (np.abs(np.nan_to_num(c_got) - np.nan_to_num(c_want)) <= 2.0 ** -7 * scale)
    assert np.all(ok), "fc1_c differs from the CPU stash by more than one bf16 step"
    y_got = y.cpu().numpy()
    np.testing.assert_array_equal(np.isnan(y_got), np.isnan(y_ref), err_msg="y: NaN in the same places")
    assert np.all(y_got[sum(sizes):] == 0), "rows of no expert are zero"
    fin = ~np.isnan(y_ref)
    np.testing.assert_allclose(y_got[fin], y_ref[fin], rtol=0.02, atol=0.02, err_msg="y (after the combine round trip)")
    layer.close()


@needs_cuda
def test_cuda_mxfp8_weights_forward_needs_multiples_of_128() -> None:
    import torch

    config = CONFIGS["fc1-clamp-int_bf16-comb_bf16"]  # hidden 64
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = Layer(layer_config(config, max_rows=4, cuda_device=dev.index, bf16_operands=True, with_backward=False))
    with pytest.raises(NativeError, match="multiples of 128"):
        layer.experts_forward_mxfp8(torch.cuda.current_stream(dev).cuda_stream, 0, None, None, None, None, None, None,
                                    None, None, None, None)


@needs_cuda
def test_cuda_nccl_front_end_reads_mxfp8_weight_codes_at_few_rows(monkeypatch) -> None:
    """By default (and with MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS=1), prims.expert_forward with mxfp8
    weights at few rows takes the mxfp8-weights forward (no kept decode is made) and agrees
    with the bf16-decode path (the switch at 0) to float32 accumulation accuracy; at many
    rows it takes the bf16 path."""
    import torch

    from moe_ep_cuda_nccl import prims
    from moe_ep_torch import formats as TF

    config = CUDA_CONFIGS["fc1-int_bf16-comb_bf16"]
    sizes = [20, 5, 31]
    x, w, fc1, fc2, gs = _case(config, sizes, seed=5)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    weight = lambda f, k: TF.TorchBlockScaled(  # noqa: E731
        data=t(f[0]).view(torch.float8_e4m3fn), scale=t(f[1]).view(torch.float8_e8m0fnu), format=F.MoeFormat.MXFP8,
        n=k)
    w1 = prims.BlockScaledOperand(weight(fc1, config.hidden), weight=True)
    w2 = prims.BlockScaledOperand(weight(fc2, config.intermediate), weight=True)
    xt = t(x.view(np.uint16)).view(torch.bfloat16)
    wt, gst = t(w), t(gs)
    prims.forget_decoded_weights()
    monkeypatch.delenv(prims.MXFP8_WEIGHTS_ENV, raising=False)
    assert prims.coded_weights_path(config, xt, w1, w2, host_check=False), "on by default at few rows"
    monkeypatch.setenv(prims.MXFP8_WEIGHTS_ENV, "1")
    assert prims.coded_weights_path(config, xt, w1, w2, host_check=False)
    many = torch.zeros((prims.CODED_WEIGHTS_MAX_ROWS_PER_EXPERT * config.num_local_experts + 1, config.hidden),
                       dtype=torch.bfloat16, device=dev)
    assert not prims.coded_weights_path(config, many, w1, w2, host_check=False), "many rows: the bf16 GEMMs"
    y, c = prims.expert_forward(config, xt, wt, w1, w2, gst)
    assert not prims._DECODED, "the mxfp8-weights forward makes no kept bf16 decode"
    monkeypatch.setenv(prims.MXFP8_WEIGHTS_ENV, "0")
    assert not prims.coded_weights_path(config, xt, w1, w2, host_check=False)
    y_ref, c_ref = prims.expert_forward(config, xt, wt, w1, w2, gst)
    torch.cuda.synchronize()
    assert not prims.inexact_decodes(dev)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4, msg="y: codes read directly vs the kept bf16 decode")
    diff = (c.float() - c_ref.float()).abs()
    assert torch.all(diff <= 2.0 ** -7 * c_ref.float().abs().clamp_min(1e-3)), "fc1_c within one bf16 step"
    prims.forget_decoded_weights()
