"""The torch backend on zero rows (issue 17): a block-format quantize or
dequantize of a ``[0, n]`` tensor used to raise ``cannot reshape tensor of 0
elements into shape [0, -1]`` (every ``reshape`` with -1 in
``moe_ep_torch/formats.py``). That hit a rank with T = 0 and a block-scaled
``output_format``, and a rank receiving no route with a block-scaled
``combine_format``, ``intermediate_format`` or nvfp4 activation."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moe_ep_spec  # noqa: E402
from moe_ep_spec.formats import quantize  # noqa: E402

from moe_ep_conformance import Case, run_case  # noqa: E402
from moe_ep_torch import formats as TF  # noqa: E402


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape", [(0, 64), (0, 40), (0, 33), (2, 0, 64), (3, 0, 16)])
def test_block_formats_quantize_and_dequantize_zero_rows(fmt: str, shape: tuple) -> None:
    x = torch.zeros(shape)
    t = TF.quantize(x, fmt)
    spec = quantize(np.zeros(shape, np.float32), fmt, axis=len(shape) - 1)
    assert tuple(t.data.shape) == spec.data_codes().shape, (t.data.shape, spec.data_codes().shape)
    assert tuple(t.scale.shape) == spec.scale_codes().shape, (t.scale.shape, spec.scale_codes().shape)
    back = TF.dequantize(t)
    assert tuple(back.shape) == shape, f"dequantize of {shape} gave {tuple(back.shape)}"
    assert tuple(TF.round_trip(x, fmt).shape) == shape


#: ep2, rank 0 has no token and every route goes to rank 0's experts: rank 0
#: encodes a [0, H] output, rank 1 receives no route (empty combine /
#: intermediate round trips, an empty nvfp4 activation decode).
_EMPTY = dict(tokens="zero_rank", routing="one_rank")

CASES = [
    Case("forward", 2, 2, 8, output_format="nvfp4", combine_format="mxfp8", intermediate_format="nvfp4",
         input_format="nvfp4", weight_format="nvfp4", **_EMPTY),
    Case("forward", 2, 2, 8, output_format="mxfp8", combine_format="nvfp4", intermediate_format="mxfp8",
         input_format="mxfp8", weight_format="bf16", weights_in="fc2", clamp=True, **_EMPTY),
    Case("forward_stash", 2, 2, 8, output_format="nvfp4", combine_format="nvfp4", intermediate_format="nvfp4",
         input_format="nvfp4", weight_format="nvfp4", layout="static", **_EMPTY),
    Case("backward", 2, 2, 8, input_format="nvfp4", weight_format="mxfp8", intermediate_format="nvfp4",
         clamp=True, **_EMPTY),
    Case("dispatch", 2, 2, 8, input_format="nvfp4", **_EMPTY),
    Case("combine", 2, 2, 8, output_format="nvfp4", combine_format="mxfp8", **_EMPTY),
    Case("combine", 2, 2, 8, output_format="mxfp8", combine_format="nvfp4", layout="static", **_EMPTY),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.op}-{c.id}" for c in CASES])
def test_ranks_without_tokens_or_routes_in_block_formats(case: Case) -> None:
    result = run_case(moe_ep_spec.get_backend("torch"), case, timeout_s=120.0)
    assert result.outcome == "passed", result.describe()
