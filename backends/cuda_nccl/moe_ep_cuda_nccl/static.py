"""The static-shape mode: forward and backward with no host synchronisation.

With ``config.recv_capacity`` (the static layout) and
``config.max_tokens_per_rank`` set, every size is known from the
configuration and the input shapes, so the whole layer (plan, exchanges,
experts, combine) is enqueued on the current CUDA stream without one host
round trip and can be captured in a CUDA graph and replayed on new inputs.

How it differs from the host-synchronised path:

- The count exchange is an all-gather of every rank's routes per global
  expert (and a bad-id flag), kept on the device; every rank derives every
  send position, every buffer row and every error from that table.
- The token exchange moves a fixed ``P = min(max_tokens_per_rank * num_topk,
  recv_capacity)`` rows to every peer (a zero row where nothing is sent), each
  row carrying its route's ``(local_expert + 1, token, slot)``; the return
  moves ``P`` rows per peer back. NCCL therefore needs no counts from the host.
- Data-dependent errors cannot raise without a synchronisation: an expert id
  outside ``[-1, num_experts)`` or an aligned receive count above
  ``recv_capacity`` on any rank turns every rank's outputs and gradients to
  NaN and is recorded in the group's error flags; :func:`check_errors` reads
  them (one synchronisation, outside the graph) and raises the spec's error.
- Shapes, dtypes and the configuration are still checked on the host before
  anything is enqueued; every rank must pass the same shapes, dtypes and
  encodings, as a captured training step does (unlike the host-synchronised
  mode, the ranks' configurations are not compared; a rank that raises leaves
  its peers' exchanges waiting).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_ep_native import _capi as C
from moe_ep_spec import errors as E
from moe_ep_spec.config import MoeEpConfig
from moe_ep_torch import core
from moe_ep_torch.api import _check, _check_group

from .exchange_layers import close as close_exchange
from .prims import (MainGrads, NativePrimitives, combine_reduce, expert_backward, expert_forward, inexact_decodes_anywhere,
                    ptr, where)

__all__ = ["StaticPlan", "peer_capacity", "dispatch", "forward", "backward", "check_errors", "error_flags"]

#: Error bits of the flags (and of ``StaticPlan.error``).
BAD_EXPERT_ID = 1
OVERFLOW = 2
#: The device exchange (:mod:`moe_ep_cuda_nccl.device_exchange`): a peer did not arrive in time.
TRANSPORT = 4

_FLAGS: Dict[Tuple[str, int], Tuple[Any, torch.Tensor]] = {}
_FLAGS_LOCK = threading.Lock()


def peer_capacity(config: MoeEpConfig) -> int:
    """``P``: rows sent to (and received from) every peer in the static mode."""
    return min(int(config.max_tokens_per_rank) * config.num_topk, int(config.recv_capacity))  # type: ignore[arg-type]


@dataclass
class StaticPlan:
    """One rank's routing in the static mode; every tensor lives on the device.

    Attributes:
        num_tokens, num_topk, num_ranks, peer_capacity (P), capacity (C): sizes.
        send_slot: ``[T*K] int64``: the row of the ``[num_ranks * P + 1]`` send
            buffer of every send position (native plan order: by expert, then
            route id); ``num_ranks * P`` (the dropped last row) for an unrouted one.
        send_route: ``[T*K] int64``: the route id ``token * K + slot`` of every
            send position.
        route_pos: ``[T*K] int32``: the row of the returned ``[num_ranks * P]``
            rows that holds each route's result; -1 for an unused slot.
        buf_row: ``[num_ranks * P] int64``: the expert-buffer row of every
            received row; C (a dropped row) for an empty one.
        group_sizes: ``[E_local] int32``: the aligned slab sizes (cut at C).
        tokens_per_expert: ``[E_local] int64``; expert_offsets: ``[E_local + 1] int64``.
        route_metadata: ``[C, 4] int32`` ``(local_expert, src_rank, src_token,
            src_slot)``; -1 rows are padding.
        error: ``[] int32``: 0, or the bits BAD_EXPERT_ID / OVERFLOW of any rank.
        aligned_rows: ``[] int64``: the largest aligned receive count of any rank.
    """

    num_tokens: int
    num_topk: int
    num_ranks: int
    peer_capacity: int
    capacity: int
    send_slot: torch.Tensor
    send_route: torch.Tensor
    route_pos: torch.Tensor
    buf_row: torch.Tensor
    group_sizes: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    route_metadata: torch.Tensor
    error: torch.Tensor
    aligned_rows: torch.Tensor

    def to_buffer(self, received: torch.Tensor) -> torch.Tensor:
        """Received rows (``[num_ranks * P, ...]``) into the ``[C, ...]`` expert buffer; padding rows zero."""
        out = torch.zeros((self.capacity + 1,) + tuple(received.shape[1:]), dtype=received.dtype, device=received.device)
        out[self.buf_row] = received
        return out[: self.capacity]

    def from_buffer(self, buf: torch.Tensor) -> torch.Tensor:
        """Buffer rows back to received positions (``[num_ranks * P, ...]``); empty positions zero."""
        pad = torch.zeros((1,) + tuple(buf.shape[1:]), dtype=buf.dtype, device=buf.device)
        return torch.cat([buf, pad])[self.buf_row]


def _plan_routes(idx: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native plan of one rank: ``(send_route [T*K], route_expert [T*K], counts [E + 1])``, int32."""
    idx32 = idx.to(torch.int32).contiguous()
    routes = idx32.numel()
    send_route = torch.empty(routes, dtype=torch.int32, device=idx.device)
    route_pos = torch.empty(routes, dtype=torch.int32, device=idx.device)
    route_expert = torch.empty(routes, dtype=torch.int32, device=idx.device)
    counts = torch.empty(num_experts + 1, dtype=torch.int32, device=idx.device)
    dev, stream = where(idx32)
    C.call(
        "moe_ep_plan_routes", dev, stream, ptr(idx32), int(idx32.shape[0]), int(idx32.shape[1]), num_experts,
        ptr(send_route), ptr(route_pos), ptr(route_expert), ptr(counts),
    )
    return send_route, route_expert, counts


def _exclusive(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def dispatch(
    prims: NativePrimitives,
    config: MoeEpConfig,
    group: Any,
    idx: torch.Tensor,
    payload: Callable[[torch.Tensor], List[torch.Tensor]],
) -> Tuple[StaticPlan, List[torch.Tensor]]:
    """Plan this rank's routes on the device and move ``payload(send_route)``
    (per-route rows in send order, see :attr:`StaticPlan.send_route`) to their
    experts' ranks.
    Returns the plan and the parts in buffer order (``[C, ...]``, padding zero).
    Collective: one all-gather and one exchange, no host synchronisation."""
    n, el, k, num_experts = config.num_ranks, config.num_local_experts, config.num_topk, config.num_experts
    cap, align, p = int(config.recv_capacity), config.expert_alignment, peer_capacity(config)  # type: ignore[arg-type]
    rank = dist.get_rank(group)
    t = int(idx.shape[0])
    dev = idx.device
    send_route32, route_expert, counts = _plan_routes(idx, num_experts)
    # The count exchange: every rank's routes per global expert, then its bad-id flag.
    mine = torch.cat([counts[:num_experts].to(torch.int64), (counts[num_experts:] > 0).to(torch.int64)])
    table = prims.all_gather(mine, group)  # [n, E + 1]
    per = table[:, :num_experts].reshape(n, n, el)  # per[src, dest, local expert]
    aligned = (per.sum(0) + (align - 1)) // align * align  # [dest, el]
    aligned_total = aligned.sum(1)  # [dest]
    error = (table[:, num_experts].sum() > 0).to(torch.int32) * BAD_EXPERT_ID + (aligned_total > cap).any().to(
        torch.int32
    ) * OVERFLOW
    # Send side: position i of the native plan goes to slot (dest * P + j), j its index among the routes to dest.
    send_route = send_route32.to(torch.int64)
    expert = route_expert.to(torch.int64)[send_route]  # -1: unrouted (unused slot or bad id)
    routed = expert >= 0
    dest = torch.where(routed, torch.div(expert, el, rounding_mode="floor"), torch.zeros_like(expert))
    to_dest = per[rank].sum(1)  # [n]
    j = torch.arange(t * k, device=dev) - _exclusive(to_dest, 0)[dest]
    ok = routed & (j < p)
    send_slot = torch.where(ok, dest * p + j, torch.full_like(j, n * p))
    route_pos = torch.full((t * k,), -1, dtype=torch.int32, device=dev)
    route_pos[send_route] = torch.where(ok, dest * p + j, torch.full_like(j, -1)).to(torch.int32)
    # The payload: (local expert + 1, token, slot) of every route, then the caller's rows.
    token = torch.div(send_route, k, rounding_mode="floor")
    meta = torch.stack([torch.where(routed, expert % el + 1, torch.zeros_like(expert)), token, send_route - token * k], 1)
    blob, layout = core.pack_rows([meta.to(torch.int32)] + payload(send_route), t * k)
    send = torch.zeros((n * p + 1, blob.shape[1]), dtype=torch.uint8, device=dev)
    send[send_slot] = blob
    received = core.unpack_rows(prims.all_to_all(send[: n * p], [p] * n, [p] * n, group), layout)
    # Receive side: received row q = (source s, index jj) of local expert le.
    rmeta = received[0].to(torch.int64)
    le = rmeta[:, 0] - 1
    valid = le >= 0
    lec = le.clamp(min=0)
    q = torch.arange(n * p, device=dev)
    src, jj = torch.div(q, p, rounding_mode="floor"), q % p
    from_src = per[:, rank, :]  # [src, el]
    slab = aligned[rank]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(slab, 0)])
    row = offsets[lec] + _exclusive(from_src, 0)[src, lec] + jj - _exclusive(from_src, 1)[src, lec]
    valid = valid & (row < cap)
    buf_row = torch.where(valid, row, torch.full_like(row, cap))
    meta4 = torch.stack([le, src, rmeta[:, 1], rmeta[:, 2]], 1).to(torch.int32)
    route_metadata = torch.full((cap + 1, 4), -1, dtype=torch.int32, device=dev)
    route_metadata[buf_row] = torch.where(valid.unsqueeze(1), meta4, torch.full_like(meta4, -1))
    cut = offsets.clamp(max=cap)
    plan = StaticPlan(num_tokens=t, num_topk=k, num_ranks=n, peer_capacity=p, capacity=cap, send_slot=send_slot,
                      send_route=send_route, route_pos=route_pos, buf_row=buf_row,
                      group_sizes=(cut[1:] - cut[:-1]).to(torch.int32), tokens_per_expert=from_src.sum(0),
                      expert_offsets=offsets, route_metadata=route_metadata[:cap], error=error,
                      aligned_rows=aligned_total.max())
    return plan, [plan.to_buffer(r) for r in received[1:]]


def return_rows(prims: NativePrimitives, plan: StaticPlan, parts: List[torch.Tensor], group: Any) -> List[torch.Tensor]:
    """Buffer rows (``[C, ...]`` each) back to their source ranks: per-route rows at
    :attr:`StaticPlan.route_pos` (``[num_ranks * P, ...]``). One exchange."""
    n, p = plan.num_ranks, plan.peer_capacity
    blob, layout = core.pack_rows([plan.from_buffer(x) for x in parts], n * p)
    return core.unpack_rows(prims.all_to_all(blob, [p] * n, [p] * n, group), layout)


# ----------------------------------------------------------------------------- errors


def error_flags(group: Any, device: torch.device) -> torch.Tensor:
    """The group's persistent ``[2] int64`` flags on ``device``: the error bits
    of every static call since the last :func:`check_errors`, and the largest
    aligned receive count seen. Made on first use (outside any graph capture)."""
    key = (group.group_name, id(group))
    with _FLAGS_LOCK:
        entry = _FLAGS.get(key)
        if entry is None or entry[1].device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise E.MoeEpError(
                    "cuda-nccl: the static mode's error flags of this process group do not exist yet; a graph "
                    "captured now would zero them on every replay: run the static layer once before capturing it"
                )
            entry = _FLAGS[key] = (group, torch.zeros(2, dtype=torch.int64, device=device))
    return entry[1]


def _record(plan: StaticPlan, group: Any) -> None:
    flags = error_flags(group, plan.error.device)
    flags[0:1].bitwise_or_(plan.error.to(torch.int64).reshape(1))
    torch.maximum(flags[1:2], plan.aligned_rows.reshape(1), out=flags[1:2])


def check_errors(config: MoeEpConfig, group: Any) -> None:
    """Raise the spec's error for what static calls on ``group`` recorded since
    the last check, and clear the flags (one host synchronisation): a transport
    timeout, a bad expert id, an overflow, then a block-scaled value the bf16
    operands could not hold (:func:`moe_ep_cuda_nccl.prims.inexact_decodes`, on
    every device with a record)."""
    with _FLAGS_LOCK:
        entries = [e for (name, _), e in _FLAGS.items() if e[0] is group]
    for _, flags in entries:
        if flags.is_cuda:
            torch.cuda.synchronize(flags.device)  # static calls may have run on any stream
        bits, aligned = (int(v) for v in flags.tolist())
        flags.zero_()
        if bits & TRANSPORT:
            close_exchange(group)  # the device exchange's layers are unusable after a timeout
            raise E.TransportError(
                f"rank {dist.get_rank(group)}: a peer of the device exchange did not arrive within "
                f"MOE_EP_CUDA_NCCL_TIMEOUT_S in a static call since the last check (its outputs are NaN); "
                f"the exchange was dropped and the next call makes a new one",
                op="moe_ep_layer_dispatch", status=5, status_name="MOE_EP_ERR_COMM",
            )
        if bits & BAD_EXPERT_ID:
            raise E.RoutingIndexError(
                f"rank {dist.get_rank(group)}: topk_idx values must be in [-1, num_experts) = [-1, {config.num_experts}) "
                f"on every rank; some rank's were not in a static call since the last check (its outputs are NaN)",
                num_experts=config.num_experts,
            )
        if bits & OVERFLOW:
            raise E.CapacityError(
                f"rank {dist.get_rank(group)}: received rows after aligning every expert's slab to expert_alignment = "
                f"{config.expert_alignment} must be <= recv_capacity = {config.recv_capacity} on every rank; got "
                f"{aligned} in a static call since the last check (its outputs are NaN)",
                limit=config.recv_capacity,
                got=aligned,
            )
    if inexact_decodes_anywhere():
        raise E.FormatError(
            f"rank {dist.get_rank(group)}: block-scaled operands must decode to bf16 exactly for the tensor cores in "
            f"the static mode; a value did not (an mxfp8 magnitude below 2^-126 off bf16's grid, from a scale code "
            f"<= 2) in a static call since the last check, and the results depending on it are NaN; use "
            f"host_sync=True (it takes the float32 path then) or rescale the blocks"
        )


# ----------------------------------------------------------------------------- the layer


def _require_static(config: MoeEpConfig, rank: int) -> None:
    if config.recv_capacity is None or config.max_tokens_per_rank is None:
        raise E.ConfigError(
            f"rank {rank}: the static-shape mode (host_sync=False) needs recv_capacity and max_tokens_per_rank; got "
            f"recv_capacity = {config.recv_capacity}, max_tokens_per_rank = {config.max_tokens_per_rank}",
            field="recv_capacity" if config.recv_capacity is None else "max_tokens_per_rank",
            value=None,
        )


def _dispatched(prims, config, group, activation, fc1, fc2, idx, weights, extra, check=None):
    """The host checks (then ``check()``), then plan and dispatch the token rows, router weights and
    ``extra`` per-token rows (the payload of :func:`moe_ep_torch.core.route_payload`).
    Returns ``(plan, x_buf [C, H], per-row buffers after the tokens (weights,
    then extra), fc1, fc2)``: the operands of :meth:`NativePrimitives.forward_operands`
    (bf16 for bf16 inputs, else float32)."""
    _check_group(config, group)
    _require_static(config, dist.get_rank(group))
    _check(config, group, activation, fc1, fc2, idx, weights)
    if check is not None:
        check()
    payload = core.route_payload(activation, weights, config.num_topk, extra=extra)
    plan, recv = dispatch(prims, config, group, idx, payload)
    tokens = len(recv) - 1 - len(extra)
    x_buf, fc1_d, fc2_d = prims.forward_operands(
        activation, core.rebuild(activation, recv[:tokens]), prims.decode_weight(fc1), prims.decode_weight(fc2)
    )
    return plan, x_buf, recv[tokens:], fc1_d, fc2_d


def forward(
    prims: NativePrimitives, config: MoeEpConfig, group: Any, activation: Any, fc1: Any, fc2: Any, idx: torch.Tensor,
    weights: torch.Tensor, stash: bool = True,
) -> Dict[str, Any]:
    """The fused forward in the static mode: ``{"output", "fc1_c" [C, 2I] bf16,
    "route_metadata" [C, 4] int32}``; outputs NaN on every rank when any rank's
    routing is bad (see :func:`check_errors`). ``stash`` False (no backward follows):
    ``fc1_c`` is None, not written."""
    plan, x_buf, (w_buf,), fc1_d, fc2_d = _dispatched(prims, config, group, activation, fc1, fc2, idx, weights, [])
    # y after the combine round trip
    y, c = expert_forward(config, x_buf, w_buf, fc1_d, fc2_d, plan.group_sizes, stash=stash)
    (back,) = return_rows(prims, plan, [y], group)
    out = combine_reduce(back, plan.route_pos, plan.num_tokens, config.num_topk)
    bad = plan.error != 0  # a device scalar: masked_fill keeps it there (no host copy, capturable)
    _record(plan, group)
    if c is not None:
        c = c.masked_fill(plan.route_metadata[:, :1] < 0, 0.0)  # padding rows zero even with non-finite weights
        c = c.masked_fill(bad, float("nan")).to(torch.bfloat16)
    return {
        "output": prims.encode_output(config, out.masked_fill(bad, float("nan"))),
        "fc1_c": c,
        "route_metadata": plan.route_metadata,
    }


def backward(
    prims: NativePrimitives,
    config: MoeEpConfig,
    group: Any,
    grad_output: torch.Tensor,
    activation: Any,
    fc1: Any,
    fc2: Any,
    idx: torch.Tensor,
    weights: torch.Tensor,
    fc1_c: torch.Tensor,
    main_grads: Optional[MainGrads] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec backward in the static mode: float32 ``(grad_activation,
    grad_fc1_weight, grad_fc2_weight, grad_topk_weights)``, NaN on every rank
    when any rank's routing is bad. With ``main_grads`` the weight gradients are
    added to those accumulators in the native GEMMs (NaN there too on an error) and
    the two weight results are the accumulators."""
    k = config.num_topk

    def check_stash() -> None:
        want = (config.recv_capacity, 2 * config.intermediate)
        if tuple(fc1_c.shape) != want:
            raise E.StashError(
                f"rank {dist.get_rank(group)}: fc1_c must have shape (recv_capacity, 2 * intermediate) = {want} "
                f"in the static mode; got {tuple(fc1_c.shape)}"
            )

    plan, x_buf, (w_buf, dy_buf), fc1_d, fc2_d = _dispatched(
        prims, config, group, activation, fc1, fc2, idx, weights, [core.cotangent(grad_output)], check_stash
    )
    dx, dw, dfc1, dfc2 = expert_backward(config, x_buf, w_buf, fc1_d, fc2_d, fc1_c, dy_buf, plan.group_sizes,
                                         main_grads)
    back_dx, back_dw = return_rows(prims, plan, [dx, dw], group)
    gx = combine_reduce(back_dx, plan.route_pos, plan.num_tokens, k)
    pos = plan.route_pos.to(torch.int64)
    gw = torch.cat([back_dw, back_dw.new_zeros(1)])[torch.where(pos >= 0, pos, torch.full_like(pos, back_dw.shape[0]))]
    bad = plan.error != 0
    _record(plan, group)
    if main_grads is not None:  # the accumulators themselves, in place
        dfc1.masked_fill_(bad, float("nan"))
        dfc2.masked_fill_(bad, float("nan"))
    else:
        dfc1, dfc2 = dfc1.masked_fill(bad, float("nan")), dfc2.masked_fill(bad, float("nan"))
    return (
        gx.masked_fill(bad, float("nan")),
        dfc1,
        dfc2,
        gw.reshape(plan.num_tokens, k).masked_fill(bad, float("nan")),
    )
