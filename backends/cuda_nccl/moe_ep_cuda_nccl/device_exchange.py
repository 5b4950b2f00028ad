"""The static-shape mode on the native layer's device exchange.

``moe_ep(..., host_sync=False, exchange="device")`` (or
``MOE_EP_CUDA_NCCL_EXCHANGE=device`` for every ``host_sync=False`` call) runs
the layer as the static mode of :mod:`moe_ep_cuda_nccl.static` does (no host
synchronisation, capturable in a CUDA graph, static layout only, the same
error record), but its dispatch and combine are the native layer's
``moe_ep_layer_dispatch`` / ``moe_ep_layer_combine``: the GPU stores every token
row once per destination rank into the peer's memory, the receiver places it
into the expert-major buffer locally, and the combine returns one float32 row
per (token, rank) (``MOE_EP_CUDA_NCCL_COMBINE=rank``, the default: the routes of
a token on one rank summed there in slot order, the home rank summing the ranks'
rows in rank order, an order the spec allows within the combine budget) or one
row per route (``=slot``: the slot-order sum, bit for bit the static mode). No
NCCL communicator is used: the peers' memory comes from the loopback provider of
:mod:`moe_ep_native.exchange` (CUDA IPC between the ranks' processes, which
must share one host; CPU tensors: ``/dev/shm``), set up through
``torch.distributed``'s store on the first call of a process group.

One native layer per (configuration, device, operand dtype, token bytes, group)
holds the exchange and runs the experts between the two stages. Its timeout is
``MOE_EP_CUDA_NCCL_TIMEOUT_S`` (default 300 s): a peer that does not arrive
makes every waiting rank's outputs NaN and :func:`moe_ep_cuda_nccl.api.check_errors`
raise ``TransportError`` (the layer is dropped; the next call makes a new one,
collectively).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from moe_ep_native import exchange as X
from moe_ep_native.layer import layer_config
from moe_ep_spec import errors as E
from moe_ep_spec.config import MoeEpConfig
from moe_ep_torch import core
from moe_ep_torch.api import _check, _check_group

from . import static
from .prims import TIMEOUT_ENV, NativePrimitives, _operands, ptr, where

__all__ = ["EXCHANGE_ENV", "COMBINE_ENV", "enabled", "forward", "backward", "close"]

#: ``device``: every ``host_sync=False`` call uses the device exchange (default ``nccl``: the static mode's NCCL exchange).
EXCHANGE_ENV = "MOE_EP_CUDA_NCCL_EXCHANGE"
#: ``rank`` (default): one combine row per (token, rank); ``slot``: one per route (the slot-order sum).
COMBINE_ENV = "MOE_EP_CUDA_NCCL_COMBINE"
#: Thread blocks of the exchange's copy kernels (0: the library's default).
SMS_ENV = "MOE_EP_CUDA_NCCL_EXCHANGE_SMS"

_LAYERS: Dict[Tuple[Any, ...], Tuple[Any, X.ExchangeLayer]] = {}
_GENERATION: Dict[str, int] = {}
_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether ``MOE_EP_CUDA_NCCL_EXCHANGE`` asks for the device exchange."""
    value = os.environ.get(EXCHANGE_ENV, "nccl")
    if value not in ("nccl", "device"):
        raise E.ConfigError(f"{EXCHANGE_ENV} must be 'nccl' or 'device'; got {value!r}", field=EXCHANGE_ENV, value=value)
    return value == "device"


def _combine_order() -> int:
    value = os.environ.get(COMBINE_ENV, "rank")
    if value not in ("rank", "slot"):
        raise E.ConfigError(f"{COMBINE_ENV} must be 'rank' or 'slot'; got {value!r}", field=COMBINE_ENV, value=value)
    return X.SLOT_ORDER if value == "slot" else X.RANK_SUMS


def close(group: Any = None) -> None:
    """Drop the exchange layers of ``group`` (all when None); local, not collective."""
    with _LOCK:
        keys = [k for k, (g, _) in _LAYERS.items() if group is None or g is group]
        layers = [_LAYERS.pop(k)[1] for k in keys]
    for layer in layers:
        if layer.cuda_device is not None:
            torch.cuda.synchronize(layer.cuda_device)
        layer.close()


def _layer(config: MoeEpConfig, group: Any, device: torch.device, bf16: bool, token_bytes: int) -> X.ExchangeLayer:
    """The exchange layer of this call (made and connected on first use: collective)."""
    cuda_device = device.index if device.type == "cuda" else None
    order = _combine_order()
    key = (config, cuda_device, bf16, token_bytes, order, group.group_name, id(group))
    with _LOCK:
        entry = _LAYERS.get(key)
        if entry is not None:
            return entry[1]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise E.MoeEpError(
                "cuda-nccl: the device exchange of this process group does not exist yet and cannot be made during "
                "CUDA-graph capture; run the layer (forward and backward, as captured) once before capturing it"
            )
        gen = _GENERATION.get(group.group_name, 0)
        _GENERATION[group.group_name] = gen + 1
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    base = layer_config(config, max_rows=int(config.recv_capacity), cuda_device=cuda_device, bf16_operands=bf16,
                        with_backward=True)
    cfg = X.with_exchange(
        base, num_ranks=n, rank=rank, num_topk=config.num_topk, max_tokens=int(config.max_tokens_per_rank),
        token_bytes=token_bytes + 4 * config.hidden, expert_alignment=config.expert_alignment,
        timeout_s=float(os.environ.get(TIMEOUT_ENV, "300")), num_sms=int(os.environ.get(SMS_ENV, "0")),
        combine_order=order,
    )
    layer = X.ExchangeLayer(cfg)
    from torch.distributed.distributed_c10d import _get_default_store

    store = dist.PrefixStore(f"moe_ep_cuda_nccl_exchange/{group.group_name}/{gen}/", _get_default_store())
    try:
        X.connect_loopback(layer, store, "peers")
    except BaseException:
        layer.close()
        raise
    with _LOCK:
        _LAYERS[key] = (group, layer)
    return layer


def _bf16(activation: Any, fc1: Any, fc2: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in (activation, fc1, fc2))


def _dispatch(prims, config, group, activation, fc1, fc2, idx, weights, extra):
    """Host checks, then the layer's dispatch of the token rows (+ ``extra`` per-token rows).
    Returns ``(layer, x_buf, extra buffers, w_buf, meta, group_sizes, tokens_per_expert, error, fc1_d, fc2_d)``."""
    t = int(idx.shape[0])
    dev = idx.device
    parts = core.gather_rows(activation, torch.arange(t, device=dev))
    token_part_count = len(parts)
    blob, layout = core.pack_rows(parts, t)
    token_bytes = int(blob.shape[1])
    blob, layout = core.pack_rows(parts + [e.float() for e in extra], t)
    layer = _layer(config, group, dev, _bf16(activation, fc1, fc2), token_bytes)
    cap, el, k = int(config.recv_capacity), config.num_local_experts, config.num_topk
    blob = blob.contiguous()
    rb = int(blob.shape[1])
    idx32 = idx.to(torch.int32).contiguous()
    w32 = weights.float().reshape(t, k).contiguous()
    x_rows = torch.empty((cap, rb), dtype=torch.uint8, device=dev)
    w_buf = torch.empty(cap, dtype=torch.float32, device=dev)
    meta = torch.empty((cap, 4), dtype=torch.int32, device=dev)
    gs = torch.empty(el, dtype=torch.int32, device=dev)
    tpe = torch.empty(el, dtype=torch.int32, device=dev)
    err = torch.empty(1, dtype=torch.int32, device=dev)
    _, stream = where(idx32)
    layer.dispatch(stream, t, rb, ptr(blob), ptr(idx32), ptr(w32), ptr(x_rows), ptr(w_buf), ptr(meta), ptr(gs),
                   ptr(tpe), ptr(err))
    recv = core.unpack_rows(x_rows, layout)
    x_buf = prims.decode(core.rebuild(activation, recv[:token_part_count]))
    x_buf, fc1_d, fc2_d = prims.forward_operands(activation, x_buf, prims.decode_weight(fc1), prims.decode_weight(fc2))
    return layer, x_buf, recv[token_part_count:], w_buf, meta, gs, tpe, err, fc1_d, fc2_d


def _record(config: MoeEpConfig, group: Any, err: torch.Tensor, tpe: torch.Tensor) -> None:
    flags = static.error_flags(group, err.device)
    flags[0:1].bitwise_or_(err.to(torch.int64).reshape(1))
    a = config.expert_alignment
    aligned = ((tpe.to(torch.int64) + (a - 1)) // a * a).sum().reshape(1)  # this rank's aligned rows
    torch.maximum(flags[1:2], aligned, out=flags[1:2])


def forward(
    prims: NativePrimitives, config: MoeEpConfig, group: Any, activation: Any, fc1: Any, fc2: Any, idx: torch.Tensor,
    weights: torch.Tensor,
) -> Dict[str, Any]:
    """The fused forward over the device exchange: ``{"output", "fc1_c", "route_metadata"}`` as
    :func:`moe_ep_cuda_nccl.static.forward`."""
    _check_group(config, group)
    static._require_static(config, dist.get_rank(group))
    _check(config, group, activation, fc1, fc2, idx, weights)
    layer, x_buf, _, w_buf, meta, gs, tpe, err, fc1_d, fc2_d = _dispatch(
        prims, config, group, activation, fc1, fc2, idx, weights, []
    )
    _, x, f1, f2 = _operands(x_buf, fc1_d, fc2_d)
    rows, h, i = int(x.shape[0]), config.hidden, config.intermediate
    w = w_buf.contiguous()
    y = torch.empty((rows, h), dtype=torch.float32, device=x.device)
    c = torch.empty((rows, 2 * i), dtype=torch.bfloat16, device=x.device)
    _, stream = where(x)
    layer.experts_forward(stream, rows, ptr(x), ptr(w), ptr(f1), ptr(f2), ptr(gs), ptr(y), ptr(c))
    c = c.masked_fill(meta[:, :1] < 0, 0.0)
    t = int(idx.shape[0])
    out = torch.empty((t, h), dtype=torch.float32, device=x.device)
    cerr = torch.empty(1, dtype=torch.int32, device=x.device)  # the dispatch's bits and a combine timeout
    layer.combine(stream, t, ptr(y), ptr(out), None, None, ptr(cerr))
    bad = cerr.reshape(()) != 0
    _record(config, group, cerr, tpe)
    return {
        "output": prims.encode_output(config, out.masked_fill(bad, float("nan"))),
        "fc1_c": c.float().masked_fill(bad, float("nan")).to(torch.bfloat16),
        "route_metadata": meta,
    }


def backward(
    prims: NativePrimitives, config: MoeEpConfig, group: Any, grad_output: torch.Tensor, activation: Any, fc1: Any,
    fc2: Any, idx: torch.Tensor, weights: torch.Tensor, fc1_c: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec backward over the device exchange (a dispatch of the tokens with
    the output cotangent, the experts backward, a combine of the row cotangents
    with the router-weight cotangents as per-route values)."""
    _check_group(config, group)
    static._require_static(config, dist.get_rank(group))
    _check(config, group, activation, fc1, fc2, idx, weights)
    want = (config.recv_capacity, 2 * config.intermediate)
    if tuple(fc1_c.shape) != want:
        raise E.StashError(
            f"rank {dist.get_rank(group)}: fc1_c must have shape (recv_capacity, 2 * intermediate) = {want} "
            f"in the static mode; got {tuple(fc1_c.shape)}"
        )
    layer, x_buf, (dy_buf,), w_buf, meta, gs, tpe, err, fc1_d, fc2_d = _dispatch(
        prims, config, group, activation, fc1, fc2, idx, weights, [grad_output]
    )
    _, x, f1, f2 = _operands(x_buf, fc1_d, fc2_d)
    rows, h = int(x.shape[0]), config.hidden
    w, dy = w_buf.contiguous(), dy_buf.float().contiguous()
    stash = fc1_c.to(torch.bfloat16).contiguous()
    dx = torch.empty((rows, h), dtype=torch.float32, device=x.device)
    dw = torch.empty((rows,), dtype=torch.float32, device=x.device)
    dfc1 = torch.empty(f1.shape, dtype=torch.float32, device=x.device)
    dfc2 = torch.empty(f2.shape, dtype=torch.float32, device=x.device)
    _, stream = where(x)
    layer.experts_backward(stream, rows, ptr(x), ptr(w), ptr(f1), ptr(f2), ptr(stash), ptr(dy), ptr(gs), ptr(dx),
                           ptr(dw), ptr(dfc1), ptr(dfc2))
    t, k = int(idx.shape[0]), config.num_topk
    gx = torch.empty((t, h), dtype=torch.float32, device=x.device)
    gw = torch.empty((t, k), dtype=torch.float32, device=x.device)
    cerr = torch.empty(1, dtype=torch.int32, device=x.device)
    layer.combine(stream, t, ptr(dx), ptr(gx), ptr(dw), ptr(gw), ptr(cerr))
    bad = cerr.reshape(()) != 0
    _record(config, group, cerr, tpe)
    return (
        gx.masked_fill(bad, float("nan")),
        dfc1.masked_fill(bad, float("nan")),
        dfc2.masked_fill(bad, float("nan")),
        gw.masked_fill(bad, float("nan")),
    )
