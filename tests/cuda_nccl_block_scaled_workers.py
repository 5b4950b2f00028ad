"""Rank functions for tests/test_cuda_nccl_block_scaled.py (spawned processes).

Each runs one forward of the cuda-nccl layer with block-scaled inputs in every
mode (host-synchronised, static, device exchange) and the float32 forward of
the same values (plain float32 inputs: the float32 kernels), and returns numpy
results for the test to compare.
"""

from __future__ import annotations

import os
from typing import Any, Dict

import numpy as np

#: A value mxfp8 encodes at scale code 0 as E4M3 3 * 2^-9, i.e. 3 * 2^-136: not a bf16 value.
TINY = 3 * 2.0**-136


def _bits(t) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def block_scaled_modes(rank: int, config, world_inputs, act_fmt: str, w_fmt: str, tiny: str, device: str) -> Dict[str, Any]:
    """``act_fmt`` / ``w_fmt``: "mxfp8", "nvfp4" or "bf16"; ``tiny``: "" (ordinary
    values), "act" (rank 0's token 0 gets values below 2^-126 off bf16's grid) or
    "fc1" (every rank's local expert 0 gets such values in FC1 column 0)."""
    import torch

    os.environ["MOE_EP_CUDA_NCCL_COMBINE"] = "slot"  # the device exchange bit for bit with the other modes
    from moe_ep_cuda_nccl import api, prims
    from moe_ep_spec.formats import MoeFormat

    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    w = world_inputs[rank]
    act = torch.from_numpy(np.asarray(w.activation, np.float32)).to(dev)
    fc1 = torch.from_numpy(np.asarray(w.fc1_weight, np.float32)).to(dev)  # [E_local, H, 2I]
    fc2 = torch.from_numpy(np.asarray(w.fc2_weight, np.float32)).to(dev)  # [E_local, I, H]
    idx = torch.from_numpy(w.topk_idx.astype(np.int64)).to(dev)
    tw = torch.from_numpy(np.asarray(w.topk_weights, np.float32)).to(dev)
    if tiny == "act" and rank == 0:
        act[0] = TINY * torch.arange(1, act.shape[1] + 1, device=dev).remainder(7).add(1)
    if tiny == "fc1":
        fc1[0, :, 0] = TINY

    def encode(t: torch.Tensor, fmt: str, weight: bool) -> Any:
        if fmt == "bf16":
            return t.to(torch.bfloat16)
        # a block-scaled weight is stored transposed, blocked along the reduction axis
        return prims.quantize(t.transpose(1, 2).contiguous() if weight else t, MoeFormat(fmt))

    a, w1, w2 = encode(act, act_fmt, False), encode(fc1, w_fmt, True), encode(fc2, w_fmt, True)

    def values(t: Any, weight: bool) -> torch.Tensor:
        if isinstance(t, torch.Tensor):
            return t.float()
        v = prims.dequantize(t)
        return v.transpose(1, 2).contiguous() if weight else v

    out: Dict[str, Any] = {}
    prims.inexact_decodes(dev, clear=True)
    out["f32"] = _bits(api.moe_ep(values(a, False), values(w1, True), values(w2, True), idx, tw, config=config))
    for mode, kwargs in (("synced", {}), ("static", {"host_sync": False}),
                         ("device", {"host_sync": False, "exchange": "device"})):
        out[mode] = _bits(api.moe_ep(a, w1, w2, idx, tw, config=config, **kwargs))
        out[f"{mode}_again"] = _bits(api.moe_ep(a, w1, w2, idx, tw, config=config, **kwargs))  # cached verdicts
        out[f"inexact_{mode}"] = prims.inexact_decodes(dev, clear=True)
    out["bf16_layer"] = any(key[2] for key in prims._LAYERS)  # the tensor-core operand dtype was chosen somewhere
    api.check_errors(config)
    api.close_communicators()
    return out


def explicit_training_step(rank: int, config, world_inputs, grad_outputs, fmt: str, device: str) -> Dict[str, Any]:
    """moe_ep_forward_with_stash then moe_ep_backward with ``fmt`` inputs (activation and
    both weights) in each mode (synced, static, device exchange), and the same calls with
    the decoded values as bf16 tensors (exact: these formats' values are bf16 values
    here), which take the same tensor-core operands."""
    import torch

    from moe_ep_cuda_nccl import api, prims
    from moe_ep_spec.formats import MoeFormat

    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    w = world_inputs[rank]
    f = MoeFormat(fmt)
    a = prims.quantize(torch.from_numpy(np.asarray(w.activation, np.float32)).to(dev), f)
    w1 = prims.quantize(torch.from_numpy(np.asarray(w.fc1_weight, np.float32)).to(dev).transpose(1, 2).contiguous(), f)
    w2 = prims.quantize(torch.from_numpy(np.asarray(w.fc2_weight, np.float32)).to(dev).transpose(1, 2).contiguous(), f)
    idx = torch.from_numpy(w.topk_idx.astype(np.int64)).to(dev)
    tw = torch.from_numpy(np.asarray(w.topk_weights, np.float32)).to(dev)
    gy = torch.from_numpy(grad_outputs[rank].astype(np.float32)).to(dev).to(torch.bfloat16)
    b16 = (prims.dequantize(a).to(torch.bfloat16), prims.dequantize(w1).transpose(1, 2).contiguous().to(torch.bfloat16),
           prims.dequantize(w2).transpose(1, 2).contiguous().to(torch.bfloat16))
    names = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")
    out: Dict[str, Any] = {}
    for mode, kwargs in (("synced", {}), ("static", {"host_sync": False}),
                         ("device", {"host_sync": False, "exchange": "device"})):
        for kind, (x, f1, f2) in (("block", (a, w1, w2)), ("bf16", b16)):
            fwd = api.moe_ep_forward_with_stash(x, f1, f2, idx, tw, config=config, **kwargs)
            grads = api.moe_ep_backward(gy, x, f1, f2, idx, tw, fwd.fc1_c, config=config, **kwargs)
            out[f"{mode}/{kind}/output"] = _bits(fwd.output)
            out[f"{mode}/{kind}/fc1_c"] = _bits(fwd.fc1_c)
            for n, g in zip(names, grads):
                out[f"{mode}/{kind}/{n}"] = _bits(g)
    api.check_errors(config)
    api.close_communicators()
    return out
