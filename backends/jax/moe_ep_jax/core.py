"""One rank's MoeEp in JAX, written once: routing plan, exchange, expert-major layout.

Everything here runs inside ``jax.shard_map`` over one mesh axis (the EP axis,
``LayerSpec.axis_name``), with static shapes: ``T`` tokens per rank (the
shard's extent; callers pad ranks with fewer tokens with ``-1`` slots) and a
receive buffer of ``C`` rows (``recv_capacity``, or the worst case
``num_ranks * T * num_topk`` for the dynamic layout).

Collectives, and nothing else:

- the plan: one ``all_gather`` of a tiny ``[E + 1] int32`` vector per rank (its
  routes per global expert and an input-error flag). From the gathered table
  every rank knows every send and receive count, every destination's
  expert-major slab offsets and whether any rank's input is bad or any
  destination overflows its capacity, without a host round trip;
- every payload: ONE all-to-all per direction, of byte-packed rows (tokens in
  their own encoding, router weights, route ids; or expert outputs in the
  combine format; or gradients). At one rank (``num_ranks == 1``) nothing moves
  between devices: either exchange is a local permutation, done as one gather
  per part straight from its rows (no packing, no all-to-all, so ``ragged``
  compiles on XLA:CPU there too), with the same buffers bit for bit.

Two interchangeable exchanges move the payload (``LayerSpec.exchange``):

``ragged``
    ``jax.lax.ragged_all_to_all`` with one chunk per (destination, local expert):
    rows land directly at their final expert-major position on the receiver
    (local expert, then source rank, then source token and slot). GPU/TPU only:
    XLA:CPU does not implement it.
``capacity``
    ``jax.lax.all_to_all`` of ``[num_ranks, P, bytes]`` buffers with a fixed
    per-peer capacity ``P = min(T * num_topk, C)`` (always enough), then a local
    scatter into the expert-major buffer. Runs on every platform.

Both produce identical buffers, bit for bit (and so does the one-rank gather).

Data-dependent errors cannot raise inside ``jit``: an expert id outside
``[-1, num_experts)`` on any rank, or an aligned receive count above ``C`` on
any rank, sets the plan's error flag on every rank (the table is global), moves
nothing, and turns every rank's outputs and gradients to NaN. The world-level
backend checks both on the host first and raises the spec's errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

from .devices import prepare_environment as _prepare_environment

_prepare_environment()  # XLA_FLAGS must ask for enough CPU devices before jax's first import

import jax
import jax.numpy as jnp
from jax import lax

from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.formats import MoeFormat

from . import formats as F
from .kernels import DEFAULT_KERNELS

__all__ = ["EXCHANGES", "LayerSpec", "Plan", "Layout", "make_plan", "layout", "to_experts", "to_sources", "forward",
           "backward_from_buffers", "slot_sum"]

#: The exchange implementations.
EXCHANGES = ("ragged", "capacity")

Tensor = Union[jax.Array, F.BlockScaled]
_I32 = jnp.int32


@dataclass(frozen=True)
class LayerSpec:
    """The static description of one rank's computation (hashable: it is a
    ``nondiff_argnums`` argument of the custom_vjp functions).

    Attributes:
        config: the layer.
        axis_name: the mesh axis the ranks live on.
        num_tokens: T, the per-rank token rows (static shard extent).
        capacity: C, rows of the receive buffer.
        exchange: ``ragged`` or ``capacity``.
        kernels: the :class:`~moe_ep_jax.kernels.ExpertKernels` provider.
    """

    config: MoeEpConfig
    axis_name: str
    num_tokens: int
    capacity: int
    exchange: str
    kernels: Any

    @property
    def num_ranks(self) -> int:
        return self.config.num_ranks

    @property
    def num_topk(self) -> int:
        return self.config.num_topk

    @property
    def num_local_experts(self) -> int:
        return self.config.num_local_experts

    @property
    def num_routes(self) -> int:
        """T * K: the (token, slot) pairs of one rank."""
        return self.num_tokens * self.num_topk

    @property
    def peer_capacity(self) -> int:
        """P: rows per peer of the capacity exchange (one source sends at most
        T * K routes anywhere, and a destination holds at most C)."""
        return max(1, min(self.num_routes, self.capacity))


def _kernels(spec: LayerSpec) -> Any:
    """The spec's kernel provider; the default one when it has none (a
    placeholder spec, e.g. a handle rebuilt on the host before its provider is set)."""
    return DEFAULT_KERNELS if spec.kernels is None else spec.kernels


def buffer_rows(config: MoeEpConfig, num_tokens: int) -> int:
    """C for ``config`` with ``num_tokens`` rows per rank: ``recv_capacity`` in
    the static layout, else the worst case ``num_ranks * T * num_topk`` (at least 1)."""
    if config.recv_capacity is not None:
        return int(config.recv_capacity)
    return max(1, config.num_ranks * num_tokens * config.num_topk)


# ----------------------------------------------------------------------------- the plan


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Plan:
    """One rank's routing state (every leaf an array; lives in the handle and in
    the custom_vjp residuals).

    Attributes:
        send_route: ``[T*K] int32``: route ids ``token * K + slot`` sorted by
            (global expert, route id): the send order. The first
            ``sum(counts)`` entries are routes; the rest are -1 slots (never sent).
        route_pos: ``[T*K] int32``: the send position of every route id, -1 for
            a slot that is not sent (-1 expert id, or an invalid one).
        route_expert: ``[T*K] int32``: the global expert of every route id, -1
            when it is not sent.
        table: ``[num_ranks, E + 1] int32``: row s = source rank s's routes per
            global expert, then its input-error flag (1: an expert id outside
            ``[-1, E)``). The same on every rank.
    """

    send_route: jax.Array
    route_pos: jax.Array
    route_expert: jax.Array
    table: jax.Array


class Layout(NamedTuple):
    """Quantities derived from a :class:`Plan` (recomputed where needed; cheap)."""

    me: jax.Array  # [] int32: this rank
    my_counts: jax.Array  # [E]: my routes per global expert
    send_first: jax.Array  # [E]: send position of my first route to each global expert
    dest_count: jax.Array  # [n]: my routes per destination rank
    dest_first: jax.Array  # [n]: send position of my first route to each destination
    recv_counts: jax.Array  # [n, El]: routes from each source to each of my local experts
    src_prefix_me: jax.Array  # [n, El]: routes to my expert e from sources < s
    offsets: jax.Array  # [El + 1]: my slab starts (aligned), then the end of the last slab
    tokens_per_expert: jax.Array  # [El]
    group_sizes: jax.Array  # [El]: my slab sizes (alignment padding included), cut at the buffer's end
    my_base: jax.Array  # [E]: where my first route to each global expert lands on its rank
    send_first_all: jax.Array  # [n, E]: every source's send position of its first route per expert
    error: jax.Array  # [] bool: a bad expert id on some rank, or some rank overflows C


def make_plan(spec: LayerSpec, topk_idx: jax.Array) -> Plan:
    """Plan this rank's routes (collective: one all-gather of ``[E + 1] int32``).

    Args:
        topk_idx: ``[T, K]`` int: expert ids; -1 marks an unused slot. Ids
            outside ``[-1, E)`` are not routed and set the error flag.

    The local part (sort, positions, counts) is the kernel provider's
    :meth:`~moe_ep_jax.kernels.ExpertKernels.plan_routes`.
    """
    e = spec.config.num_experts
    local = _kernels(spec).plan_routes(spec.config, topk_idx.astype(_I32))
    mine = jnp.concatenate([local.counts[:e], (local.counts[e] > 0).astype(_I32)[None]])
    table = lax.all_gather(mine, spec.axis_name)
    return Plan(send_route=local.send_route, route_pos=local.route_pos, route_expert=local.route_expert, table=table)


def _excl_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def layout(spec: LayerSpec, plan: Plan) -> Layout:
    """Everything the exchanges and the buffer need, from the gathered table."""
    n, el, cap = spec.num_ranks, spec.num_local_experts, spec.capacity
    align = spec.config.expert_alignment
    e = n * el
    me = lax.axis_index(spec.axis_name).astype(_I32)
    counts = plan.table[:, :e]  # [n, E]
    flags = plan.table[:, e]
    my_counts = counts[me]
    send_first = _excl_cumsum(my_counts)
    per_dest = my_counts.reshape(n, el).sum(axis=1)
    tot = counts.sum(axis=0).reshape(n, el)  # [dest, local expert]
    slabs = -(-tot // align) * align
    ends = jnp.cumsum(slabs, axis=1)
    offsets_all = jnp.concatenate([jnp.zeros((n, 1), _I32), ends], axis=1)  # [n, El + 1]
    overflow = jnp.any(ends[:, -1] > cap)
    error = overflow | jnp.any(flags > 0)
    src_prefix = _excl_cumsum(counts, axis=0)  # [n, E]: over sources
    recv_counts = lax.dynamic_slice_in_dim(counts, me * el, el, axis=1)
    src_prefix_me = lax.dynamic_slice_in_dim(src_prefix, me * el, el, axis=1)
    my_base = offsets_all[:, :el].reshape(e) + src_prefix[me]
    offsets = offsets_all[me]
    # The slabs the kernels see end at the buffer: on an overflow (error, every
    # result poisoned with NaN) the last ones are cut, so every provider gets
    # sizes >= 0 that sum to at most the buffer rows.
    fit = jnp.minimum(ends[me], cap)
    group_sizes = jnp.diff(fit, prepend=jnp.zeros((1,), fit.dtype)).astype(_I32)
    return Layout(
        me=me,
        my_counts=my_counts,
        send_first=send_first,
        dest_count=per_dest,
        dest_first=_excl_cumsum(per_dest),
        recv_counts=recv_counts,
        src_prefix_me=src_prefix_me,
        offsets=offsets,
        tokens_per_expert=tot[me],
        group_sizes=group_sizes,
        my_base=my_base,
        send_first_all=_excl_cumsum(counts, axis=1),
        error=error,
    )


def valid_rows(spec: LayerSpec, lay: Layout) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """``([C] bool valid, [C] int32 local expert, [C] int32 row within the slab)``."""
    el = spec.num_local_experts
    i = jnp.arange(spec.capacity, dtype=_I32)
    e = jnp.sum(lay.offsets[1:][None, :] <= i[:, None], axis=1).astype(_I32)
    ec = jnp.minimum(e, el - 1)
    j = i - lay.offsets[ec]
    return (e < el) & (j < lay.tokens_per_expert[ec]), ec, j


def route_metadata(spec: LayerSpec, lay: Layout, recv_route: jax.Array) -> jax.Array:
    """``[C, 4] int32`` ``(local_expert, src_rank, src_token, src_slot)`` of every
    buffer row, -1 rows for padding. ``recv_route``: ``[C]`` received route ids."""
    valid, e, j = valid_rows(spec, lay)
    cum_src = jnp.cumsum(lay.recv_counts, axis=0)  # [n, El]
    src = jnp.sum(cum_src[:, e].T <= j[:, None], axis=1).astype(_I32)
    k = spec.num_topk
    meta = jnp.stack([e, src, recv_route // k, recv_route % k], axis=1)
    return jnp.where(valid[:, None], meta, -1)


# ----------------------------------------------------------------------------- payload packing

_Part = Tuple[Any, Tuple[int, ...], int]


def _pack(parts: Sequence[jax.Array]) -> Tuple[jax.Array, List[_Part]]:
    """Per-row parts ``[rows, ...]`` -> one ``[rows, bytes] uint8`` array."""
    rows = parts[0].shape[0]
    blobs, spec = [], []
    for p in parts:
        b = p if p.dtype == jnp.uint8 else lax.bitcast_convert_type(p, jnp.uint8)
        b = b.reshape(rows, -1)
        blobs.append(b)
        spec.append((p.dtype, tuple(p.shape[1:]), b.shape[1]))
    return jnp.concatenate(blobs, axis=1), spec


def _unpack(blob: jax.Array, spec: List[_Part]) -> List[jax.Array]:
    out, col = [], 0
    rows = blob.shape[0]
    for dtype, tail, width in spec:
        piece = blob[:, col : col + width]
        col += width
        itemsize = jnp.dtype(dtype).itemsize
        if itemsize == 1:
            piece = piece.reshape((rows,) + tail)
            out.append(piece if dtype == jnp.uint8 else lax.bitcast_convert_type(piece, dtype))
        else:
            out.append(lax.bitcast_convert_type(piece.reshape((rows,) + tail + (itemsize,)), dtype))
    return out


def tensor_parts(t: Tensor) -> List[jax.Array]:
    """The row arrays of a token tensor (plain: itself; block-scaled: data, scale)."""
    if isinstance(t, F.BlockScaled):
        return [t.data, t.scale]
    return [t]


def rebuild(like: Tensor, parts: Sequence[jax.Array]) -> Tensor:
    if isinstance(like, F.BlockScaled):
        return F.BlockScaled(parts[0], parts[1], like.format, like.n, like.axis)
    return parts[0]


# ----------------------------------------------------------------------------- the exchanges


def _recv_rows(spec: LayerSpec, lay: Layout) -> Tuple[jax.Array, jax.Array]:
    """Capacity exchange: the buffer row of every received slot ``(s, q)``
    (``[n, P] int32``, ``C`` where the slot carries nothing) and its validity."""
    el, p = spec.num_local_experts, spec.peer_capacity
    q = jnp.arange(p, dtype=_I32)
    rc = lay.recv_counts  # [n, El]
    rc_cum = jnp.cumsum(rc, axis=1)
    e = jnp.sum(rc_cum[:, None, :] <= q[None, :, None], axis=2).astype(_I32)  # [n, P]
    valid = e < el
    ec = jnp.minimum(e, el - 1)
    start = jnp.take_along_axis(rc_cum - rc, ec, axis=1)
    prefix = jnp.take_along_axis(lay.src_prefix_me, ec, axis=1)
    row = lay.offsets[ec] + prefix + q[None, :] - start
    valid = valid & (row < spec.capacity) & ~lay.error
    return jnp.where(valid, row, spec.capacity), valid


def _varying(x: jax.Array, axis_name: str) -> jax.Array:
    """Type a rank-local buffer as varying over the EP axis (under ``check_vma``
    a fresh ``zeros`` is invariant, and ``ragged_all_to_all``'s result takes the
    type of its ``output`` operand although every rank receives other rows)."""
    pcast = getattr(lax, "pcast", None)
    if pcast is not None:
        try:
            return pcast(x, axis_name, to="varying")
        except (TypeError, ValueError, NameError):  # already varying, or check_vma off
            return x
    pvary = getattr(lax, "pvary", None)
    return pvary(x, axis_name) if pvary is not None else x


def _a2a(x: jax.Array, axis_name: str) -> jax.Array:
    return lax.all_to_all(x, axis_name, 0, 0, tiled=False)


def _ragged_to_experts_args(lay: Layout) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``ragged_all_to_all``'s ``(input_offsets, send_sizes, output_offsets,
    recv_sizes)`` for :func:`to_experts`, each ``[E] int32``: one chunk per
    (destination, local expert); nothing moves on an error."""
    ok = ~lay.error
    send_sizes = jnp.where(ok, lay.my_counts, 0)
    recv_sizes = jnp.where(ok, lay.recv_counts.reshape(-1), 0)
    return lay.send_first, send_sizes, lay.my_base, recv_sizes


def _ragged_to_sources_args(spec: LayerSpec, lay: Layout) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``ragged_all_to_all``'s ``(input_offsets, send_sizes, output_offsets,
    recv_sizes)`` for :func:`to_sources`, each ``[E] int32``: one chunk per
    (source, local expert), landing at the source's send positions."""
    el = spec.num_local_experts
    ok = ~lay.error
    input_offsets = (lay.offsets[:el][None, :] + lay.src_prefix_me).reshape(-1)
    send_sizes = jnp.where(ok, lay.recv_counts.reshape(-1), 0)
    output_offsets = lax.dynamic_slice_in_dim(lay.send_first_all, lay.me * el, el, axis=1).reshape(-1)
    recv_sizes = jnp.where(ok, lay.my_counts, 0)
    return input_offsets, send_sizes, output_offsets, recv_sizes


def to_experts(spec: LayerSpec, plan: Plan, lay: Layout, parts: Sequence[jax.Array]) -> List[jax.Array]:
    """Move per-route rows to their expert's rank (collective: one all-to-all;
    at one rank a local gather).

    Args:
        parts: arrays ``[T*K, ...]`` indexed by SEND POSITION (row ``p`` belongs
            to route ``plan.send_route[p]``); rows past the routes are ignored.

    Returns:
        the same parts as ``[C, ...]`` expert-major buffers; padding rows zero
        (all bits zero), every row zero on an error.
    """
    if spec.num_ranks == 1:
        return _to_experts_local(spec, lay, parts)
    return _to_experts_exchange(spec, plan, lay, parts)


def _to_experts_exchange(spec: LayerSpec, plan: Plan, lay: Layout, parts: Sequence[jax.Array]) -> List[jax.Array]:
    """:func:`to_experts` through ``spec.exchange`` (any rank count)."""
    blob, pspec = _pack(parts)
    cap = spec.capacity
    width = blob.shape[1]
    if spec.exchange == "ragged":
        out = _varying(jnp.zeros((cap, width), jnp.uint8), spec.axis_name)
        buf = lax.ragged_all_to_all(blob, out, *_ragged_to_experts_args(lay), axis_name=spec.axis_name)
    else:
        n, p, tk = spec.num_ranks, spec.peer_capacity, spec.num_routes
        q = jnp.arange(p, dtype=_I32)
        src = lay.dest_first[:, None] + q[None, :]
        ok = (q[None, :] < lay.dest_count[:, None]) & ~lay.error
        send = jnp.where(ok[..., None], blob[jnp.clip(src, 0, max(tk - 1, 0))], 0).astype(jnp.uint8)
        recv = _a2a(send, spec.axis_name)
        rows, _ = _recv_rows(spec, lay)
        buf = jnp.zeros((cap, width), jnp.uint8).at[rows.reshape(-1)].set(
            recv.reshape(n * p, width), mode="drop", unique_indices=True
        )
    return _unpack(buf, pspec)


def to_sources(spec: LayerSpec, plan: Plan, lay: Layout, parts: Sequence[jax.Array]) -> List[jax.Array]:
    """The reverse of :func:`to_experts` (collective: one all-to-all; at one
    rank a local gather).

    Args:
        parts: ``[C, ...]`` buffers (padding rows are never read).

    Returns:
        the parts as ``[T*K, ...]`` indexed by ROUTE ID ``token * K + slot``;
        rows of slots without a route are zero (all bits zero), every row zero
        on an error.
    """
    if spec.num_ranks == 1:
        return _to_sources_local(spec, plan, lay, parts)
    return _to_sources_exchange(spec, plan, lay, parts)


def _to_sources_exchange(spec: LayerSpec, plan: Plan, lay: Layout, parts: Sequence[jax.Array]) -> List[jax.Array]:
    """:func:`to_sources` through ``spec.exchange`` (any rank count)."""
    blob, pspec = _pack(parts)
    el = spec.num_local_experts
    tk = spec.num_routes
    width = blob.shape[1]
    sent = plan.route_pos >= 0
    if spec.exchange == "ragged":
        out = _varying(jnp.zeros((max(tk, 1), width), jnp.uint8), spec.axis_name)
        back = lax.ragged_all_to_all(blob, out, *_ragged_to_sources_args(spec, lay), axis_name=spec.axis_name)
        rows = back[jnp.clip(plan.route_pos, 0, max(tk - 1, 0))]
    else:
        n, p = spec.num_ranks, spec.peer_capacity
        recv_row, valid = _recv_rows(spec, lay)
        send = jnp.where(valid[..., None], blob[jnp.clip(recv_row, 0, spec.capacity - 1)], 0).astype(jnp.uint8)
        back = _a2a(send, spec.axis_name).reshape(n * p, width)  # [d * P + q]: d's answer to my q-th route to d
        dest = jnp.maximum(plan.route_expert, 0) // el
        q = plan.route_pos - lay.dest_first[dest]
        rows = back[jnp.clip(dest * p + q, 0, n * p - 1)]
    rows = jnp.where(sent[:, None], rows, 0).astype(jnp.uint8)
    return _unpack(rows, pspec)


# ----------------------------------------------------------------------------- one rank: local gathers
#
# With one rank layout() has no earlier source (src_prefix == 0), so my_base ==
# offsets[:El] and send_first_all[0] == send_first: row j of local expert e's
# slab is send position send_first[e] + j, in both directions. Both exchanges
# write exactly these rows and leave the others (every row, on an error) zero.


def _as_bits(x: jax.Array) -> jax.Array:
    """``x`` viewed as unsigned integers of its width (bool stays bool). XLA:CPU
    widens bfloat16 gathers and selects to float32 and back, which quiets NaN
    payloads; on integers every platform copies bits."""
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return x
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _gather_rows(x: jax.Array, idx: jax.Array, keep: jax.Array) -> jax.Array:
    """``[len(idx), ...] x.dtype``: ``x[idx]`` where ``keep``, all-zero bits
    elsewhere (not ``jnp.zeros``: float8_e8m0fnu has no zero, 0 converts to its NaN 0xFF).

    Args:
        x: ``[rows, ...]`` any dtype (bits are copied, never converted).
        idx: ``[M] int32``: row indices; only those where ``keep`` need be in range.
        keep: ``[M] bool``.
    """
    u = _as_bits(x)
    if u.shape[0] == 0:  # nothing to read (no routes): one zero row keeps the gather well-formed
        u = jnp.zeros((1,) + u.shape[1:], u.dtype)
    safe = jnp.clip(idx, 0, u.shape[0] - 1)
    rows = jnp.take(u, safe, axis=0, mode="clip")
    rows = jnp.where(keep.reshape(keep.shape + (1,) * (u.ndim - 1)), rows, jnp.zeros((), u.dtype))
    return rows if rows.dtype == x.dtype else lax.bitcast_convert_type(rows, x.dtype)


def _to_experts_local(spec: LayerSpec, lay: Layout, parts: Sequence[jax.Array]) -> List[jax.Array]:
    """:func:`to_experts` at one rank: buffer row r of local expert e's slab,
    row j, is send position ``send_first[e] + j``."""
    valid, e, j = valid_rows(spec, lay)
    src = lay.send_first[e] + j
    keep = valid & ~lay.error
    return [_gather_rows(p, src, keep) for p in parts]


def _to_sources_local(spec: LayerSpec, plan: Plan, lay: Layout, parts: Sequence[jax.Array]) -> List[jax.Array]:
    """:func:`to_sources` at one rank: a route at send position p to expert e
    reads buffer row ``offsets[e] + p - send_first[e]``."""
    rows = _local_rows(spec, plan, lay)
    return [_local_gather(spec, p, rows, 1) for p in parts]


def _local_rows(spec: LayerSpec, plan: Plan, lay: Layout) -> jax.Array:
    """``[T*K] int32``: at one rank, the buffer row of every route id (a route at send
    position p to expert e is row ``offsets[e] + p - send_first[e]``), -1 for slots
    without a route and for every slot on an error."""
    e = jnp.clip(plan.route_expert, 0, spec.num_local_experts - 1)
    row = lay.offsets[e] + plan.route_pos - lay.send_first[e]
    keep = (plan.route_pos >= 0) & ~lay.error
    return jnp.where(keep, row, -1)


def _local_gather(spec: LayerSpec, x: jax.Array, route: jax.Array, num_topk: int) -> jax.Array:
    """``[M, ...] x.dtype``: row ``i`` is ``x[route[i] // num_topk]``, all-zero bits where
    ``route[i]`` is -1 (every other id in ``[0, x.shape[0] * num_topk)``): bits copied.
    The kernel provider's ``gather_rows`` when it has one (a native row copy: XLA's
    gather fusions recompute the row index for every element), else XLA's gather.

    Args:
        x: ``[rows, ...]`` any dtype.
        route: ``[M] int32``.
    """
    native = getattr(_kernels(spec), "gather_rows", None)
    if native is not None:
        return native(x, route, num_topk)
    return gather_route_rows(x, route, num_topk)


def gather_route_rows(x: jax.Array, route: jax.Array, num_topk: int) -> jax.Array:
    """XLA's gather of what a provider's ``gather_rows`` returns: ``[M, ...] x.dtype``,
    row ``i`` is ``x[route[i] // num_topk]``, all-zero bits where ``route[i]`` is -1."""
    return _gather_rows(x, route // num_topk, route >= 0)


# ----------------------------------------------------------------------------- the layer


def send_rows(spec: LayerSpec, plan: Plan, per_token: Sequence[jax.Array]) -> List[jax.Array]:
    """Rows of per-token arrays ``[T, ...]`` in send order ``[T*K, ...]``."""
    token = plan.send_route // spec.num_topk
    return [a[token] for a in per_token]


def route_weights(spec: LayerSpec, plan: Plan, topk_weights: jax.Array) -> jax.Array:
    """``[T*K] float32``: the router weight of every send position (read as float32)."""
    return topk_weights.astype(jnp.float32).reshape(-1)[plan.send_route]


def slot_sum(spec: LayerSpec, rows: jax.Array) -> jax.Array:
    """Form-A reduction: ``[T*K, H]`` rows by route id -> ``[T, H]`` float32,
    summed in slot order from +0 (a slot without a route adds an exact 0; the
    caller zeroes those rows). The kernel provider's
    :meth:`~moe_ep_jax.kernels.ExpertKernels.slot_sum`."""
    return _kernels(spec).slot_sum(rows.astype(jnp.float32), spec.num_tokens, spec.num_topk)


def encode_output(spec: LayerSpec, values: jax.Array) -> Tensor:
    """The final ``[T, H]`` encode in ``output_format`` (the only rounding of the sum)."""
    fmt = spec.config.output_format
    if fmt is MoeFormat.BF16:
        return F.round_to_bf16(values)
    return spec.kernels.quantize(values, fmt)


def poison(error: jax.Array, x: jax.Array) -> jax.Array:
    """NaN everywhere when ``error`` (a data-dependent input error inside jit), in ``x``'s
    floating dtype (a bf16 weight gradient stays bf16: no float32 copy of it)."""
    return jnp.where(error, jnp.asarray(jnp.nan, x.dtype), x)


def combine_rows(spec: LayerSpec, plan: Plan, lay: Layout, y: jax.Array) -> Tuple[Tensor, jax.Array]:
    """Combine of ``[C, H] float32`` expert outputs: per-row ``combine_format``
    round trip (the rows travel ENCODED: bf16, or mxfp8/nvfp4 codes and
    scales), return, slot-order sum, output encode. Returns the ``[T, H]``
    output and the unrounded sum."""
    kern = spec.kernels
    fmt = spec.config.combine_format
    reduce_rows = getattr(kern, "reduce_rows", None)
    if spec.num_ranks == 1 and fmt is MoeFormat.BF16 and reduce_rows is not None:
        return _combine_rows_local_bf16(spec, plan, lay, y, reduce_rows)
    valid, _, _ = valid_rows(spec, lay)
    y = jnp.where(valid[:, None], y, 0.0)
    enc = F.round_to_bf16(y) if fmt is MoeFormat.BF16 else kern.quantize(y, fmt)
    back = to_sources(spec, plan, lay, tensor_parts(enc))
    dec = kern.dequantize(rebuild(enc, back))
    dec = jnp.where((plan.route_pos >= 0)[:, None], dec, 0.0)
    summed = poison(lay.error, slot_sum(spec, dec))
    return encode_output(spec, summed), summed


def _combine_rows_local_bf16(spec: LayerSpec, plan: Plan, lay: Layout, y: jax.Array, reduce_rows: Any
                             ) -> Tuple[Tensor, jax.Array]:
    """:func:`combine_rows` at one rank with a bf16 combine format and a provider that sums
    rows by index (``reduce_rows``): every route reads its row's bf16 round trip straight
    from the buffer, summed in slot order from +0. A slot without a route adds nothing
    where the general path adds a +0 row: the same sum, since a sum started at +0 is never
    -0 (x + +0 = x for every other x). No encoded rows, no gather: the rows go to the sum as
    bfloat16 (their values; half the bytes of a float32 copy)."""
    return _sum_local_rows(spec, plan, lay, F.round_to_bf16(y), reduce_rows)


def _sum_local_rows(spec: LayerSpec, plan: Plan, lay: Layout, rows: jax.Array, reduce_rows: Any
                    ) -> Tuple[Tensor, jax.Array]:
    """The combine at one rank from the buffer's ``[C, H]`` rows (float32, or bfloat16 for a
    bf16 combine format), already through the combine format's round trip: each token's
    routes summed in slot order (``reduce_rows``), NaN on an error, the output encode.
    Returns ``(output, sum)``."""
    summed = poison(lay.error, reduce_rows(rows, _local_rows(spec, plan, lay), spec.num_tokens, spec.num_topk))
    return encode_output(spec, summed), summed


class Dispatched(NamedTuple):
    """A dispatch's buffers: tokens ``[C, H]`` (input encoding), weights
    ``[C] float32``, route ids ``[C] int32``, and any extra rows."""

    tokens: Tensor
    weights: jax.Array
    route: jax.Array
    extra: List[jax.Array]


def dispatch(
    spec: LayerSpec, plan: Plan, lay: Layout, tokens: Tensor, topk_weights: jax.Array, extra: Sequence[jax.Array] = ()
) -> Dispatched:
    """Move every route's token row (codes unchanged), router weight, route id
    and any ``extra`` per-token rows to its expert (one all-to-all)."""
    if spec.num_ranks == 1:
        return _dispatch_local(spec, plan, lay, tokens, topk_weights, extra)
    return _dispatch_exchange(spec, plan, lay, tokens, topk_weights, extra)


def _dispatch_exchange(
    spec: LayerSpec, plan: Plan, lay: Layout, tokens: Tensor, topk_weights: jax.Array, extra: Sequence[jax.Array] = ()
) -> Dispatched:
    """:func:`dispatch` through :func:`to_experts` (any rank count): rows in send order, then moved."""
    tok = tensor_parts(tokens)
    parts = send_rows(spec, plan, tok) + [route_weights(spec, plan, topk_weights), plan.send_route]
    parts += send_rows(spec, plan, list(extra))
    bufs = to_experts(spec, plan, lay, parts)
    nt = len(tok)
    return Dispatched(rebuild(tokens, bufs[:nt]), bufs[nt], bufs[nt + 1], bufs[nt + 2 :])


def _dispatch_local(
    spec: LayerSpec, plan: Plan, lay: Layout, tokens: Tensor, topk_weights: jax.Array, extra: Sequence[jax.Array] = ()
) -> Dispatched:
    """:func:`dispatch` at one rank: buffer row r of local expert e's slab, row j, is
    route ``send_route[send_first[e] + j]``; every token row is gathered straight from
    the tokens by that id (one gather per part, not one into send order and one into
    the buffer), the same bits as :func:`_dispatch_exchange`."""
    route = _local_routes(spec, plan, lay)
    keep = route >= 0
    k = spec.num_topk
    tok = [_local_gather(spec, p, route, k) for p in tensor_parts(tokens)]
    weights = _gather_rows(topk_weights.astype(jnp.float32).reshape(-1), route, keep)
    route_ids = jnp.where(keep, route, 0)  # the exchange's buffer: zero bits off the routes
    more = [_local_gather(spec, p, route, k) for p in extra]
    return Dispatched(rebuild(tokens, tok), weights, route_ids, more)


def _local_routes(spec: LayerSpec, plan: Plan, lay: Layout) -> jax.Array:
    """``[C] int32``: at one rank, the route id of every buffer row (row j of local
    expert e's slab is route ``send_route[send_first[e] + j]``), -1 for padding rows and
    for every row on an error."""
    valid, e, j = valid_rows(spec, lay)
    keep = valid & ~lay.error
    tk = spec.num_routes
    if tk == 0:
        return jnp.full(keep.shape, -1, _I32)
    return jnp.where(keep, plan.send_route[jnp.clip(lay.send_first[e] + j, 0, tk - 1)], -1)


def tokens_to_experts(spec: LayerSpec, plan: Plan, lay: Layout, per_token: Sequence[jax.Array]) -> List[jax.Array]:
    """Per-token rows ``[T, ...]`` to every route's expert: ``[C, ...]`` expert-major
    buffers, padding rows zero (collective: one all-to-all of the rows in send order; at
    one rank one gather per part straight from the rows, :func:`_tokens_to_experts_local`)."""
    if spec.num_ranks == 1:
        return _tokens_to_experts_local(spec, plan, lay, per_token)
    return to_experts(spec, plan, lay, send_rows(spec, plan, per_token))


def _tokens_to_experts_local(spec: LayerSpec, plan: Plan, lay: Layout, per_token: Sequence[jax.Array]) -> List[jax.Array]:
    route = _local_routes(spec, plan, lay)
    return [_local_gather(spec, p, route, spec.num_topk) for p in per_token]


def forward(
    spec: LayerSpec, activation: Tensor, fc1: Tensor, fc2: Tensor, topk_idx: jax.Array, topk_weights: jax.Array,
    stash: bool = True,
) -> Tuple[Tensor, Optional[jax.Array], jax.Array, Plan, Dispatched]:
    """The fused forward of one rank: ``(output, fc1_c [C, 2I] bf16, route_metadata [C, 4]
    int32, plan, dispatched buffers)``; ``stash`` False: no ``fc1_c`` (None), and a provider
    may skip writing it (a forward nobody differentiates).
    Collectives: one all-gather (plan), two all-to-alls."""
    plan = make_plan(spec, topk_idx)
    lay = layout(spec, plan)
    d = dispatch(spec, plan, lay, activation, topk_weights)
    valid, _, _ = valid_rows(spec, lay)
    kern = spec.kernels
    combined, reduce_rows = getattr(kern, "expert_forward_combined", None), getattr(kern, "reduce_rows", None)
    fused = getattr(kern, "expert_forward_output", None)
    c: Optional[jax.Array]
    if spec.num_ranks == 1 and fused is not None:
        # One rank, a provider that runs the experts, the routes' sum, the NaN on an error and
        # the output encode in one call (it may round each row through the combine format
        # inside the sum, and read the buffer's rows from the tokens by route id).
        out, c = fused(spec.config, d.tokens, d.weights, fc1, fc2, lay.group_sizes, _local_rows(spec, plan, lay),
                       spec.num_tokens, lay.error, tokens=activation, token_route=_local_routes(spec, plan, lay),
                       stash=stash)
    elif spec.num_ranks == 1 and combined is not None and reduce_rows is not None:
        # One rank, a provider that rounds y through the combine format itself and sums rows
        # by index: the routes' rows are summed straight from the buffer (combine_rows' other
        # passes, which move the encoded rows, have nothing to move).
        y, c = combined(spec.config, d.tokens, d.weights, fc1, fc2, lay.group_sizes)
        out, _ = _sum_local_rows(spec, plan, lay, y, reduce_rows)
    else:
        y, c = kern.expert_forward(spec.config, d.tokens, d.weights, fc1, fc2, lay.group_sizes)
        out, _ = combine_rows(spec, plan, lay, y)
    fc1_c = None
    align = spec.config.expert_alignment
    zero_rows = getattr(kern, "zero_rows", None)
    if stash and c.dtype == jnp.bfloat16 and getattr(kern, "stash_zero_past_slabs", False) and (
            align == 1 or zero_rows is not None):
        # A provider whose stash holds +0 in the rows past the last slab: the other padding
        # rows are the slabs' alignment padding (none with expert_alignment 1), at most
        # align - 1 a slab, zeroed in place, where the select below would copy all of [C, 2I].
        fc1_c = c if align == 1 else zero_rows(c, _slab_padding_rows(spec, lay))
    elif stash:
        # The stash: c's bf16 rounding (the identity when the provider's c is the bf16 stash
        # itself), +0 in padding rows; selected on the bits (XLA:CPU selects bf16 through float32).
        keep = valid[:, None]
        bits = _as_bits(F.round_to_bf16(c))
        fc1_c = lax.bitcast_convert_type(jnp.where(keep, bits, jnp.zeros((), bits.dtype)), jnp.bfloat16)
    meta = route_metadata(spec, lay, d.route)
    return out, fc1_c, meta, plan, d


def _slab_padding_rows(spec: LayerSpec, lay: Layout) -> jax.Array:
    """``[E_local * (align - 1)] int32``: the alignment padding rows of every slab (rows
    ``offsets[e] + tokens_per_expert[e]`` up to the next slab's start, inside the buffer),
    -1 for the rest. With the rows past the last slab they are the rows
    :func:`valid_rows` marks invalid."""
    el, align = spec.num_local_experts, spec.config.expert_alignment
    j = jnp.arange(align - 1, dtype=_I32)
    row = (lay.offsets[:el] + lay.tokens_per_expert)[:, None] + j[None, :]
    pad = (row < lay.offsets[1:, None]) & (row < spec.capacity)
    return jnp.where(pad, row, -1).reshape(-1)


def backward_from_buffers(
    spec: LayerSpec,
    plan: Plan,
    lay: Layout,
    x_buf: Tensor,
    w_buf: jax.Array,
    fc1: Tensor,
    fc2: Tensor,
    fc1_c: jax.Array,
    dy_buf: jax.Array,
    grad_x_dtype: Any = None,
) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The spec backward from dispatched buffers: ``(grad_activation [T, H],
    grad_fc1_weight, grad_fc2_weight, grad_topk_weights [T, K])`` float32 (the weight
    gradients bf16 where the provider writes them so).

    ``dy_buf``'s padding rows are zero (as every dispatch and
    :func:`tokens_to_experts` leave them). ``grad_x_dtype``: the dtype the caller casts
    ``grad_activation`` to (None: float32); at one rank a provider with
    ``reduce_rows_encode`` then writes a bfloat16 one itself (the float32 sum rounded
    once, as the cast would). Collectives: one all-to-all (``dx`` and ``dw`` back to
    their tokens)."""
    valid, _, _ = valid_rows(spec, lay)
    kern = spec.kernels
    if not (dy_buf.dtype == jnp.bfloat16 and getattr(kern, "bf16_cotangent_rows", False)):
        # (a provider that takes bf16 cotangent rows as they are gets them so: their padding
        # rows are zero bits already, and the float32 copy would be one more pass over [C, H])
        dy_buf = jnp.where(valid[:, None], dy_buf.astype(jnp.float32), 0.0)
    dx, dw, dfc1, dfc2 = kern.expert_backward(spec.config, x_buf, w_buf, fc1, fc2, fc1_c, dy_buf, lay.group_sizes)
    dw = jnp.where(valid, dw, 0.0)
    reduce_rows = getattr(kern, "reduce_rows", None)
    if spec.num_ranks == 1 and reduce_rows is not None:
        # One rank, a provider that sums rows by index: each token's routes summed in slot
        # order straight from dx's buffer rows (padding rows are never read), no copy of dx
        # into route order; the same sums as slot_sum's (+0 rows add nothing to a sum from +0).
        grad_x = _grad_x_local(spec, plan, lay, dx, reduce_rows, grad_x_dtype)
        (dw_r,) = to_sources(spec, plan, lay, [dw.astype(jnp.float32)])
    else:
        dx = jnp.where(valid[:, None], dx, 0.0)
        dx_r, dw_r = to_sources(spec, plan, lay, [dx.astype(jnp.float32), dw.astype(jnp.float32)])
        grad_x = poison(lay.error, slot_sum(spec, dx_r))
    grad_w = poison(lay.error, dw_r.reshape(spec.num_tokens, spec.num_topk))
    weight_poison = getattr(kern, "poison", None) or poison
    return grad_x, weight_poison(lay.error, dfc1), weight_poison(lay.error, dfc2), grad_w


def _grad_x_local(spec: LayerSpec, plan: Plan, lay: Layout, dx: jax.Array, reduce_rows: Any,
                  grad_x_dtype: Any) -> jax.Array:
    """``grad_activation [T, H]`` at one rank from dx's ``[C, H]`` buffer rows: the routes'
    slot-order sums (``reduce_rows``), NaN on an error; for a bfloat16 ``grad_x_dtype`` with a
    provider that has ``reduce_rows_encode``, the sums' bf16 encode written in the same pass
    (the float32 sums never written; the cast of the float32 result gives the same bits)."""
    rows = dx.astype(jnp.float32)
    route_rows = _local_rows(spec, plan, lay)
    encode = getattr(spec.kernels, "reduce_rows_encode", None)
    if grad_x_dtype is not None and jnp.dtype(grad_x_dtype) == jnp.dtype(jnp.bfloat16) and encode is not None:
        return encode(rows, route_rows, spec.num_tokens, spec.num_topk, MoeFormat.BF16, lay.error)
    return poison(lay.error, reduce_rows(rows, route_rows, spec.num_tokens, spec.num_topk))


def replace_spec(spec: LayerSpec, **changes: Any) -> LayerSpec:
    return dataclasses.replace(spec, **changes)


__all__ += ["buffer_rows", "valid_rows", "route_metadata", "tensor_parts", "rebuild", "Dispatched", "dispatch",
            "tokens_to_experts", "gather_route_rows",
            "combine_rows", "encode_output", "send_rows", "route_weights", "poison", "replace_spec"]
