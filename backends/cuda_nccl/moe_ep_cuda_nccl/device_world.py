"""The world-level backend (the ``*_rank`` calls of ``moe_ep_spec``) over the device exchange.

With ``MOE_EP_CUDA_NCCL_EXCHANGE=device``, :class:`~moe_ep_cuda_nccl.backend.CudaNcclBackend`
runs every operation through the native layer's device exchange
(:mod:`moe_ep_cuda_nccl.device_exchange`): forward and backward are its three
stages (dispatch, experts, combine); ``dispatch`` is its dispatch stage,
``combine`` and ``dispatch_backward`` its combine stage, ``combine_backward`` a
dispatch of the cotangent rows. No NCCL communicator is made: the process group
is gloo whatever the device (it carries the small host collectives below and the
store through which the ranks' regions are exchanged), so N ranks may share one
GPU (``moe-ep conformance --device cuda-shared``), and CPU tensors
(``MOE_EP_CUDA_NCCL_ON_CPU=1``) run the same protocol through ``/dev/shm``.

Per call, before any device stage:

- **One host collective** (gloo, CPU tensors): the count table of
  :func:`moe_ep_torch.core.share_table` (this rank's routes per destination
  expert from ``topk_idx``, its validation error, the configuration and encoding
  fingerprints, its token count). Every rank raises a rank's input error
  together, as the ``torch`` backend does, so no rank is left waiting in a stage.
  The layered calls share their argument checks the same way (one small all-gather).
- **The operand dtype** of ``forward`` and ``backward``, in the same collective.
  Block-scaled (and bf16) inputs run on bf16 operands, decoded without a host
  check inside the stages (:func:`moe_ep_cuda_nccl.prims.operands`): a value bf16
  cannot hold (an mxfp8 magnitude below 2^-126 off bf16's grid: scale codes 0..2)
  would decode to NaN, and through the combine that NaN would reach the other
  ranks' tokens. So each rank checks its own mxfp8 inputs on the host first
  (:func:`_decodes_inexactly`: a screen of the scale codes, then, only when a block
  with values has a code below 3, the decode's flag, read as the host-synchronised
  mode reads it) and
  shares the verdict in the table; when any rank's decode would be inexact, every
  rank runs that call on exact float32 operands (the inputs decoded to float32
  before the dispatch: the host-synchronised mode's fallback, taken by all ranks
  alike since the layer's operand dtype is a key of the collective exchange).
- **The layout.** The exchange is static-layout only. A static configuration
  runs as it is. A dynamic one (``recv_capacity`` None) runs with
  ``recv_capacity`` = the worst case (``num_ranks * max_tokens_per_rank *
  num_topk``) and ``expert_alignment`` 1: the received rows are then dense from
  row 0, exactly the dynamic buffer, followed by padding; the results are cut
  to the routed rows, whose number every rank knows from the table (the one host
  synchronisation). Without ``max_tokens_per_rank``, the largest token count of
  the table, rounded up to a power of two, stands in for it (so that the layers
  are reused).

The layered calls take no state from the dispatch but the routing in the handle
(``backend_state``: ``topk_idx``): ``combine`` and ``dispatch_backward`` first
re-run the dispatch stage on 4-byte rows to set the layer's routing (a combine
is "of the last dispatch"), then the combine stage.

After a call, the error record is read (:func:`moe_ep_cuda_nccl.static.check_errors`):
a peer that never arrived raises ``TransportError``. The backward compares the
stash's ``route_metadata`` with its own dispatch's and raises ``StashError`` on
every rank (one more small all-gather) after the stages, so every rank has run them.

Handles hold the routing, not device state; a handle of the NCCL mode is refused
with ``MoeEpError``. There is one exchange layer per configuration, device, operand
dtype and token bytes; layers of an earlier configuration are closed at the first
call of another one, after its host collective (every rank is then past its last
stage of them).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from moe_ep_spec import validation as v
from moe_ep_spec.api import (BackwardResult, DispatchGrads, DispatchHandle, DispatchInputs, DispatchResult,
                             ForwardResult, RankContext, RankInputs, Stash)
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import MoeEpError, StashError
from moe_ep_spec.formats import MoeFormat
from moe_ep_torch import backend as TB
from moe_ep_torch import core
from moe_ep_torch import formats as TF

from . import device_exchange as DX
from . import prims as P
from . import static
from .prims import NATIVE, ptr, where

__all__ = ["GROUP_BACKEND", "exchange_config", "forward", "backward", "dispatch", "combine", "dispatch_backward",
           "combine_backward"]

#: The process group's backend in this mode (host collectives on CPU tensors only).
GROUP_BACKEND = "gloo"

#: Bytes of one row of the routing-only dispatch that precedes a layered combine.
_ROUTING_ROW_BYTES = 4

_CPU = torch.device("cpu")


def prepare(ctx: RankContext) -> Tuple[Any, torch.device]:
    """The process group (gloo) and this rank's device."""
    return TB.process_group(ctx, backend=GROUP_BACKEND), torch.device(ctx.device)


def exchange_config(config: MoeEpConfig, max_tokens: int) -> MoeEpConfig:
    """The static configuration the device exchange runs ``config`` with:
    ``config`` itself when it is static with ``max_tokens_per_rank``; else
    ``max_tokens_per_rank`` (when unset) = ``max_tokens`` and, for the dynamic
    layout, ``recv_capacity`` = the worst case with ``expert_alignment`` 1."""
    if config.max_tokens_per_rank is None:
        config = config.replace(max_tokens_per_rank=max(1, int(max_tokens)))
    if config.static_layout:
        return config
    return config.replace(recv_capacity=config.worst_case_recv_rows())


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- host collectives


def _counts(config: MoeEpConfig, topk_idx: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(idx int64 [T, K], counts [E] int64, code [])`` on the CPU (:func:`moe_ep_torch.core.count_routes`,
    the counting of :func:`moe_ep_torch.core.make_plan`)."""
    idx = torch.from_numpy(np.asarray(topk_idx).astype(np.int64))
    rc = core.count_routes(config, idx)
    return idx, rc.counts, rc.code


class _Table:
    """What every rank knows after the host collective."""

    def __init__(self, config: MoeEpConfig, per: List[List[int]], tokens: List[int], inexact: List[int],
                 rank: int) -> None:
        n, el = config.num_ranks, config.num_local_experts
        self.xconfig = exchange_config(config, _pow2(max(tokens + [1])))
        per_expert = [sum(per[s][rank * el + e] for s in range(n)) for e in range(el)]
        #: Rows of this rank's buffer as the spec has them (the routed rows; the capacity when static).
        self.rows = int(config.recv_capacity) if config.static_layout else sum(per_expert)  # type: ignore[arg-type]
        #: Whether some rank's bf16 decode of its inputs would be inexact: every rank then runs float32 operands.
        self.inexact = any(inexact)


def _table(config: MoeEpConfig, group: Any, topk_idx: Any, num_tokens: int, error: Optional[BaseException],
           encodings: str, inexact: bool = False) -> _Table:
    """The host collective before any stage (shares ``error`` and ``inexact``; see the module doc)."""
    if error is None:
        idx, counts, code = _counts(config, topk_idx)
    else:
        idx, counts = None, torch.zeros(config.num_experts, dtype=torch.int64)
        code = torch.tensor(core.error_code(error), dtype=torch.int64)
    per, vals = core.share_table(config, counts, code, group, _CPU, error, idx, encodings, core.TORCH,
                                 values=(num_tokens, int(bool(inexact))))
    table = _Table(config, per, [row[0] for row in vals], [row[1] for row in vals], dist.get_rank(group))
    DX.close(group, keep=table.xconfig)  # every rank is past its last stage of the other layers
    return table


def _share(group: Any, error: Optional[BaseException]) -> None:
    """One all-gather of every rank's error code: all raise when one rank has an error."""
    mine = torch.tensor([core.error_code(error)], dtype=torch.int64)
    codes = [int(c) for c in core.TORCH.all_gather(mine, group).reshape(-1).tolist()]
    core._raise_gathered(codes, error, dist.get_rank(group))


def _check_record(xconfig: MoeEpConfig, group: Any) -> None:
    """Raise what the exchange recorded (a peer that did not arrive: TransportError)."""
    static.check_errors(xconfig, group)


# ----------------------------------------------------------------------------- helpers


def _encoding(x: Any) -> str:
    return TB._encoding(x)


def _cut(t: Any, rows: int) -> Any:
    """The first ``rows`` rows of a buffer (a tensor or a TorchBlockScaled)."""
    if isinstance(t, TF.TorchBlockScaled):
        data, scale = TF.raw(t)
        return TF.from_raw(data[:rows], scale[:rows], t.format, t.n)
    return t[:rows]


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` (``[R, ...]``, R <= rows) with zero rows appended up to ``rows``, contiguous."""
    if x.shape[0] == rows:
        return x.contiguous()
    out = torch.zeros((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out


def _state(handle: DispatchHandle) -> Dict[str, Any]:
    st = handle.backend_state
    if not isinstance(st, dict) or st.get("exchange") != "device":
        raise MoeEpError(
            f"rank {handle.rank}: handle was not made by cuda-nccl's dispatch over the device exchange "
            f"(MOE_EP_CUDA_NCCL_EXCHANGE=device)"
        )
    return st


def _routing(xconfig: MoeEpConfig, group: Any, device: torch.device, topk_idx: np.ndarray) -> Tuple[Any, torch.Tensor]:
    """The dispatch stage of the handle's routing alone (4-byte rows): the layer's
    routing for the combine stage that follows. Returns ``(layer, error [1])``."""
    cap = int(xconfig.recv_capacity)  # type: ignore[arg-type]
    idx = torch.from_numpy(np.ascontiguousarray(topk_idx, dtype=np.int32)).to(device)
    t, k = int(idx.shape[0]), xconfig.num_topk
    layer = DX._layer(xconfig, group, device, False, 4 * xconfig.hidden)
    rows = torch.zeros((t, _ROUTING_ROW_BYTES), dtype=torch.uint8, device=device)
    w = torch.zeros((t, k), dtype=torch.float32, device=device)
    x_rows = torch.empty((cap, _ROUTING_ROW_BYTES), dtype=torch.uint8, device=device)
    _, _, _, tpe, err = DX.dispatch_stage(layer, xconfig, rows, _ROUTING_ROW_BYTES, idx, w, x_rows)
    DX._record(xconfig, group, err, tpe)
    return layer, err


# ----------------------------------------------------------------------------- fused


def _rank_inputs(inputs: RankInputs, device: torch.device) -> Tuple[Any, Any, Any, torch.Tensor, torch.Tensor]:
    to = TB.to_torch
    return (to(inputs.activation, device), to(inputs.fc1_weight, device, weight=True),
            to(inputs.fc2_weight, device, weight=True), to(inputs.topk_idx, device), to(inputs.topk_weights, device))


#: The smallest E8M0 scale code at which every mxfp8 value is a bf16 value (docs/cuda-nccl.md,
#: "Block-scaled operands": codes 0..2 may give magnitudes below 2^-126 off bf16's subnormal grid).
_MXFP8_BF16_EXACT_SCALE = 3


def _low_scale_with_values(t: TF.TorchBlockScaled) -> torch.Tensor:
    """``[] bool``: whether some block of an mxfp8 tensor has a scale code below 3 and a
    nonzero code (an all-zero block, padding or pruned weights, has scale code 0 and is
    exact). Blocks of 32 along the last axis; when the codes' length is not 32 per
    scale, every low-scale block counts (no values looked at)."""
    data, scale = TF.raw(t)
    low = scale < _MXFP8_BF16_EXACT_SCALE
    nb = scale.shape[-1]
    if data.shape[-1] != 32 * nb:
        return low.any()
    values = (data.reshape(*data.shape[:-1], nb, 32) & 0x7F).ne(0).any(-1)
    return (low & values).any()


def _decodes_inexactly(activation: Any, fc1: Any, fc2: Any) -> bool:
    """Whether this rank's inputs would run on bf16 operands (:func:`moe_ep_cuda_nccl.device_exchange._bf16`)
    and the bf16 decode of one of them would hold a value bf16 cannot hold (decoded to NaN).

    Checked on the host, before any stage: the mxfp8 inputs' blocks are screened
    (:func:`_low_scale_with_values`, one read; nothing more when no block with values
    has a scale code below 3, the usual case), then only the inputs with such a block are decoded (:func:`moe_ep_cuda_nccl.prims.dequantize_bf16`, the layer's
    decode) with fresh flags, read in one synchronisation as the host-synchronised
    mode's check does (:func:`moe_ep_cuda_nccl.prims.operands`). The device record of
    :func:`moe_ep_cuda_nccl.prims.inexact_decodes` is not touched: these decodes are
    not used. Every row of the activation is checked (any may reach a peer's experts);
    the weights are this rank's experts', whose outputs return to every rank."""
    if not DX._bf16(activation, fc1, fc2):
        return False  # float32 operands: every decode is exact
    maybe = [(t, weight) for t, weight in ((activation, False), (fc1, True), (fc2, True))
             if isinstance(t, TF.TorchBlockScaled) and t.format is MoeFormat.MXFP8 and t.data.numel()]
    if not maybe:
        return False  # nvfp4 and bf16 are exact in bf16 by construction
    low = torch.stack([_low_scale_with_values(t) for t, _ in maybe]).tolist()
    maybe = [m for m, is_low in zip(maybe, low) if is_low]
    if not maybe:
        return False
    flags = torch.zeros(len(maybe), dtype=torch.int32, device=maybe[0][0].device)
    for i, (t, weight) in enumerate(maybe):
        P.dequantize_bf16(t, flags[i : i + 1], weight=weight)
    return any(flags.tolist())


def _exact_float32(activation: Any, fc1: Any, fc2: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three inputs as float32 tensors with the same values (block-scaled ones decoded
    exactly; weights as ``[E, H, 2I]`` / ``[E, I, H]``): the layer then runs its float32
    operands, the spec's float32 numbers."""

    def f32(t: Any, weight: bool) -> torch.Tensor:
        if isinstance(t, TF.TorchBlockScaled):
            return P.BlockScaledOperand(t, weight).f32()
        return t.float()

    return f32(activation, False), f32(fc1, True), f32(fc2, True)


def _fused_table(config: MoeEpConfig, ctx: RankContext, group: Any, inputs: RankInputs, device: torch.device,
                 check: Any = None) -> Tuple[_Table, Tuple[Any, Any, Any, torch.Tensor, torch.Tensor]]:
    """The host collective of ``forward`` and ``backward`` (after ``check(num_tokens)``), and
    this rank's inputs on ``device``: as given, or as exact float32 ones when some
    rank's bf16 decode would be inexact (:func:`_decodes_inexactly`; every rank alike)."""
    error: Optional[BaseException] = None
    ops: Optional[Tuple[Any, Any, Any, torch.Tensor, torch.Tensor]] = None
    inexact = False
    try:
        num_tokens = v.validate_rank_inputs(config, inputs, ctx.rank)
        if check is not None:
            check(num_tokens)
        ops = _rank_inputs(inputs, device)
        inexact = _decodes_inexactly(*ops[:3])
    except MoeEpError as exc:
        error, num_tokens = exc, 0
    encodings = "" if error else "|".join(
        _encoding(x) for x in (inputs.activation, inputs.fc1_weight, inputs.fc2_weight)
    )
    table = _table(config, group, None if error else inputs.topk_idx, num_tokens, error, encodings, inexact)
    if ops is None:  # the collective raises every rank's input error; reaching here without inputs is a bug
        raise MoeEpError(f"rank {ctx.rank}: internal error: the host collective passed a rank without its inputs")
    if table.inexact:
        ops = _exact_float32(*ops[:3]) + ops[3:]
    return table, ops


def forward(config: MoeEpConfig, ctx: RankContext, inputs: RankInputs) -> ForwardResult:
    """``forward_rank``: the three stages of :func:`moe_ep_cuda_nccl.device_exchange.forward`."""
    group, device = prepare(ctx)
    table, ops = _fused_table(config, ctx, group, inputs, device)
    xcfg = table.xconfig
    out = DX.forward(NATIVE, xcfg, group, *ops)
    _check_record(xcfg, group)
    output = TB.to_numpy(out["output"])
    if not config.generate_c:
        return ForwardResult(output)
    rows = table.rows
    return ForwardResult(output, TB.to_numpy(out["fc1_c"][:rows]), out["route_metadata"][:rows].cpu().numpy())


def backward(config: MoeEpConfig, ctx: RankContext, inputs: RankInputs, grad_output: np.ndarray,
             stash: Stash) -> BackwardResult:
    """``backward_rank``: :func:`moe_ep_cuda_nccl.device_exchange.backward_and_metadata`
    with the stash padded to the capacity; the stash's route metadata is compared
    with the dispatch's after the stages (a mismatch raises StashError on every rank)."""
    group, device = prepare(ctx)

    def check(num_tokens: int) -> None:
        v.validate_grad("grad_output", grad_output, (num_tokens, config.hidden), "(num_tokens, hidden)", ctx.rank)
        if not isinstance(stash, Stash):
            raise StashError(f"rank {ctx.rank}: stash must be a Stash; got {type(stash).__name__}")

    table, (act, fc1, fc2, idx, tw) = _fused_table(config, ctx, group, inputs, device, check)
    xcfg, rows = table.xconfig, table.rows
    cap = int(xcfg.recv_capacity)  # type: ignore[arg-type]
    error: Optional[BaseException] = None
    try:
        v.validate_stash(config, stash, rows, ctx.rank)
    except MoeEpError as exc:  # raised after the stages, on every rank (they all run them)
        error = exc
    fc1_c = torch.zeros((cap, 2 * config.intermediate), dtype=torch.bfloat16, device=device)
    if error is None:
        fc1_c[:rows] = TB.to_torch(stash.fc1_c, device)
    g = TB.to_torch(grad_output, device)
    grads, meta = DX.backward_and_metadata(NATIVE, xcfg, group, g, act, fc1, fc2, idx, tw, fc1_c)
    _check_record(xcfg, group)
    if error is None:
        expected = meta[:rows].cpu().numpy()
        diff = np.nonzero((stash.route_metadata != expected).any(axis=1))[0]
        if diff.size:
            row = int(diff[0])
            error = StashError(
                f"rank {ctx.rank}: route_metadata must equal the forward's routing of topk_idx; row {row} is "
                f"{tuple(int(x) for x in stash.route_metadata[row])}, the routing gives "
                f"{tuple(int(x) for x in expected[row])}"
            )
    _share(group, error)
    names = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")
    return BackwardResult(**{name: t.float().cpu().numpy() for name, t in zip(names, grads)})


# ----------------------------------------------------------------------------- layered


def dispatch(config: MoeEpConfig, ctx: RankContext, inputs: DispatchInputs) -> DispatchResult:
    """``dispatch_rank``: the dispatch stage of the tokens (any encoding) and weights."""
    group, device = prepare(ctx)
    error: Optional[BaseException] = None
    try:
        num_tokens = v.validate_dispatch_inputs(config, inputs, ctx.rank)
    except MoeEpError as exc:
        error, num_tokens = exc, 0
    table = _table(config, group, None if error else inputs.topk_idx, num_tokens, error,
                   "" if error else _encoding(inputs.tokens))
    xcfg, rows = table.xconfig, table.rows
    tokens = TB.to_torch(inputs.tokens, device)
    idx = TB.to_torch(inputs.topk_idx, device)
    weights = TB.to_torch(inputs.topk_weights, device)
    _, buf, _, w_buf, meta, gs, tpe, err = DX.move(xcfg, group, tokens, idx, weights, [], False)
    DX._record(xcfg, group, err, tpe)
    _check_record(xcfg, group)
    sizes = gs.to(torch.int64).cpu()
    handle = DispatchHandle(
        rank=ctx.rank,
        num_ranks=config.num_ranks,
        num_tokens=num_tokens,
        num_topk=config.num_topk,
        route_metadata=meta[:rows].cpu().numpy(),
        tokens_per_expert=tpe.to(torch.int64).cpu().numpy(),
        expert_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)]).numpy(),
        backend_state={"exchange": "device", "topk_idx": np.ascontiguousarray(inputs.topk_idx, dtype=np.int64),
                       "max_tokens": int(xcfg.max_tokens_per_rank)},  # type: ignore[arg-type]
    )
    return DispatchResult(tokens=TB.to_numpy(_cut(buf, rows)), topk_weights=w_buf[:rows].float().cpu().numpy(),
                          handle=handle)


def _layered(config: MoeEpConfig, ctx: RankContext, handle: Any,
             check: Any) -> Tuple[Any, torch.device, Dict[str, Any], MoeEpConfig]:
    """The shared checks of a layered call (``check()`` and the handle), then its exchange configuration."""
    group, device = prepare(ctx)
    error: Optional[BaseException] = None
    st: Dict[str, Any] = {}
    try:
        check()
        st = _state(handle)
    except MoeEpError as exc:
        error = exc
    _share(group, error)
    xcfg = exchange_config(config, st["max_tokens"])
    DX.close(group, keep=xcfg)
    return group, device, st, xcfg


def _combine_stage(config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, check: Any, rows: np.ndarray,
                   values: Optional[np.ndarray] = None,
                   prepare_rows: Any = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A layered call's stages after its shared checks (:func:`_layered`): the routing's
    dispatch stage, then the combine stage of ``rows`` (``[R, hidden]``, float32, padded
    to the capacity; ``prepare_rows(y)`` applied when given) with ``values`` (``[R]``) as
    per-route values when given. Returns ``(out [T, hidden], out_values [T, K] or None)``,
    float32, after the error record is read."""
    group, device, st, xcfg = _layered(config, ctx, handle, check)
    cap = int(xcfg.recv_capacity)  # type: ignore[arg-type]
    layer, _ = _routing(xcfg, group, device, st["topk_idx"])
    y = _padded(TB.to_torch(rows, device).float(), cap)
    if prepare_rows is not None:
        y = prepare_rows(y).contiguous()
    gw = None if values is None else _padded(TB.to_torch(values, device).float(), cap)
    t, k = handle.num_tokens, config.num_topk
    out = torch.empty((t, config.hidden), dtype=torch.float32, device=device)
    out_w = None if gw is None else torch.empty((t, k), dtype=torch.float32, device=device)
    err = torch.empty(1, dtype=torch.int32, device=device)
    _, stream = where(y)
    layer.combine(stream, t, ptr(y), ptr(out), None if gw is None else ptr(gw),
                  None if out_w is None else ptr(out_w), ptr(err), y_bf16=False)
    DX._record(xcfg, group, err, torch.zeros(config.num_local_experts, dtype=torch.int32, device=device))
    _check_record(xcfg, group)
    return out, out_w


def combine(config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, expert_out: np.ndarray) -> Any:
    """``combine_rank``: the routing's dispatch stage, then the combine stage of the
    expert outputs after their ``combine_format`` round trip."""
    out, _ = _combine_stage(config, ctx, handle, lambda: v.validate_expert_out(config, expert_out, handle), expert_out,
                            prepare_rows=lambda y: NATIVE.round_trip(y, config.combine_format))
    return TB.to_numpy(NATIVE.encode_output(config, out))


def dispatch_backward(config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, grad_tokens: np.ndarray,
                      grad_topk_weights: np.ndarray) -> DispatchGrads:
    """``dispatch_backward_rank``: the routing's dispatch stage, then the combine stage
    of the row cotangents with the weight cotangents as per-route values."""
    rows = handle.num_recv_rows if isinstance(handle, DispatchHandle) else 0

    def check() -> None:
        v.validate_grad("grad_tokens", grad_tokens, (rows, config.hidden), "(received rows, hidden)", ctx.rank)
        v.validate_grad("grad_topk_weights", grad_topk_weights, (rows,), "(received rows,)", ctx.rank)

    out, out_w = _combine_stage(config, ctx, handle, check, grad_tokens, grad_topk_weights)
    if out_w is None:  # _combine_stage returns them whenever values are given
        raise MoeEpError(f"rank {ctx.rank}: internal error: the combine stage returned no router-weight cotangents")
    return DispatchGrads(grad_tokens=out.cpu().numpy(), grad_topk_weights=out_w.cpu().numpy())


def combine_backward(config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle,
                     grad_output: np.ndarray) -> np.ndarray:
    """``combine_backward_rank``: the dispatch stage of the output cotangent rows
    (float32, moved unchanged into the expert-major buffer)."""
    t = handle.num_tokens if isinstance(handle, DispatchHandle) else 0

    def check() -> None:
        v.validate_grad("grad_output", grad_output, (t, config.hidden), "(num_tokens, hidden)", ctx.rank)

    group, device, st, xcfg = _layered(config, ctx, handle, check)
    idx = torch.from_numpy(np.ascontiguousarray(st["topk_idx"], dtype=np.int32)).to(device)
    g = TB.to_torch(grad_output, device).float().contiguous()
    w = torch.zeros((t, config.num_topk), dtype=torch.float32, device=device)
    # The float32 cotangent rows move as the dispatch's plain rows (4 * hidden bytes each).
    _, x_rows, _, _, _, _, tpe, err = DX.move(xcfg, group, g, idx, w, [], False)
    DX._record(xcfg, group, err, tpe)
    _check_record(xcfg, group)
    return x_rows[: handle.num_recv_rows].cpu().numpy()
