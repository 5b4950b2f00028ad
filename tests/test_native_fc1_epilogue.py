"""FC1's epilogue inside the block-scaled-weights GEMMs (``MOE_EP_FC1_EPILOGUE``).

On CUDA, ``moe_ep_layer_experts_forward_block_scaled`` on mxfp8 or nvfp4 weight codes
applies FC1's epilogue (the stash, the clamp, SwiGLU, the router weight, R_int and the
FC2 operand) to the GEMM's sums where they are computed: each block multiplies 64 gate
rows and their 64 up rows. Its stash and its expert outputs are, bit for bit, those of
the same forward with the epilogue as a pass over the GEMM's float32 output
(``MOE_EP_FC1_EPILOGUE=pass``): in every intermediate format, with the clamp, the router
weight in FC1 or FC2, NaN scale blocks in a gate row and in an up row, rows of no expert
and few or many rows an expert. A value of the switch that names nothing is an error with
the rule and the value, raised before any work.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("moe_ep_native")

from coded_weights_common import needs_cuda  # noqa: E402

from moe_ep_native._capi import Format  # noqa: E402
from moe_ep_native.layer import Layer, layer_config  # noqa: E402
from moe_ep_spec import MoeEpConfig, NativeArgumentError  # noqa: E402
from moe_ep_spec import formats as F  # noqa: E402
from moe_ep_spec.formats import BF16  # noqa: E402

ENV = "MOE_EP_FC1_EPILOGUE"
WEIGHT_FORMATS = {"mxfp8": int(Format.MXFP8), "nvfp4": int(Format.NVFP4)}
NAN_SCALE = {"mxfp8": 0xFF, "nvfp4": 0x7F}  # E8M0 NaN, E4M3 NaN


def _config(intermediate_format, **kw) -> MoeEpConfig:
    # hidden and intermediate multiples of 128: the block-scaled-weights GEMMs' shapes.
    return MoeEpConfig(num_experts=3, hidden=256, intermediate=128, num_topk=2, num_ranks=1,
                       intermediate_format=intermediate_format, **kw)


# name: (config, the expert outputs as bf16 rows)
CONFIGS = {
    "int_none": (_config(None), False),
    "int_bf16-clamp": (_config("bf16", gate_up_clamp=0.7), False),
    "int_mxfp8-weight_in_fc2": (_config("mxfp8", apply_topk_in_fc1=False), False),
    "int_nvfp4-bf16_rows": (_config("nvfp4", combine_format="nvfp4", output_format="nvfp4"), True),
}


def _weight(rng: np.random.Generator, fmt: str, e: int, k: int, n: int):
    """A weight of logical shape [e, k, n] stored transposed ([e, n, k], blocked along k):
    (codes uint8, scales uint8) as moe_ep_layer_experts_forward_block_scaled takes them."""
    stored = F.quantize((rng.standard_normal((e, n, k)) / np.sqrt(k)).astype(np.float32), fmt, axis=-1)
    codes = np.ascontiguousarray(stored.data).view(np.uint8).copy()
    scales = np.ascontiguousarray(stored.scale).view(np.uint8).copy()
    return codes, scales


def _forward(layer, fmt, x, w, fc1, fc2, gs, config, dev, bf16_out=False):
    """One forward on the device: (y [rows, H] bits (float32 or, with bf16_out, bf16), fc1_c
    [rows, 2I] bf16 bits, the inexact flag), every output buffer holding a marker before."""
    import torch

    rows = x.shape[0]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    xt, wt, gst = t(x.view(np.uint16)), t(w), t(gs)
    c1, s1, c2, s2 = t(fc1[0]), t(fc1[1]), t(fc2[0]), t(fc2[1])
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    y_dtype = torch.bfloat16 if bf16_out else torch.float32
    y = torch.full((rows, config.hidden), float("nan"), dtype=y_dtype, device=dev)
    c = torch.full((rows, 2 * config.intermediate), -1, dtype=torch.int16, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    p = lambda a: a.data_ptr()  # noqa: E731
    layer.experts_forward_block_scaled(stream, WEIGHT_FORMATS[fmt], rows, p(xt), p(wt), p(c1), p(s1), p(c2), p(s2),
                                       p(gst), p(y), p(c), p(flag))
    torch.cuda.synchronize(dev)
    y_bits = y.view(torch.int16 if y_dtype == torch.bfloat16 else torch.int32).cpu().numpy()
    return y_bits, c.cpu().numpy().view(np.uint16), int(flag.item())


@needs_cuda
@pytest.mark.parametrize("sizes", [[33, 0, 70], [300, 1, 200]], ids=["few_rows", "many_rows"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fmt", sorted(WEIGHT_FORMATS))
def test_cuda_fc1_epilogue_in_the_gemm_gives_the_pass_bits(fmt, name, sizes, monkeypatch) -> None:
    import torch

    config, bf16_out = CONFIGS[name]
    rng = np.random.default_rng(7)
    e, h, i = config.num_local_experts, config.hidden, config.intermediate
    rows = sum(sizes) + 5  # rows past the slabs belong to no expert
    x = rng.standard_normal((rows, h)).astype(np.float32).astype(BF16)
    w = rng.uniform(0.1, 1.0, rows).astype(np.float32)
    fc1, fc2 = _weight(rng, fmt, e, h, 2 * i), _weight(rng, fmt, e, i, h)
    # NaN scale blocks: expert 2's gate row 5 and up row I + 9 (stored rows of the [2I, H] weight).
    fc1[1][2, 5, 0] = NAN_SCALE[fmt]
    fc1[1][2, i + 9, 1] = NAN_SCALE[fmt]
    gs = np.asarray(sizes, np.int32)
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = Layer(layer_config(config, max_rows=rows, cuda_device=dev.index, bf16_operands=True, with_backward=False,
                               bf16_expert_out=bf16_out))
    try:
        if not layer.info.tensor_cores:
            pytest.skip("the block-scaled-weights GEMMs are the tensor-core path's (sm_90a)")
        monkeypatch.delenv(ENV, raising=False)
        fused = _forward(layer, fmt, x, w, fc1, fc2, gs, config, dev, bf16_out)
        monkeypatch.setenv(ENV, "pass")
        apart = _forward(layer, fmt, x, w, fc1, fc2, gs, config, dev, bf16_out)
        monkeypatch.setenv(ENV, "fused")
        named = _forward(layer, fmt, x, w, fc1, fc2, gs, config, dev, bf16_out)
    finally:
        layer.close()
    for what, got, want in (("y", fused[0], apart[0]), ("fc1_c", fused[1], apart[1]), ("y ('fused')", named[0],
                                                                                       apart[0])):
        diff = np.argwhere(got != want)
        assert not diff.size, (f"{what}: the epilogue in the GEMM differs from the pass at {diff[:5].tolist()} "
                               f"(bits {got[tuple(diff[0])]:#x} against {want[tuple(diff[0])]:#x})" if diff.size
                               else "")
    assert fused[2] == apart[2], "the inexact flag does not depend on where the epilogue runs"
    stash = fused[1].view(BF16).astype(np.float32)
    third = slice(sum(sizes[:2]), sum(sizes))
    assert np.all(np.isnan(stash[third, 5])) and np.all(np.isnan(stash[third, i + 9])), (
        "the NaN scale blocks make expert 2's gate column 5 and up column I + 9 NaN")
    assert not np.isnan(stash[: sizes[0]]).any(), "the NaN stays in expert 2's rows"
    assert np.all(fused[1][sum(sizes):] == 0), "the stash's rows of no expert are zero"


@needs_cuda
@pytest.mark.parametrize("value", ["both", "Fused", "0"])
def test_cuda_fc1_epilogue_switch_rejects_a_value_that_names_nothing(value, monkeypatch) -> None:
    import torch

    config = CONFIGS["int_bf16-clamp"][0]
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = Layer(layer_config(config, max_rows=4, cuda_device=dev.index, bf16_operands=True, with_backward=False))
    try:
        if not layer.info.tensor_cores:
            pytest.skip("the block-scaled-weights GEMMs are the tensor-core path's (sm_90a)")
        monkeypatch.setenv(ENV, value)
        rng = np.random.default_rng(1)
        x = rng.standard_normal((4, config.hidden)).astype(np.float32).astype(BF16)
        w = np.ones(4, np.float32)
        fc1 = _weight(rng, "mxfp8", 3, config.hidden, 2 * config.intermediate)
        fc2 = _weight(rng, "mxfp8", 3, config.intermediate, config.hidden)
        with pytest.raises(NativeArgumentError, match=rf"{ENV} must be unset, 'fused' or 'pass'; got '{value}'"):
            _forward(layer, "mxfp8", x, w, fc1, fc2, np.asarray([2, 1, 1], np.int32), config, dev)
    finally:
        layer.close()
