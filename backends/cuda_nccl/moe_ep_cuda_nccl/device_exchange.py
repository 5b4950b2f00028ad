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
row per route (``=slot``: the slot-order sum, bit for bit the static mode). The
peers' memory comes from a provider of :mod:`moe_ep_native.exchange`, set up
through ``torch.distributed``'s store on the first call of a process group and
chosen by ``MOE_EP_EXCHANGE_PEERS``: ``auto`` (default: NCCL symmetric memory,
the LSA pointers of one NVLink domain, when every rank has its own GPU; CUDA IPC
between the ranks' processes, which must share one host, when some share one,
or when NCCL's provider is unsupported on one host), ``nccl`` or ``ipc``. CPU
tensors: ``/dev/shm``. On CUDA a stage runs as five kernels chained with
programmatic dependent launch, or, with ``MOE_EP_CUDA_NCCL_EXCHANGE_MODE=low_latency``,
as one cooperative kernel (for few tokens; the same results, bit for bit). The NCCL provider's communicator serves only this setup
and lives as long as the layer. An mxfp8 ``combine_format``'s round trip of the
expert outputs, and an nvfp4 one's at one rank, is done by the forward's combine as
it reads each row (``MOE_EP_CUDA_NCCL_ROUND_TRIP=combine``, the default when
``hidden`` is a multiple of 128; ``experts``: by the experts stage), the same values
bit for bit. Across ranks nvfp4's rounded rows travel as bf16 instead (exact: half
the bytes of the float32 rows the combine would round).

One native layer per (configuration, device, operand dtype, token bytes, combine
order, exchange mode, round-trip place, group)
holds the exchange and runs the experts between the two stages. Its timeout is
``MOE_EP_CUDA_NCCL_TIMEOUT_S`` (default 300 s): a peer that does not arrive
makes every waiting rank's outputs NaN and :func:`moe_ep_cuda_nccl.api.check_errors`
raise ``TransportError`` (the layer is dropped; the next call makes a new one,
collectively).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_ep_native import _capi as C
from moe_ep_native import exchange as X
from moe_ep_native.layer import layer_config
from moe_ep_spec import errors as E
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.formats import MoeFormat
from moe_ep_torch import core
from moe_ep_torch import formats as TF
from moe_ep_torch.api import _check, _check_group

from . import static
from .exchange_layers import _GENERATION, _LAYERS, _LOCK, close
from .prims import (TIMEOUT_ENV, BlockScaledOperand, MainGrads, NativePrimitives, _record as _inexact_record,
                    coded_weights_forward, coded_weights_path, dequantize_bf16, operands, ptr, weight_grad_buffers,
                    where)

__all__ = ["EXCHANGE_ENV", "COMBINE_ENV", "MODE_ENV", "ROUND_TRIP_ENV", "enabled", "forward", "backward", "backward_and_metadata", "move", "close"]

#: ``device``: every ``host_sync=False`` call uses the device exchange (default ``nccl``: the static mode's NCCL
#: exchange), and so does every call of the world-level backend (:mod:`moe_ep_cuda_nccl.device_world`).
EXCHANGE_ENV = "MOE_EP_CUDA_NCCL_EXCHANGE"
#: ``rank`` (default): one combine row per (token, rank); ``slot``: one per route (the slot-order sum).
COMBINE_ENV = "MOE_EP_CUDA_NCCL_COMBINE"
#: Thread blocks of the exchange's copy kernels (0: the library's default).
SMS_ENV = "MOE_EP_CUDA_NCCL_EXCHANGE_SMS"
#: Where the peers' memory comes from: ``auto`` (default), ``nccl`` (NCCL symmetric memory) or ``ipc`` (CUDA IPC).
PEERS_ENV = "MOE_EP_EXCHANGE_PEERS"
#: Where a block-scaled ``combine_format``'s round trip of the expert outputs happens: ``combine`` (default: the
#: combine puts each row through it as it reads it, one pass over the rows fewer; needs ``hidden % 128 == 0``,
#: and for nvfp4 one rank, otherwise ``experts``) or ``experts`` (the experts stage rounds the rows, the combine
#: sums them). The same results, bit for bit.
ROUND_TRIP_ENV = "MOE_EP_CUDA_NCCL_ROUND_TRIP"
#: How a stage runs on CUDA: ``throughput`` (default: five kernels chained with programmatic dependent launch)
#: or ``low_latency`` (one cooperative kernel per stage, for few tokens); the same results, bit for bit.
MODE_ENV = "MOE_EP_CUDA_NCCL_EXCHANGE_MODE"



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


def _mode() -> int:
    value = os.environ.get(MODE_ENV, "throughput")
    if value not in X.MODES:
        raise E.ConfigError(
            f"{MODE_ENV} must be one of {', '.join(repr(m) for m in X.MODES)}; got {value!r}", field=MODE_ENV,
            value=value,
        )
    return X.MODES[value]


def _peers() -> str:
    value = os.environ.get(PEERS_ENV, "auto")
    if value not in X.PROVIDERS:
        raise E.ConfigError(
            f"{PEERS_ENV} must be one of {', '.join(repr(p) for p in X.PROVIDERS)}; got {value!r}",
            field=PEERS_ENV, value=value,
        )
    return value


def _combine_round_trip(config: MoeEpConfig, num_ranks: int) -> Optional[C.Format]:
    """The block format whose round trip the layer's combine applies to the expert outputs as
    it reads them (``MOE_EP_CUDA_NCCL_ROUND_TRIP``), or None: the layer is then made with
    ``combine_format`` none, its experts stage leaves the rows unrounded, and the forward's
    combine reads them as ``Y_F32_MXFP8_ROUND_TRIP`` / ``Y_F32_NVFP4_ROUND_TRIP``. mxfp8 at
    any number of ranks; nvfp4 at one rank only, where no row crosses ranks: across ranks its
    rows travel as bf16 (:func:`_bf16_rows`), half the bytes of the float32 rows the combine
    would read. Both need ``hidden % 128 == 0`` (whole blocks in a warp's columns)."""
    value = os.environ.get(ROUND_TRIP_ENV, "combine")
    if value not in ("combine", "experts"):
        raise E.ConfigError(f"{ROUND_TRIP_ENV} must be 'combine' or 'experts'; got {value!r}", field=ROUND_TRIP_ENV,
                            value=value)
    if value != "combine" or config.hidden % 128 != 0:
        return None
    if config.combine_format is MoeFormat.MXFP8:
        return C.Format.MXFP8
    if config.combine_format is MoeFormat.NVFP4 and num_ranks == 1:
        return C.Format.NVFP4
    return None


def _bf16_rows(config: MoeEpConfig, round_trip: Optional[C.Format]) -> bool:
    """Whether the expert-output rows travel as bf16: combine_format bf16, or nvfp4 rounded by
    the experts stage (round_trip None), whose round-tripped values are bf16 values too (E2M1 x
    E4M3: at most 6 significant bits, 2^-10 to 2688): exact, half the bytes of float32
    (MoeEpConfig keeps nvfp4's blocks whole in a row, as the layer requires then). mxfp8's are
    not always (scales below 2^-116)."""
    return config.combine_format is MoeFormat.BF16 or (config.combine_format is MoeFormat.NVFP4 and round_trip is None)


def _layer(config: MoeEpConfig, group: Any, device: torch.device, bf16: bool, token_bytes: int) -> X.ExchangeLayer:
    """The exchange layer of this call (made and connected on first use: collective)."""
    cuda_device = device.index if device.type == "cuda" else None
    order = _combine_order()
    peers = _peers()
    mode = _mode()
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    round_trip = _combine_round_trip(config, n)
    key = (config, cuda_device, bf16, token_bytes, order, mode, round_trip, group.group_name, id(group))
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
    base = layer_config(config, max_rows=int(config.recv_capacity), cuda_device=cuda_device, bf16_operands=bf16,
                        with_backward=True, bf16_expert_out=_bf16_rows(config, round_trip))
    if round_trip is not None:  # the combine rounds the rows (see _combine_round_trip)
        base.combine_format = int(C.Format.NONE)
    cfg = X.with_exchange(
        base, num_ranks=n, rank=rank, num_topk=config.num_topk, max_tokens=int(config.max_tokens_per_rank),
        token_bytes=token_bytes + 4 * config.hidden, expert_alignment=config.expert_alignment,
        timeout_s=float(os.environ.get(TIMEOUT_ENV, "300")), num_sms=int(os.environ.get(SMS_ENV, "0")),
        combine_order=order, mode=mode,
    )
    layer = X.ExchangeLayer(cfg)
    layer.combine_round_trip = round_trip  # what the forward's combine passes (the layer's key holds it)
    from torch.distributed.distributed_c10d import _get_default_store

    store = dist.PrefixStore(f"moe_ep_cuda_nccl_exchange/{group.group_name}/{gen}/", _get_default_store())
    try:
        X.connect(layer, store, "peers", provider=peers)  # layer.provider: closed after the layer by layer.close()
    except BaseException:
        layer.close()
        raise
    with _LOCK:
        _LAYERS[key] = (group, layer)
    return layer


def _bf16(activation: Any, fc1: Any, fc2: Any) -> bool:
    """Whether the layer's operands are bf16 (tensor cores): bf16 tensors and block-scaled
    inputs (decoded to bf16 without a host check: :func:`moe_ep_cuda_nccl.prims.operands`)."""
    return all(
        isinstance(t, TF.TorchBlockScaled) or (isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16)
        for t in (activation, fc1, fc2)
    )


def _dispatch(prims, config, group, activation, fc1, fc2, idx, weights, extra):
    """The layer's dispatch of the token rows (+ ``extra`` per-token rows), then the experts' operands.
    Returns ``(layer, x_buf, extra buffers, w_buf, meta, group_sizes, tokens_per_expert, error, fc1_d, fc2_d)``."""
    layer, x_buf, recv_extra, w_buf, meta, gs, tpe, err = move(
        config, group, activation, idx, weights, extra, _bf16(activation, fc1, fc2)
    )
    # The rows in the activation's encoding: bf16 rows and weights stay bf16 (tensor cores), the rest is decoded.
    x_buf, fc1_d, fc2_d = prims.forward_operands(activation, x_buf, prims.decode_weight(fc1), prims.decode_weight(fc2))
    return layer, x_buf, recv_extra, w_buf, meta, gs, tpe, err, fc1_d, fc2_d


def move(config: MoeEpConfig, group: Any, activation: Any, idx: torch.Tensor, weights: torch.Tensor, extra: List[Any],
         bf16: bool) -> Tuple[Any, ...]:
    """The layer's dispatch (collective) of the token rows (+ ``extra`` per-token rows):
    ``(layer, x_buf [C, ...] in the activation's encoding, extra buffers [C, ...], w_buf [C]
    float32, meta [C, 4] int32, group_sizes [E_local] int32, tokens_per_expert [E_local] int32,
    error [1] int32)``; padding rows zero. ``bf16``: the layer's operands (a key of the layer).

    A plain activation with no extra rows moves as it is: its rows are the
    dispatch's input and the received buffer is the experts' operand (no packing,
    no copy). Otherwise the parts are packed into one byte row per token. On one rank
    (no transport: the dispatch is a local gather) a block-scaled activation of a bf16
    layer with no extra rows moves as its bf16 decode: its T rows decoded once (the values
    the experts' operand decode gives each copy; an mxfp8 value bf16 cannot hold is NaN
    and lands in :func:`moe_ep_cuda_nccl.prims.inexact_decodes`, as there, here also for
    a token with no route), instead of packing its codes and scales and decoding the C
    received rows."""
    t = int(idx.shape[0])
    dev = idx.device
    cap, k = int(config.recv_capacity), config.num_topk
    if (bf16 and not extra and isinstance(activation, TF.TorchBlockScaled) and dev.type == "cuda"
            and dist.get_world_size(group) == 1):
        exact = BlockScaledOperand(activation, False).exact_in_bf16
        activation = dequantize_bf16(activation, None if exact else _inexact_record(dev))
    plain = isinstance(activation, torch.Tensor) and not extra
    if plain:
        blob = activation.contiguous()
        token_bytes = blob.element_size() * config.hidden
        rb = token_bytes
        x_rows = torch.empty((cap, config.hidden), dtype=blob.dtype, device=dev)
    else:
        # Every row of the activation, as its payload parts (no gather: all rows move).
        parts = list(TF.raw(activation)) if isinstance(activation, TF.TorchBlockScaled) else [activation]
        token_part_count = len(parts)
        token_bytes = sum(math.prod(p.shape[1:]) * p.element_size() for p in parts)
        blob, layout = core.pack_rows(parts + list(extra), t)
        rb = int(blob.shape[1])
        x_rows = torch.empty((cap, rb), dtype=torch.uint8, device=dev)
    layer = _layer(config, group, dev, bf16, token_bytes)
    idx32 = idx.to(torch.int32).contiguous()
    w32 = weights.float().reshape(t, k).contiguous()
    w_buf, meta, gs, tpe, err = dispatch_stage(layer, config, blob, rb, idx32, w32, x_rows)
    if plain:
        x_buf, recv_extra = x_rows, []
    else:
        recv = _received_parts(x_rows, layout)
        x_buf, recv_extra = core.rebuild(activation, recv[:token_part_count]), recv[token_part_count:]
    return layer, x_buf, recv_extra, w_buf, meta, gs, tpe, err


def dispatch_again(layer: X.ExchangeLayer, config: MoeEpConfig, idx: torch.Tensor, weights: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    """One more dispatch (collective) of ``layer``'s routing ``idx`` ``[T, K]``, ``weights``
    ``[T, K]``: the plain per-token ``rows`` (``[T, ...]``, at most the layer's token bytes
    a row) into a new ``[C, ...]`` buffer of their dtype, padding rows zero. The layer's
    state after it is the same as after the first (same routing, same plan)."""
    t, k = int(idx.shape[0]), config.num_topk
    rows = rows.contiguous()
    out = torch.empty((int(config.recv_capacity),) + tuple(rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    row_bytes = rows.element_size() * math.prod(rows.shape[1:])
    dispatch_stage(layer, config, rows, row_bytes, idx.to(torch.int32).contiguous(),
                   weights.float().reshape(t, k).contiguous(), out)
    return out


def dispatch_stage(layer: X.ExchangeLayer, config: MoeEpConfig, rows: torch.Tensor, row_bytes: int,
                   idx32: torch.Tensor, w32: torch.Tensor, x_rows: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``layer``'s dispatch stage (collective): ``rows`` (``[T, ...]``, ``row_bytes`` bytes a
    row) routed by ``idx32`` (``[T, K]`` int32) with the router weights ``w32`` (``[T, K]``
    float32) into ``x_rows`` (``[C, ...]``). Returns ``(w_buf [C] float32, meta [C, 4] int32,
    group_sizes [E_local] int32, tokens_per_expert [E_local] int32, error [1] int32)``."""
    dev = idx32.device
    cap, el = int(config.recv_capacity), config.num_local_experts  # type: ignore[arg-type]
    w_buf = torch.empty(cap, dtype=torch.float32, device=dev)
    meta = torch.empty((cap, 4), dtype=torch.int32, device=dev)
    gs = torch.empty(el, dtype=torch.int32, device=dev)
    tpe = torch.empty(el, dtype=torch.int32, device=dev)
    err = torch.empty(1, dtype=torch.int32, device=dev)
    _, stream = where(idx32)
    layer.dispatch(stream, int(idx32.shape[0]), row_bytes, ptr(rows), ptr(idx32), ptr(w32), ptr(x_rows), ptr(w_buf),
                   ptr(meta), ptr(gs), ptr(tpe), ptr(err))
    return w_buf, meta, gs, tpe, err


def _received_parts(rows: torch.Tensor, layout: List[Tuple[torch.dtype, Tuple[int, ...], int]]) -> List[torch.Tensor]:
    """The parts of the received byte rows ``[C, row_bytes] uint8``: a one-axis byte part
    (block-scaled codes and scales) as a strided view into ``rows`` (its consumers decode
    rows where they lie: :func:`moe_ep_cuda_nccl.prims.dequantize_bf16`); any other part as
    :func:`moe_ep_torch.core.unpack_rows` gives it (a dense copy in its dtype)."""
    out, col = [], 0
    for dtype, tail, width in layout:
        if dtype == torch.uint8 and len(tail) == 1:
            out.append(rows[:, col : col + width])
        else:
            out.append(core.unpack_rows(rows[:, col : col + width], [(dtype, tail, width)])[0])
        col += width
    return out


def _record(config: MoeEpConfig, group: Any, err: torch.Tensor, tpe: torch.Tensor) -> None:
    """One step into the group's static-mode flags (:func:`moe_ep_cuda_nccl.static.error_flags`):
    ``err`` ``[1] int32`` (a stage's error bits) OR-ed into ``flags[0]``, this rank's aligned
    rows (``tpe`` ``[E_local] int32``: routes per local expert) into the maximum ``flags[1]``:
    one native kernel (``moe_ep_record_step``), no host synchronisation."""
    flags = static.error_flags(group, err.device)
    tpe32 = tpe.to(torch.int32).contiguous()
    dev, stream = where(err)
    C.call("moe_ep_record_step", dev, stream, ptr(err), ptr(tpe32), int(tpe32.numel()), config.expert_alignment,
           ptr(flags))


def forward(
    prims: NativePrimitives, config: MoeEpConfig, group: Any, activation: Any, fc1: Any, fc2: Any, idx: torch.Tensor,
    weights: torch.Tensor, stash: bool = True,
) -> Dict[str, Any]:
    """The fused forward over the device exchange: ``{"output", "fc1_c", "route_metadata"}`` as
    :func:`moe_ep_cuda_nccl.static.forward` (``stash`` False: ``fc1_c`` None, not written).
    Three native stages (dispatch, experts, combine); on an error of any rank the layer
    itself makes the expert outputs and the stash NaN and the combine makes the output NaN
    (no host synchronisation)."""
    _check_group(config, group)
    static._require_static(config, dist.get_rank(group))
    _check(config, group, activation, fc1, fc2, idx, weights, group_moves_rows=False)
    layer, x_buf, _, w_buf, meta, gs, tpe, err, fc1_d, fc2_d = _dispatch(
        prims, config, group, activation, fc1, fc2, idx, weights, []
    )
    rows, h, i = int(x_buf.shape[0]), config.hidden, config.intermediate
    device = w_buf.device
    y_dtype = torch.bfloat16 if layer.bf16_expert_out else torch.float32
    y = torch.empty((rows, h), dtype=y_dtype, device=device)
    c = torch.empty((rows, 2 * i), dtype=torch.bfloat16, device=device) if stash else None
    _, stream = where(w_buf)
    # Block-scaled weights at few rows: their codes read by the tensor cores (prims.coded_weights_path).
    if not (coded_weights_path(config, x_buf, fc1_d, fc2_d, host_check=False)
            and coded_weights_forward(layer, config, x_buf, w_buf, fc1_d, fc2_d, gs, y, c, host_check=False)):
        bf16, x, f1, f2 = operands(x_buf, fc1_d, fc2_d, host_check=False)
        layer.experts_forward(stream, rows, ptr(x), ptr(w_buf), ptr(f1), ptr(f2), ptr(gs), ptr(y), ptr(c))
    # The layer zeroes the stash's padding rows itself (whatever the weights hold), and makes y
    # and the stash NaN when any rank's dispatch failed.
    t = int(idx.shape[0])
    # A bf16 output is encoded by the combine itself; other formats from its float32 sums.
    bf16_out = config.output_format is MoeFormat.BF16
    out = torch.empty((t, h), dtype=torch.bfloat16 if bf16_out else torch.float32, device=device)
    cerr = torch.empty(1, dtype=torch.int32, device=device)  # the dispatch's bits and a combine timeout
    layer.combine(stream, t, ptr(y), ptr(out), None, None, ptr(cerr), y_bf16=layer.bf16_expert_out,
                  out_bf16=bf16_out, y_round_trip=layer.combine_round_trip)  # NaN on any error
    _record(config, group, cerr, tpe)
    return {"output": out if bf16_out else prims.encode_output(config, out), "fc1_c": c, "route_metadata": meta}


def backward(
    prims: NativePrimitives, config: MoeEpConfig, group: Any, grad_output: torch.Tensor, activation: Any, fc1: Any,
    fc2: Any, idx: torch.Tensor, weights: torch.Tensor, fc1_c: torch.Tensor, main_grads: Optional[MainGrads] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec backward over the device exchange (a dispatch of the tokens with
    the output cotangent, the experts backward, a combine of the row cotangents
    with the router-weight cotangents as per-route values). With ``main_grads`` the
    weight gradients are added to those accumulators in the layer's GEMMs and the two
    weight results are the accumulators."""
    return backward_and_metadata(prims, config, group, grad_output, activation, fc1, fc2, idx, weights, fc1_c,
                                 main_grads)[0]


def backward_and_metadata(
    prims: NativePrimitives, config: MoeEpConfig, group: Any, grad_output: torch.Tensor, activation: Any, fc1: Any,
    fc2: Any, idx: torch.Tensor, weights: torch.Tensor, fc1_c: torch.Tensor, main_grads: Optional[MainGrads] = None,
) -> Tuple[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`backward`, and the ``[C, 4] int32`` route metadata of its dispatch (what
    the forward's stash holds for the same routing: a caller may compare them)."""
    _check_group(config, group)
    static._require_static(config, dist.get_rank(group))
    _check(config, group, activation, fc1, fc2, idx, weights, group_moves_rows=False)
    want = (config.recv_capacity, 2 * config.intermediate)
    if tuple(fc1_c.shape) != want:
        raise E.StashError(
            f"rank {dist.get_rank(group)}: fc1_c must have shape (recv_capacity, 2 * intermediate) = {want} "
            f"in the static mode; got {tuple(fc1_c.shape)}"
        )
    cot = core.cotangent(grad_output)  # bf16 or float32, dense
    if isinstance(activation, torch.Tensor):
        # Two dispatches of the same routing, the token rows then the cotangent rows: each
        # received buffer is a GEMM operand as it lies. (One dispatch of packed rows moves the
        # same bytes but leaves both parts interleaved in byte rows, two copies to take apart.)
        layer, x_buf, _, w_buf, meta, gs, tpe, err, fc1_d, fc2_d = _dispatch(
            prims, config, group, activation, fc1, fc2, idx, weights, []
        )
        dy_buf = dispatch_again(layer, config, idx, weights, cot)
    else:
        layer, x_buf, (dy_buf,), w_buf, meta, gs, tpe, err, fc1_d, fc2_d = _dispatch(
            prims, config, group, activation, fc1, fc2, idx, weights, [cot]
        )
    bf16, x, f1, f2 = operands(x_buf, fc1_d, fc2_d, host_check=False)
    rows, h = int(x.shape[0]), config.hidden
    dy = dy_buf  # [C, H] bf16 or float32, dense
    stash = fc1_c.to(torch.bfloat16).contiguous()
    dx = torch.empty((rows, h), dtype=torch.float32, device=x.device)
    dw = torch.empty((rows,), dtype=torch.float32, device=x.device)
    g = weight_grad_buffers(f1.shape, f2.shape, x.device, main_grads, bf16_layer=bf16)
    dfc1, dfc2 = g.fc1, g.fc2
    _, stream = where(x)
    # On an error of any rank the layer makes dx, dw, dfc1 and dfc2 NaN, the combine gx and gw.
    layer.experts_backward(stream, rows, ptr(x), ptr(w_buf), ptr(f1), ptr(f2), ptr(stash), ptr(dy), ptr(gs),
                           ptr(dx), ptr(dw), ptr(dfc1), ptr(dfc2), dy_bf16=dy.dtype == torch.bfloat16,
                           accumulate=g.accumulate, weight_grads_bf16=g.bf16)
    t, k = int(idx.shape[0]), config.num_topk
    gx = torch.empty((t, h), dtype=torch.float32, device=x.device)
    gw = torch.empty((t, k), dtype=torch.float32, device=x.device)
    cerr = torch.empty(1, dtype=torch.int32, device=x.device)
    layer.combine(stream, t, ptr(dx), ptr(gx), ptr(dw), ptr(gw), ptr(cerr), y_bf16=False)
    _record(config, group, cerr, tpe)
    return (gx, dfc1, dfc2, gw), meta
