"""One rank's MoeEp computation in torch over a ``torch.distributed`` process group.

Host synchronisation: exactly one per plan. Every rank all-gathers a small
int64 vector (its routes per destination rank and local expert, an input-error
code and fingerprints of the configuration and of the input encodings) and
copies the gathered table to the host once. From that table every rank knows
every send and receive count, every expert's row count, whether any rank's input
was rejected, whether the ranks agree on the configuration and the encodings and
whether any rank's aligned received rows overflow ``recv_capacity``; all ranks
therefore raise the same error together instead of leaving the others blocked
in a collective: the offending rank's class on every rank ("rank r rejected its
inputs" on the others), ``ConfigError`` when the configurations differ,
``DTypeError`` when the encodings do, ``CapacityError`` for an overflow. A
process group whose size differs from ``num_ranks`` is rejected before any
collective. (An all-gather of the counts
rather than an all-to-all: it costs ``num_ranks`` times a few hundred bytes and
buys these consistent errors.) The payloads then move with one
``all_to_all_single`` of packed byte rows per direction; nothing else waits for
the host.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_ep_spec import errors as E
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.formats import MoeFormat

from . import formats as TF

__all__ = [
    "Plan", "Primitives", "TORCH", "make_plan", "RouteCounts", "count_routes", "share_table", "route_payload", "cotangent", "exchange",
    "exchange_back", "forward", "backward", "ERROR_CODES",
]

#: Error classes that travel between ranks as codes (0 = no error).
ERROR_CODES: Tuple[type, ...] = (
    type(None),
    E.ShapeError,
    E.DTypeError,
    E.RoutingIndexError,
    E.CapacityError,
    E.FormatError,
    E.DeviceError,
    E.MoeEpError,
)


def error_code(exc: Optional[BaseException]) -> int:
    """The code of ``exc``'s class in :data:`ERROR_CODES` (0 for None)."""
    if exc is None:
        return 0
    for i, cls in enumerate(ERROR_CODES[1:], start=1):
        if type(exc) is cls:
            return i
    return len(ERROR_CODES) - 1


_ROUTING_CODE = ERROR_CODES.index(E.RoutingIndexError)


def fingerprint(config: MoeEpConfig, extra: str = "") -> int:
    """A 62-bit digest of the configuration every rank must share."""
    fields = {k: (v.value if isinstance(v, MoeFormat) else v) for k, v in vars(config).items()}
    text = json.dumps(fields, sort_keys=True, default=str) + "|" + extra
    return (zlib.crc32(text.encode()) << 30) ^ zlib.crc32(text[::-1].encode())


class Primitives:
    """The operations the layer is built from: collectives, codecs, the expert
    MLP and the slot reduction.

    These are the torch backend's own (torch ops, ``torch.distributed``
    collectives). Another provider overrides them and keeps everything else of
    this module and of :mod:`moe_ep_torch.api`: the plan, the payload packing,
    the error sharing and the autograd formula (the ``cuda-nccl`` backend runs
    the native core's kernels and NCCL transport this way).
    """

    #: Shown in reports and error messages.
    name = "torch"

    def all_gather(self, row: torch.Tensor, group: Any) -> torch.Tensor:
        """``[num_ranks, L]``: every rank's ``row`` (``[L] int64``), in rank order."""
        gathered = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, row, group=group)
        return torch.stack(gathered)

    def all_to_all(self, x: torch.Tensor, send_counts: List[int], recv_counts: List[int], group: Any) -> torch.Tensor:
        """Rows of ``x`` (``[sum(send_counts), ...]``, grouped by destination rank)
        to their ranks; returns ``[sum(recv_counts), ...]`` grouped by source rank."""
        out = torch.empty((sum(recv_counts),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        return out

    def decode(self, t: Any) -> torch.Tensor:
        """float32 values of a plain tensor or a TorchBlockScaled, exactly."""
        return TF.decode(t)

    def decode_weight(self, w: Any) -> Any:
        """An expert weight for :meth:`experts_forward` (see
        :func:`moe_ep_torch.formats.decode_weight`)."""
        return TF.decode_weight(w)

    def round_trip(self, values: torch.Tensor, fmt: MoeFormat) -> torch.Tensor:
        """``decode(encode(values))`` in ``fmt`` (float32 in and out)."""
        return TF.round_trip(values, fmt)

    def encode_output(self, config: MoeEpConfig, values: torch.Tensor) -> Any:
        """``[T, H]`` float32 encoded in ``config.output_format``."""
        return encode_output(config, values)

    def forward_operands(self, activation: Any, tokens: Any, fc1: Any, fc2: Any) -> Tuple[Any, Any, Any]:
        """The operands :meth:`experts_forward` takes from the buffer rows ``tokens``
        (in the activation's encoding) and the weights. Here bfloat16 ones on CUDA
        stay bfloat16 (exact), so that the bf16 GEMMs can run; everything else is
        decoded to float32."""

        def bf16_cuda(t: Any) -> bool:
            return isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.is_cuda

        x_buf = tokens if bf16_cuda(tokens) else self.decode(tokens)
        return (
            x_buf,
            fc1 if bf16_cuda(fc1) else self.decode(fc1),
            fc2 if bf16_cuda(fc2) else self.decode(fc2),
        )

    def experts_forward(self, config: MoeEpConfig, plan: "Plan", x, w, fc1, fc2) -> Tuple[torch.Tensor, torch.Tensor]:
        """See :func:`experts_forward`."""
        return experts_forward(config, plan, x, w, fc1, fc2)

    def experts_backward(self, config: MoeEpConfig, plan: "Plan", x, w, fc1, fc2, fc1_c, dy):
        """See :func:`experts_backward`; ``fc1_c`` is the bfloat16 stash, ``dy`` the
        cotangent rows of :func:`cotangent` (bfloat16 or float32)."""
        return experts_backward(config, plan, x, w, fc1, fc2, fc1_c.float(), dy.float())

    def sum_slots(self, plan: "Plan", send_rows: torch.Tensor) -> torch.Tensor:
        """The Form-A reduction of send-order rows: ``[T, ...]`` float32, slot order from +0."""
        return sum_slots(to_slots(plan, send_rows))


@dataclass
class Plan:
    """One rank's routing plan (the torch backend's handle state).

    Attributes:
        rank, num_ranks, num_tokens, num_topk, num_local_experts: the shape.
        send_route: ``[S] int64``: route ids ``token * num_topk + slot`` in send
            order (grouped by destination rank, token-major within).
        send_counts, recv_counts: rows sent to / received from every rank (host).
        recv_meta: ``[Rv, 4] int32`` ``(local_expert, src_rank, src_token,
            src_slot)`` in received order (source rank, then token-major).
        order: ``[Rv] int64``: received-order index of every expert-major route.
        rows: ``[Rv] int64``: the buffer row of every expert-major route (static
            layout: aligned slabs; dynamic: ``arange``).
        num_rows: R, rows of the received buffer (padding included).
        tokens_per_expert: host list ``[E_local]``; expert_offsets: host list
            ``[E_local + 1]``: the slab starts in the buffer.
        route_metadata: ``[R, 4] int32`` in buffer order, ``-1`` rows for padding.
        dense: the buffer has no padding and ``rows`` is ``arange`` (dynamic layout).
    """

    rank: int
    num_ranks: int
    num_tokens: int
    num_topk: int
    num_local_experts: int
    send_route: torch.Tensor
    send_counts: List[int]
    recv_counts: List[int]
    recv_meta: torch.Tensor
    order: torch.Tensor
    rows: torch.Tensor
    num_rows: int
    tokens_per_expert: List[int]
    expert_offsets: List[int]
    route_metadata: torch.Tensor

    #: The dynamic layout: buffer row i is expert-major route i (``rows`` is ``arange``).
    dense: bool = False

    @property
    def valid_rows(self) -> torch.Tensor:
        return self.route_metadata[:, 0] >= 0


def _raise_gathered(codes: List[int], my_error: Optional[BaseException], rank: int) -> None:
    bad = [(r, c) for r, c in enumerate(codes) if c]
    if not bad:
        return
    if my_error is not None:
        raise my_error
    first_rank, code = bad[0]
    cls = ERROR_CODES[code]
    exc = cls(  # type: ignore[call-arg]
        f"rank {rank}: rank {first_rank} rejected its inputs with {cls.__name__}; see that rank's error for the details"
    )
    exc.moe_ep_peer_error = True  # moe_ep_spec.launch raises the originating rank's error
    raise exc


def _routing_error(config: MoeEpConfig, idx: torch.Tensor, rank: int) -> E.RoutingIndexError:
    bad = torch.nonzero((idx < -1) | (idx >= config.num_experts))[0].tolist()
    value = int(idx[bad[0], bad[1]])
    return E.RoutingIndexError(
        f"rank {rank}: topk_idx values must be in [-1, num_experts) = [-1, {config.num_experts}); "
        f"got {value} at (token {bad[0]}, slot {bad[1]})",
        rank=rank,
        position=(bad[0], bad[1]),
        value=value,
        num_experts=config.num_experts,
    )


def share_table(
    config: MoeEpConfig,
    counts: torch.Tensor,
    code: torch.Tensor,
    group: Any,
    device: torch.device,
    input_error: Optional[BaseException] = None,
    idx: Optional[torch.Tensor] = None,
    fingerprint_extra: str = "",
    prims: Optional[Primitives] = None,
    values: Sequence[int] = (),
) -> Tuple[List[List[int]], List[List[int]]]:
    """The count table of :func:`make_plan` (collective: one all-gather, one host
    sync), with every rank's input error shared: all ranks raise together.

    ``counts`` ``[num_ranks * num_local_experts] int64`` (this rank's routes per
    destination rank and local expert), ``code`` a scalar: 0, or the
    RoutingIndexError code when ``idx`` (int64) holds a bad id; ``input_error``
    this rank's validation failure (or None). ``values``: further integers of
    this rank that every rank gets (the same number on every rank).
    Raises the shared error, a ConfigError when the ranks' configurations differ,
    a DTypeError when their input encodings (``fingerprint_extra``) differ, and in
    the static layout the CapacityError of any rank whose aligned rows overflow.
    Returns ``(per, vals)``: ``per[src][dest * num_local_experts + e]`` and every
    rank's ``values``."""
    prims = prims or TORCH
    n, el = config.num_ranks, config.num_local_experts
    rank = dist.get_rank(group)
    # The configuration and the input encodings are fingerprinted apart: a mismatch of
    # the first is a ConfigError, of the second a DTypeError (spec section 12: dispatch
    # tokens whose encoding differs between ranks).
    prints_mine = torch.tensor([fingerprint(config), fingerprint(config, fingerprint_extra)], device=device)
    extra = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    mine = torch.cat([counts.to(device=device, dtype=torch.int64), code.reshape(1).to(device=device, dtype=torch.int64),
                      prints_mine, extra])
    table = prims.all_gather(mine, group).tolist()  # the one host synchronisation
    codes = [int(row[n * el]) for row in table]
    prints = [int(row[n * el + 1]) for row in table]
    encodings = [int(row[n * el + 2]) for row in table]
    if codes[rank] == _ROUTING_CODE and input_error is None:
        input_error = _routing_error(config, idx, rank)
    _raise_gathered(codes, input_error, rank)
    if len(set(prints)) != 1:
        raise E.ConfigError(
            f"rank {rank}: the ranks disagree on the configuration (fingerprints {prints}); every rank must pass "
            f"the same MoeEpConfig"
        )
    if len(set(encodings)) != 1:
        raise E.DTypeError(
            f"rank {rank}: the ranks pass inputs in different encodings (fingerprints {encodings}); every rank must "
            f"pass its inputs in the same encoding (the same plain dtype, or the same block format)",
            name="tokens",
        )
    per = [[int(v) for v in row[: n * el]] for row in table]  # per[src][dest * el + e]
    if config.static_layout:
        align = config.expert_alignment
        for d in range(n):
            slabs = [-(-sum(per[s][d * el + e] for s in range(n)) // align) * align for e in range(el)]
            if sum(slabs) > config.recv_capacity:  # type: ignore[operator]
                routes = sum(sum(per[s][d * el : (d + 1) * el]) for s in range(n))
                raise E.CapacityError(
                    f"rank {d}: received rows after aligning every expert's slab to expert_alignment = {align} must be "
                    f"<= recv_capacity = {config.recv_capacity}; got {sum(slabs)} ({routes} routes)",
                    limit=config.recv_capacity,
                    got=sum(slabs),
                )
    return per, [[int(v) for v in row[n * el + 3 :]] for row in table]


@dataclass(frozen=True)
class RouteCounts:
    """This rank's routes as :func:`make_plan` counts them for :func:`share_table`.

    Attributes:
        route: ``[R] int64``: the route ids ``token * K + slot`` of the routed slots (id >= 0), token-major.
        expert: ``[R] int64``: their global experts.
        counts: ``[num_experts] int64``: routes per global expert (= per (destination rank, local
            expert)); all zero when an id is bad.
        code: ``[] int64``: 0, or the RoutingIndexError code when an id lies outside ``[-1, num_experts)``.
    """

    route: torch.Tensor
    expert: torch.Tensor
    counts: torch.Tensor
    code: torch.Tensor


def count_routes(config: MoeEpConfig, idx: torch.Tensor) -> RouteCounts:
    """:class:`RouteCounts` of ``idx`` (``[T, K] int64`` expert ids), on its device, with no
    host synchronisation."""
    e = config.num_experts
    bad_ids = ((idx < -1) | (idx >= e)).any()
    flat = idx.reshape(-1)
    route = torch.nonzero(flat >= 0).reshape(-1)  # token-major
    expert = flat[route]
    counts = torch.bincount(expert.clamp(0, e - 1), minlength=e)[:e]
    counts = torch.where(bad_ids, torch.zeros_like(counts), counts)
    code = torch.where(bad_ids, torch.tensor(_ROUTING_CODE, device=idx.device), torch.tensor(0, device=idx.device))
    return RouteCounts(route, expert, counts, code)


def make_plan(
    config: MoeEpConfig,
    topk_idx: Optional[torch.Tensor],
    num_tokens: int,
    group: Any,
    device: torch.device,
    input_error: Optional[BaseException] = None,
    fingerprint_extra: str = "",
    payload: Optional[Callable[[torch.Tensor], List[torch.Tensor]]] = None,
    prims: Optional[Primitives] = None,
) -> Tuple[Plan, List[torch.Tensor]]:
    """Plan the routes of this rank and move their payload (collective: one
    all-gather, one host sync, one all_to_all_single).

    ``input_error`` is this rank's validation failure (or None): it is shared
    with every rank so that all of them raise. ``topk_idx`` may be None then.
    ``payload(send_route)`` returns per-route rows in send order that travel
    with the routes' metadata; their received rows (received order) are
    returned with the plan. ``prims`` (default :data:`TORCH`) runs the collectives.
    """
    prims = prims or TORCH
    n, el, k = config.num_ranks, config.num_local_experts, config.num_topk
    rank = dist.get_rank(group)
    if input_error is None:
        idx = topk_idx.to(device=device, dtype=torch.int64)  # type: ignore[union-attr]
        rc = count_routes(config, idx)
        route, expert, counts, code = rc.route, rc.expert, rc.counts, rc.code
        dest = torch.div(expert, el, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # by destination, token-major within
        send_route = route[order]
    else:
        idx = None
        send_route = torch.zeros(0, dtype=torch.int64, device=device)
        counts = torch.zeros(n * el, dtype=torch.int64, device=device)
        code = torch.tensor(error_code(input_error), device=device)
    per, _ = share_table(config, counts, code, group, device, input_error, idx, fingerprint_extra, prims)
    send_counts = [sum(per[rank][d * el : (d + 1) * el]) for d in range(n)]
    recv_counts = [sum(per[s][rank * el : (rank + 1) * el]) for s in range(n)]
    per_expert = [sum(per[s][rank * el + e] for s in range(n)) for e in range(el)]
    if config.static_layout:
        align = config.expert_alignment
        slabs = [-(-c // align) * align for c in per_expert]
        offsets = [0]
        for s in slabs:
            offsets.append(offsets[-1] + s)
        num_rows = int(config.recv_capacity)  # type: ignore[arg-type]
    else:
        offsets = [0]
        for c in per_expert:
            offsets.append(offsets[-1] + c)
        num_rows = offsets[-1]
    # Exchange (local_expert, token, slot) of every route: part of the dispatch payload.
    t = torch.div(send_route, k, rounding_mode="floor")
    s = send_route - t * k
    if idx is not None:
        local = idx.reshape(-1)[send_route] % el
    else:
        local = torch.zeros_like(send_route)
    meta_send = torch.stack([local, t, s], dim=1).to(torch.int32)
    parts = [meta_send] + (payload(send_route) if payload is not None else [])
    received = _exchange_parts(parts, send_route.numel(), send_counts, recv_counts, group, prims)
    meta_recv = received[0]
    src = torch.repeat_interleave(
        torch.arange(n, device=device, dtype=torch.int32), torch.tensor(recv_counts, device=device)
    )
    recv_meta = torch.stack([meta_recv[:, 0], src, meta_recv[:, 1], meta_recv[:, 2]], dim=1)
    order = torch.argsort(recv_meta[:, 0].to(torch.int64), stable=True)
    # buffer rows of the expert-major routes
    rv = int(sum(recv_counts))
    if config.static_layout:
        starts = torch.tensor(offsets[:-1], device=device, dtype=torch.int64)
        first = torch.tensor([sum(per_expert[:e]) for e in range(el)], device=device, dtype=torch.int64)
        le_sorted = recv_meta[order, 0].to(torch.int64)
        rows = starts[le_sorted] + (torch.arange(rv, device=device) - first[le_sorted])
    else:
        rows = torch.arange(rv, device=device, dtype=torch.int64)
    route_metadata = torch.full((num_rows, 4), -1, dtype=torch.int32, device=device)
    route_metadata[rows] = recv_meta[order]
    plan = Plan(rank=rank, num_ranks=n, num_tokens=num_tokens, num_topk=k, num_local_experts=el, send_route=send_route,
                send_counts=send_counts, recv_counts=recv_counts, recv_meta=recv_meta, order=order, rows=rows,
                num_rows=num_rows, tokens_per_expert=per_expert, expert_offsets=offsets, route_metadata=route_metadata,
                dense=not config.static_layout)
    return plan, received[1:]


def _pack(parts: Sequence[torch.Tensor], rows: int) -> Tuple[torch.Tensor, List[Tuple[torch.dtype, Tuple[int, ...], int]]]:
    """Concatenate per-row payload parts into one ``[rows, bytes] uint8`` tensor."""
    blobs, layout = [], []
    for p in parts:
        flat = p.contiguous().reshape(rows, _row_elems(p))
        b = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        blobs.append(b)
        layout.append((p.dtype, tuple(p.shape[1:]), b.shape[1]))
    return torch.cat(blobs, dim=1), layout


def pack_rows(parts: Sequence[torch.Tensor], rows: int) -> Tuple[torch.Tensor, List[Tuple[torch.dtype, Tuple[int, ...], int]]]:
    """Per-row payload parts (``[rows, ...]`` each) as one ``[rows, bytes] uint8``
    tensor, and the layout :func:`unpack_rows` takes."""
    return _pack(parts, rows)


def unpack_rows(blob: torch.Tensor, layout: List[Tuple[torch.dtype, Tuple[int, ...], int]]) -> List[torch.Tensor]:
    """The parts of a :func:`pack_rows` blob (any number of rows)."""
    return _unpack(blob, layout)


def _row_elems(p: torch.Tensor) -> int:
    n = 1
    for d in p.shape[1:]:
        n *= int(d)
    return n


def _unpack(blob: torch.Tensor, layout: List[Tuple[torch.dtype, Tuple[int, ...], int]]) -> List[torch.Tensor]:
    out, col = [], 0
    rows = blob.shape[0]
    for dtype, tail, width in layout:
        # A fresh dense copy: .contiguous() returns a one-row slice as it is (its row stride
        # is the blob's), and .view(dtype) then fails on an offset or width that is not a
        # multiple of the element size.
        piece = torch.empty((rows, width), dtype=torch.uint8, device=blob.device)
        piece.copy_(blob[:, col : col + width])
        col += width
        out.append(piece.view(dtype).reshape((rows,) + tail))
    return out


def _exchange_parts(
    parts: Sequence[torch.Tensor], rows: int, send_counts: List[int], recv_counts: List[int], group: Any,
    prims: Primitives,
) -> List[torch.Tensor]:
    """Per-row parts (``[rows, ...]`` each) to their ranks, one all-to-all of each
    part's bytes (no packing: nothing is copied into or out of a combined blob);
    returns the received parts, ``[sum(recv_counts), ...]`` each, in their dtypes."""
    if len(send_counts) == 1:
        return [p.contiguous() for p in parts]  # one rank: the rows stay where they are
    out = []
    for p in parts:
        flat = p.contiguous().reshape(rows, _row_elems(p))
        b = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        got = prims.all_to_all(b, send_counts, recv_counts, group)
        got = got if p.dtype == torch.uint8 else got.view(p.dtype)
        out.append(got.reshape((got.shape[0],) + tuple(p.shape[1:])))
    return out


def exchange(plan: Plan, parts: Sequence[torch.Tensor], group: Any, prims: Optional[Primitives] = None) -> List[torch.Tensor]:
    """Send per-route rows (send order) to their expert's rank; returns the
    received rows in received order. One all-to-all per part."""
    return _exchange_parts(parts, plan.send_route.numel(), plan.send_counts, plan.recv_counts, group, prims or TORCH)


def exchange_back(
    plan: Plan, parts: Sequence[torch.Tensor], group: Any, prims: Optional[Primitives] = None
) -> List[torch.Tensor]:
    """The reverse of :func:`exchange`: received-order rows back to their source
    rank, in send order."""
    rows = int(sum(plan.recv_counts))
    return _exchange_parts(parts, rows, plan.recv_counts, plan.send_counts, group, prims or TORCH)


# ----------------------------------------------------------------------------- experts


#: How the last GEMM with bfloat16 operands on CUDA ran in this process:
#: "grouped_mm" (torch._grouped_mm, float32 output), "mm_out_fp32" (one torch.mm
#: per expert with float32 output) or "fp32" (float32 matmuls); "reason" says why
#: a faster path was left.
GEMM_PATH: Dict[str, Any] = {"path": "", "reason": ""}
_GROUPED_OK = {"grouped_mm": hasattr(torch, "_grouped_mm"), "mm_out_fp32": True}


def _matmul_per_expert(x: torch.Tensor, w: torch.Tensor, offsets: List[int], counts: List[int]) -> torch.Tensor:
    """``x[slab_e] @ w[e]`` for every local expert; float32 accumulation and output.

    On CUDA with bfloat16 operands (exact copies of the spec's decoded values):
    one grouped GEMM (``torch._grouped_mm`` with float32 output) where this torch
    offers it, else one bf16 tensor-core GEMM per expert with float32 output
    (``torch.mm(..., out_dtype=torch.float32)``). Otherwise float32 matmuls per
    expert (TF32 is never used). :data:`GEMM_PATH` records the path taken.
    """
    out = torch.zeros((x.shape[0], w.shape[-1]), dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out
    bf16_cuda = x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
    if bf16_cuda and _GROUPED_OK["grouped_mm"]:
        # grouped_mm wants the groups packed: gather the valid rows, run, scatter back.
        rows = [r for o, c in zip(offsets[:-1], counts) for r in range(o, o + c)]
        idx = torch.tensor(rows, device=x.device, dtype=torch.int64)
        offs = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        try:
            out[idx] = torch._grouped_mm(x[idx], w, offs=offs, out_dtype=torch.float32)
            GEMM_PATH["path"] = "grouped_mm"
            return out
        except (RuntimeError, TypeError, AttributeError) as exc:  # e.g. no float32 output in this torch
            _GROUPED_OK["grouped_mm"] = False
            GEMM_PATH["reason"] = f"torch._grouped_mm: {type(exc).__name__}: {exc}"
    if bf16_cuda and _GROUPED_OK["mm_out_fp32"]:
        try:
            for e, (o, c) in enumerate(zip(offsets[:-1], counts)):
                if c:
                    out[o : o + c] = torch.mm(x[o : o + c], w[e], out_dtype=torch.float32)
            GEMM_PATH["path"] = "mm_out_fp32"
            return out
        except (RuntimeError, TypeError) as exc:
            _GROUPED_OK["mm_out_fp32"] = False
            GEMM_PATH["reason"] += f"; torch.mm(out_dtype=float32): {type(exc).__name__}: {exc}"
    xf, wf = x.float(), w.float()
    for e, (o, c) in enumerate(zip(offsets[:-1], counts)):
        if c:
            out[o : o + c] = xf[o : o + c] @ wf[e]
    if bf16_cuda:
        GEMM_PATH["path"] = "fp32"
    return out


def _silu_parts(g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    sig = torch.sigmoid(g)
    return sig, g * sig


def experts_forward(
    config: MoeEpConfig,
    plan: Plan,
    x: torch.Tensor,
    w: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU experts on the buffer rows. ``x`` ``[R, H]`` (float32, or bfloat16
    holding exact values), ``w`` ``[R]`` float32, weights decoded. Returns ``y``
    ``[R, H]`` float32 after the combine round trip and ``c`` ``[R, 2I]`` float32;
    padding rows zero."""
    i = config.intermediate
    counts, offsets = plan.tokens_per_expert, plan.expert_offsets
    c = _matmul_per_expert(x, fc1, offsets, counts)
    g, u = c[:, :i], c[:, i:]
    if config.gate_up_clamp is not None:
        lim = config.gate_up_clamp
        g, u = torch.clamp(g, max=lim), torch.clamp(u, -lim, lim)
    _, s = _silu_parts(g)
    h = s * u
    wc = w.unsqueeze(1)
    op = wc * h if config.apply_topk_in_fc1 else h
    op = TF.round_trip(op, config.intermediate_format)
    exact_bf16 = config.intermediate_format in (MoeFormat.BF16, MoeFormat.NVFP4) and fc2.dtype == torch.bfloat16
    z = _matmul_per_expert(op.to(torch.bfloat16) if exact_bf16 and op.is_cuda else op, fc2, offsets, counts)
    y = z if config.apply_topk_in_fc1 else wc * z
    y = TF.round_trip(y, config.combine_format)
    valid = plan.valid_rows.unsqueeze(1)
    return torch.where(valid, y, torch.zeros_like(y)), torch.where(valid, c, torch.zeros_like(c))


def _bf16_gemm(a: torch.Tensor, b: torch.Tensor, a_bf16: bool, b_bf16: bool) -> torch.Tensor:
    """``a @ b`` with float32 accumulation and output, for operands that hold bf16
    values (``a_bf16``/``b_bf16``: the tensor's values are all bf16 values, whatever
    its dtype). On CUDA, when both are, one bf16 tensor-core GEMM with float32
    output (``torch.mm(..., out_dtype=torch.float32)``) where this torch offers it;
    otherwise a float32 matmul on the exact values (TF32 is never used)."""
    if a.is_cuda and a_bf16 and b_bf16 and _GROUPED_OK["mm_out_fp32"] and a.dim() == 2:
        try:
            return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16), out_dtype=torch.float32)
        except (RuntimeError, TypeError) as exc:
            _GROUPED_OK["mm_out_fp32"] = False
            GEMM_PATH["reason"] += f"; torch.mm(out_dtype=float32): {type(exc).__name__}: {exc}"
    return a.float() @ b.float()


def experts_backward(config: MoeEpConfig, plan: Plan, x: torch.Tensor, w: torch.Tensor, fc1: torch.Tensor,
                     fc2: torch.Tensor, c: torch.Tensor,
                     dy: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec backward on the buffer rows: ``(dx [R, H], dw [R], dfc1, dfc2)``
    float32, padding rows zero. ``c`` is the decoded stash.

    With ``config.backward_operand_format`` bf16 (spec section 9.2) the cotangent
    rows, ``dc`` and ``w * h`` are rounded to bf16 (nearest even) and the GEMMs
    that take them (``dY W2^T``, ``x^T dc_b``, ``dc_b W1^T``, ``R(w h)^T dY_b``)
    run on the rounded values with float32 accumulation; on CUDA, where the other
    operand is bfloat16 too, as bf16 GEMMs with float32 output."""
    if config.backward_operand_format is not None:
        return _experts_backward_bf16(config, plan, x, w, fc1, fc2, c, dy)
    i, lim = config.intermediate, config.gate_up_clamp
    counts, offsets = plan.tokens_per_expert, plan.expert_offsets
    xf, w1, w2 = x.float(), fc1.float(), fc2.float()
    g_raw, u_raw = c[:, :i], c[:, i:]
    if lim is None:
        gate_mask = torch.ones_like(g_raw)
        up_mask = torch.ones_like(u_raw)
        g, u = g_raw, u_raw
    else:
        gate_mask = (g_raw <= lim).float()
        up_mask = ((u_raw >= -lim) & (u_raw <= lim)).float()
        g, u = torch.clamp(g_raw, max=lim), torch.clamp(u_raw, -lim, lim)
    sig, s = _silu_parts(g)
    h = s * u
    wc = w.unsqueeze(1)
    dx = torch.zeros_like(xf)
    dw = torch.zeros_like(w)
    dfc1 = torch.zeros_like(w1)
    dfc2 = torch.zeros_like(w2)
    for e, (o, cnt) in enumerate(zip(offsets[:-1], counts)):
        if not cnt:
            continue
        sl = slice(o, o + cnt)
        dye = dy[sl]
        dy_w2t = dye @ w2[e].T
        if config.apply_topk_in_fc1:
            dfc2[e] = (wc[sl] * h[sl]).T @ dye
            dw[sl] = (dy_w2t * h[sl]).sum(dim=1)
        else:
            dfc2[e] = h[sl].T @ (wc[sl] * dye)
            dw[sl] = (dye * (h[sl] @ w2[e])).sum(dim=1)
        dh = dy_w2t * wc[sl]
        dg = dh * u[sl] * sig[sl] * (1.0 + g[sl] * (1.0 - sig[sl])) * gate_mask[sl]
        du = dh * s[sl] * up_mask[sl]
        dc = torch.cat([dg, du], dim=1)
        dfc1[e] = xf[sl].T @ dc
        dx[sl] = dc @ w1[e].T
    return dx, dw, dfc1, dfc2


def _swiglu_backward_parts(config: MoeEpConfig, c: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """From the decoded stash: ``(g, u, sig, s, h, fg, fu)`` float32, with the
    clamp's masks folded into ``fg = u sig (1 + g (1 - sig)) m_g`` and ``fu = s m_u``."""
    i, lim = config.intermediate, config.gate_up_clamp
    g, u = c[:, :i], c[:, i:]
    if lim is None:
        gate_mask = up_mask = None
    else:
        gate_mask = (g <= lim).float()
        up_mask = ((u >= -lim) & (u <= lim)).float()
        g, u = torch.clamp(g, max=lim), torch.clamp(u, -lim, lim)
    sig, s = _silu_parts(g)
    h = s * u
    fg = u * sig * (1.0 + g * (1.0 - sig))
    fu = s
    if gate_mask is not None:
        fg, fu = fg * gate_mask, fu * up_mask
    return g, u, sig, s, h, fg, fu


def _experts_backward_bf16(config: MoeEpConfig, plan: Plan, x: torch.Tensor, w: torch.Tensor, fc1: torch.Tensor,
                           fc2: torch.Tensor, c: torch.Tensor,
                           dy: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`experts_backward` with ``backward_operand_format`` bf16."""
    counts, offsets = plan.tokens_per_expert, plan.expert_offsets
    x_bf16, w1_bf16, w2_bf16 = (t.dtype == torch.bfloat16 for t in (x, fc1, fc2))
    xf, w1, w2 = x.float(), fc1.float(), fc2.float()
    _, _, _, _, h, fg, fu = _swiglu_backward_parts(config, c.float())
    dy_b = dy.to(torch.bfloat16).float()  # dY_b = R_bf16(dY), exact for a bf16 cotangent
    wc = w.unsqueeze(1)
    wh_b = (wc * h).to(torch.bfloat16).float()  # R_bf16(w h), both placements
    dx = torch.zeros_like(xf)
    dw = torch.zeros_like(w)
    dfc1 = torch.zeros_like(w1)
    dfc2 = torch.zeros_like(w2)
    for e, (o, cnt) in enumerate(zip(offsets[:-1], counts)):
        if not cnt:
            continue
        sl = slice(o, o + cnt)
        dye = dy_b[sl]
        a = _bf16_gemm(dye, w2[e].T, True, w2_bf16)  # dY_b W2^T  [n, I]
        dfc2[e] = _bf16_gemm(wh_b[sl].T, dye, True, True)
        if config.apply_topk_in_fc1:
            dw[sl] = (a * h[sl]).sum(dim=1)
        else:
            dw[sl] = (dye * (h[sl] @ w2[e])).sum(dim=1)
        dh = a * wc[sl]
        dc_b = torch.cat([dh * fg[sl], dh * fu[sl]], dim=1).to(torch.bfloat16).float()  # dc_b = R_bf16(dc)
        dfc1[e] = _bf16_gemm(xf[sl].T, dc_b, x_bf16, True)
        dx[sl] = _bf16_gemm(dc_b, w1[e].T, True, w1_bf16)
    return dx, dw, dfc1, dfc2


def to_buffer(plan: Plan, recv_rows: torch.Tensor) -> torch.Tensor:
    """Received-order rows into the expert-major buffer (padding rows zero)."""
    if plan.dense:
        return recv_rows[plan.order]  # one gather: buffer row i is expert-major route i
    out = torch.zeros((plan.num_rows,) + tuple(recv_rows.shape[1:]), dtype=recv_rows.dtype, device=recv_rows.device)
    out[plan.rows] = recv_rows[plan.order]
    return out


def from_buffer(plan: Plan, buf: torch.Tensor) -> torch.Tensor:
    """Expert-major buffer rows back to received order (padding never read)."""
    out = torch.empty((plan.order.numel(),) + tuple(buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    out[plan.order] = buf if plan.dense else buf[plan.rows]
    return out


def to_slots(plan: Plan, send_rows: torch.Tensor) -> torch.Tensor:
    """Send-order rows to ``[T, K, ...]`` by (token, slot); unused slots zero."""
    out = torch.zeros(
        (plan.num_tokens * plan.num_topk,) + tuple(send_rows.shape[1:]), dtype=send_rows.dtype, device=send_rows.device
    )
    out[plan.send_route] = send_rows
    return out.reshape((plan.num_tokens, plan.num_topk) + tuple(send_rows.shape[1:]))


def sum_slots(per_slot: torch.Tensor) -> torch.Tensor:
    """Form-A reduction: float32 sum over slots, in slot order."""
    acc = torch.zeros((per_slot.shape[0],) + tuple(per_slot.shape[2:]), dtype=torch.float32, device=per_slot.device)
    for k in range(per_slot.shape[1]):
        acc = acc + per_slot[:, k].float()
    return acc


def encode_output(config: MoeEpConfig, values: torch.Tensor) -> Any:
    """The final encode of ``[T, H]`` float32 in ``output_format``."""
    if config.output_format is MoeFormat.BF16:
        return values.to(torch.bfloat16)
    return TF.quantize(values, config.output_format)


def gather_rows(t: Any, index: torch.Tensor) -> List[torch.Tensor]:
    """The payload parts of token rows ``index`` (plain: one tensor; block-scaled: data and scale)."""
    if isinstance(t, TF.TorchBlockScaled):
        data, scale = TF.raw(t)
        return [data[index], scale[index]]
    return [t[index]]


def rebuild(t: Any, parts: List[torch.Tensor]) -> Any:
    """The tokens' encoding around moved parts (uint8 codes for block-scaled)."""
    if isinstance(t, TF.TorchBlockScaled):
        return TF.from_raw(parts[0], parts[1], t.format, t.n)
    return parts[0]


def buffer_tokens(plan: Plan, t: Any, recv_parts: List[torch.Tensor]) -> Any:
    """Received token parts into the expert-major buffer, in the tokens' encoding."""
    return rebuild(t, [to_buffer(plan, p) for p in recv_parts])


def cotangent(grad_output: torch.Tensor) -> torch.Tensor:
    """The output cotangent as it travels to the experts: bfloat16 stays bfloat16
    (exact, half the bytes; the expert backward reads it as is), anything else
    becomes float32."""
    return grad_output if grad_output.dtype == torch.bfloat16 else grad_output.float()


def route_payload(activation: Any, topk_weights: torch.Tensor, num_topk: int, extra: Sequence[torch.Tensor] = ()):
    """A payload function for :func:`make_plan`: token rows, router weight and
    any extra per-token rows (e.g. the output cotangent) of every route."""

    def build(send_route: torch.Tensor) -> List[torch.Tensor]:
        token_index = torch.div(send_route, num_topk, rounding_mode="floor")
        weights = topk_weights.float().reshape(-1)[send_route]
        return gather_rows(activation, token_index) + [weights] + [e[token_index] for e in extra]

    return build


def forward(
    config: MoeEpConfig,
    plan: Plan,
    recv: List[torch.Tensor],
    activation: Any,
    fc1: Any,
    fc2: Any,
    group: Any,
    prims: Optional[Primitives] = None,
) -> Dict[str, Any]:
    """The fused forward of one rank, given its plan and the received payload
    of :func:`route_payload` (token parts, then weights)."""
    prims = prims or TORCH
    w_buf = to_buffer(plan, recv[-1])
    x_buf, fc1_d, fc2_d = prims.forward_operands(activation, buffer_tokens(plan, activation, recv[:-1]), fc1, fc2)
    y, c = prims.experts_forward(config, plan, x_buf, w_buf, fc1_d, fc2_d)
    (back,) = exchange_back(plan, [from_buffer(plan, y)], group, prims)
    out = prims.encode_output(config, prims.sum_slots(plan, back))
    return {"output": out, "fc1_c": c.to(torch.bfloat16), "route_metadata": plan.route_metadata}


def backward(
    config: MoeEpConfig,
    plan: Plan,
    recv: List[torch.Tensor],
    activation: Any,
    fc1: Any,
    fc2: Any,
    fc1_c: torch.Tensor,
    group: Any,
    prims: Optional[Primitives] = None,
) -> Dict[str, torch.Tensor]:
    """The spec backward of one rank, given its plan, the received payload of
    :func:`route_payload` with the output cotangent as extra, and the stash
    (``fc1_c`` bfloat16)."""
    prims = prims or TORCH
    w_buf = to_buffer(plan, recv[-2])
    dy_buf = to_buffer(plan, recv[-1])
    x_buf, fc1_d, fc2_d = prims.forward_operands(activation, buffer_tokens(plan, activation, recv[:-2]), fc1, fc2)
    dx, dw, dfc1, dfc2 = prims.experts_backward(config, plan, x_buf, w_buf, fc1_d, fc2_d, fc1_c, dy_buf)
    dx_back, dw_back = exchange_back(plan, [from_buffer(plan, dx), from_buffer(plan, dw)], group, prims)
    return {
        "grad_activation": prims.sum_slots(plan, dx_back),
        "grad_fc1_weight": dfc1,
        "grad_fc2_weight": dfc2,
        "grad_topk_weights": to_slots(plan, dw_back),
    }


#: The torch backend's primitives.
TORCH = Primitives()
