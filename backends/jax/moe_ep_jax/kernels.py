"""The local expert computation of one rank, behind a small protocol.

The layer (:mod:`moe_ep_jax.core`: plan, exchange, layout, custom_vjp wiring)
is written once and calls a *kernel provider* for everything that touches the
numbers of one rank's received rows:

- :meth:`ExpertKernels.expert_forward`: section 5 of the spec on the
  expert-major buffer (FC1, clamp, SwiGLU, router weight, ``R_int``, FC2);
- :meth:`ExpertKernels.expert_backward`: section 9.2 (recomputation from the
  bf16 stash, the four gradients);
- :meth:`ExpertKernels.quantize` / :meth:`ExpertKernels.dequantize`: the
  formats (the combine round trip and the output encode run through them);
- :meth:`ExpertKernels.plan_routes`: one rank's routing plan (the stable sort
  of route ids by expert and the per-expert counts behind
  :func:`~moe_ep_jax.core.make_plan`);
- :meth:`ExpertKernels.slot_sum`: the Form-A combine reduction (rows by route
  id summed in slot order, :func:`~moe_ep_jax.core.slot_sum`).

Optional: ``gather_rows(x [rows, ...], route [M] int32, num_topk) -> [M, ...]``,
row ``i`` = ``x[route[i] // num_topk]`` with zero bits where ``route[i]`` is -1,
bits copied. At one rank the layer's exchanges are such gathers; a provider with
the method does them (the native one copies whole rows), one without it gets XLA's.
Optional: ``reduce_rows(rows [R, H] float32 or bfloat16, route_rows [T*K] int32,
num_tokens, num_topk) -> [T, H] float32``, the slot-order sum from +0 of
``rows[route_rows[t*K+k]]`` (-1 adds nothing; bf16 rows summed as their float32
values). At one rank with a bf16 combine format the layer then sums the routes' rows
straight from the buffer (as bfloat16). Optional with it:
``expert_forward_combined(...)``, :meth:`ExpertKernels.expert_forward` with ``y``
after ``combine_format``'s round trip (float32, or bfloat16 for a bf16 combine
format). The fused forward at one rank then passes the rows to ``reduce_rows`` as
they are (any combine format). Optional, and preferred at one rank when present:
``expert_forward_output(config, x, w, fc1, fc2, group_sizes, route_rows [T*K] int32,
num_tokens, error [] bool, tokens=, token_route=, stash=) -> (output, c or None)``: the rest
of the one-rank forward in one call, ``expert_forward_combined``, ``reduce_rows``, NaN
everywhere when ``error`` and the ``output_format`` encode (the provider may round each row
through the combine format inside the sum, reading y once, and encode the sums without
writing them). ``tokens`` (the layer's ``[T, H]`` input) and ``token_route`` (``[C] int32``,
the route id of every buffer row, -1 for none) are what ``x`` was gathered from (row ``i`` =
token ``token_route[i] // K``): a provider may read the rows from there instead of from
``x``. ``stash`` False: nobody reads ``c`` (a forward that is not differentiated and does
not return the stash); the provider may skip it and return None.
At one rank the backward sums ``dx``'s buffer rows into the tokens' gradient with
``reduce_rows`` too (no copy of ``dx`` into route order), and, for a bfloat16 activation,
with ``reduce_rows_encode(rows, route_rows, num_tokens, num_topk, out_format, error) ->
[T, H]`` where the provider has it (the sums, NaN everywhere when ``error``, encoded in
``out_format`` in one pass). Optional: ``poison(error [] bool, x) -> x.dtype``, the bits of
:func:`~moe_ep_jax.core.poison` (NaN everywhere when ``error``, else ``x``), which the
backward applies to the weight gradients (a provider may skip every read and write of
``x`` when the flag is clear). Optional attribute ``bf16_cotangent_rows`` (True): the
provider's ``expert_backward`` takes a bfloat16 ``dy`` as it is, so the layer passes the
cotangent rows without a float32 copy. Optional attribute ``stash_zero_past_slabs``
(True): the bfloat16 ``c`` the provider's forward returns holds +0 in every row past the
last slab, so with ``expert_alignment`` 1 (no padding inside a slab) the layer keeps it as
the stash without its select of the padding rows, and otherwise zeroes only the slabs'
alignment padding rows with the provider's ``zero_rows(x [R, ...], rows [N] int32) -> x``
(the listed rows all zero bits, -1 lists none; the others untouched) where it has one.

:class:`XlaKernels` (the default, name ``xla``) does this with XLA-native ops:
grouped GEMMs over the expert slabs (``jax.lax.ragged_dot``, or, where its dense
lowering, every row against every expert, would be large, a scan of one GEMM per
(row tile, expert) pair), with float32 accumulation (``Precision.HIGHEST``: no TF32/bf16 passes), and the
bit-exact formats of :mod:`moe_ep_jax.formats`, and ``argsort``/``bincount``
for the plan. A second provider (the native core reached through XLA FFI,
``moe_ep_jax_ffi.kernels.FfiKernels``) implements the same six methods and is
passed as ``kernels=`` to the API functions or to
:class:`~moe_ep_jax.backend.JaxBackend`; nothing else changes.

Buffer conventions every provider sees (``C`` rows, expert-major):

- local expert ``e`` owns rows ``[offset_e, offset_e + group_sizes[e])`` with
  ``offset_e = sum(group_sizes[:e])``: ``group_sizes`` are the slab sizes,
  alignment padding included (static layout), so slabs are contiguous. Rows
  after ``sum(group_sizes)`` belong to no expert. The sizes are >= 0 and sum
  to at most ``C`` (the layer cuts the slabs at the buffer's end on an overflow).
- padding rows (alignment padding and the tail) hold zero tokens (zero codes),
  weight 0, zero stash and zero cotangent. The layer masks every result row that
  carries no route afterwards, so a provider need not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Tuple, Union, runtime_checkable

from .devices import prepare_environment as _prepare_environment

_prepare_environment()  # XLA_FLAGS must ask for enough CPU devices before jax's first import

import jax
import jax.numpy as jnp
from jax import lax

from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.formats import MoeFormat

from . import formats as F

__all__ = ["ExpertKernels", "LocalPlan", "XlaKernels", "DEFAULT_KERNELS"]

Tensor = Union[jax.Array, F.BlockScaled]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LocalPlan:
    """One rank's routes before they are shared (what
    :meth:`ExpertKernels.plan_routes` returns; a pytree, so it passes through jit).

    Attributes:
        send_route: ``[T*K] int32``: route ids sorted by (expert, route id); the
            first ``sum(counts[:E])`` are routed, the rest are the unrouted ids
            (-1 slots and bad ids) in route order.
        route_pos: ``[T*K] int32``: each route id's position in ``send_route``,
            -1 when unrouted.
        route_expert: ``[T*K] int32``: each routed id's expert, -1 when unrouted.
        counts: ``[E + 1] int32``: routes per expert, then the number of bad ids
            (``counts[E] > 0`` is the plan's input-error flag).
    """

    send_route: jax.Array
    route_pos: jax.Array
    route_expert: jax.Array
    counts: jax.Array


@runtime_checkable
class ExpertKernels(Protocol):
    """What a kernel provider implements. Every method is traced inside
    ``jax.shard_map`` (one rank's view, static shapes) and may be called under
    ``jax.jit``; it must not communicate."""

    #: A short name for reports (``xla``, ``ffi-...``).
    name: str

    def expert_forward(self, config: MoeEpConfig, x: Tensor, w: jax.Array, fc1: Tensor, fc2: Tensor,
                       group_sizes: jax.Array) -> Tuple[jax.Array, jax.Array]:
        """Section 5 on the buffer rows.

        Args:
            x: ``[C, H]``: received tokens in their input encoding (plain
                float32/float16/bfloat16, or a :class:`~moe_ep_jax.formats.BlockScaled`
                blocked along H).
            w: ``[C] float32``: router weight of every row (0 in padding).
            fc1: ``[E_local, H, 2I]`` plain, or block-scaled along axis 1 (H).
            fc2: ``[E_local, I, H]`` plain, or block-scaled along axis 1 (I).
            group_sizes: ``[E_local] int32``: slab sizes (see the module doc).

        Returns:
            ``y`` ``[C, H] float32``: the expert output before the combine
            round trip; ``c`` ``[C, 2I] float32``: the FC1 output before the
            clamp (the stash is its bf16 rounding), or ``bfloat16``: the stash
            itself, when the provider's kernels round it (the layer's bf16
            rounding of it is then the identity).
        """
        ...

    def expert_backward(self, config: MoeEpConfig, x: Tensor, w: jax.Array, fc1: Tensor, fc2: Tensor, fc1_c: jax.Array,
                        dy: jax.Array, group_sizes: jax.Array) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Section 9.2 on the buffer rows (every rounding point straight-through).

        With ``config.backward_operand_format`` bf16: the cotangent rows, ``dc``
        and ``w * h`` rounded to bf16 (nearest even) before their GEMMs, which
        accumulate in float32 (spec section 9.2).

        Args:
            x, w, fc1, fc2, group_sizes: as :meth:`expert_forward`.
            fc1_c: ``[C, 2I] bfloat16``: the stash (pre-clamp, unweighted).
            dy: ``[C, H]`` float: the output cotangent of every row's token.

        Returns:
            ``dx [C, H]``, ``dw [C]``, ``dfc1 [E_local, H, 2I]``,
            ``dfc2 [E_local, I, H]``, all float32.
        """
        ...

    def quantize(self, x: jax.Array, fmt: MoeFormat) -> Tensor:
        """Encode float32 ``[..., n]`` along the last axis: bf16 array or BlockScaled (bit-exact)."""
        ...

    def dequantize(self, x: Tensor) -> jax.Array:
        """Decode a plain array or BlockScaled to float32 (exact)."""
        ...

    def plan_routes(self, config: MoeEpConfig, topk_idx: jax.Array) -> "LocalPlan":
        """One rank's routes (spec section 4), stable by route id ``r = token * K + slot``.

        Args:
            topk_idx: ``[T, K] int32``: expert ids; -1 marks an unused slot; ids
                outside ``[-1, num_experts)`` are input errors (not routed).

        Returns:
            a :class:`LocalPlan`.
        """
        ...

    def slot_sum(self, rows: jax.Array, num_tokens: int, num_topk: int) -> jax.Array:
        """Form-A reduction: ``[T*K, H]`` float32 rows indexed by route id ->
        ``[T, H] float32``, ``((+0 + row[t*K]) + row[t*K+1]) + ...`` in slot order."""
        ...


_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32
_I32 = jnp.int32


#: Rows per tile of the tiled grouped GEMMs; the same for every buffer size, so
#: that a row's result and a weight gradient's summation order do not depend on
#: how many rows the buffer has.
GEMM_TILE_ROWS = 256


def _tile_rows(num_rows: int) -> int:
    del num_rows
    return GEMM_TILE_ROWS


def _tile_pairs(group_sizes: jax.Array, num_rows: int, tile: int) -> Tuple[jax.Array, ...]:
    """The (tile, group) pairs of a grouped GEMM over contiguous slabs: every
    tile of ``tile`` rows once for each group with rows in it, groups in order.

    Returns ``(group [P], tile [P], valid [P], starts [G], ends [G])`` int32/bool
    with ``P = num_tiles + G - 1``, the most pairs there can be (each slab
    boundary inside a tile adds one); pairs past the last real one are not valid.
    """
    g = group_sizes.shape[0]
    num_tiles = -(-num_rows // tile)
    sizes = group_sizes.astype(_I32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    count = jnp.where(sizes > 0, (ends - 1) // tile - first + 1, 0)
    pair_end = jnp.cumsum(count)
    p = jnp.arange(num_tiles + g - 1, dtype=_I32)
    group = jnp.searchsorted(pair_end, p, side="right").astype(_I32)
    valid = group < g
    group = jnp.minimum(group, g - 1)
    tiles = jnp.clip(first[group] + p - (pair_end - count)[group], 0, num_tiles - 1)
    return group, jnp.where(valid, tiles, 0), valid, starts, ends


def _zeros(shape: Tuple[int, ...], *like: jax.Array) -> jax.Array:
    """float32 zeros typed as varying over every mesh axis that one of ``like``
    varies over (inside ``shard_map`` a fresh ``zeros`` is invariant, and a scan's
    carry must keep its type)."""
    z = jnp.zeros(shape, _F32)
    axes: set = set()
    for a in like:
        aval = jax.typeof(a)
        varying = getattr(aval, "vma", None)  # jax <= 0.8; later: manual_axis_type.varying
        if varying is None:
            varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
        axes |= set(varying or ())
    if not axes:
        return z
    pcast = getattr(lax, "pcast", None)
    if pcast is not None:
        return pcast(z, tuple(sorted(axes)), to="varying")
    return lax.pvary(z, tuple(sorted(axes)))


def _common(a: jax.Array, b: jax.Array) -> Tuple[jax.Array, jax.Array]:
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


#: Above this many bytes of ``jax.lax.ragged_dot``'s dense intermediate (every
#: row against every expert, ``[C, G, N]`` float32) the grouped GEMMs run tiled
#: (:func:`_gemm_tiled`, :func:`_gemm_t_tiled`); below it, ``ragged_dot`` on float32.
DENSE_GEMM_MAX_BYTES = 64 << 20

_CONTRACT_ROWS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def _gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_transposed: bool = False) -> jax.Array:
    """``lhs[slab_e] @ rhs[e]`` for every expert: ``[C, K] x [G, K, N] -> [C, N]``
    float32 (``rhs_transposed``: ``rhs`` is ``[G, N, K]`` and ``rhs[e]^T`` is used);
    rows after the last slab are 0. Float32 accumulation (``Precision.HIGHEST``)."""
    c = lhs.shape[0]
    g, n = rhs.shape[0], rhs.shape[1] if rhs_transposed else rhs.shape[2]
    if c * g * n * 4 > DENSE_GEMM_MAX_BYTES:
        return _gemm_tiled(lhs, rhs, group_sizes, rhs_transposed)
    if rhs_transposed:
        rhs = jnp.swapaxes(rhs, 1, 2)
    return lax.ragged_dot(lhs.astype(_F32), rhs.astype(_F32), group_sizes, precision=_HIGHEST,
                          preferred_element_type=_F32)


def _gemm_t(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``lhs[slab_e]^T @ rhs[slab_e]`` for every expert: ``[C, K], [C, N] -> [G, K, N]``
    float32 (``Precision.HIGHEST``)."""
    c, k = lhs.shape
    if c * group_sizes.shape[0] * max(k, rhs.shape[1]) * 4 > DENSE_GEMM_MAX_BYTES:
        return _gemm_t_tiled(lhs, rhs, group_sizes)
    return lax.ragged_dot_general(
        lhs.astype(_F32), rhs.astype(_F32), group_sizes, _CONTRACT_ROWS, precision=_HIGHEST, preferred_element_type=_F32
    )


def _gemm_tiled(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_transposed: bool = False) -> jax.Array:
    """:func:`_gemm` as one ``[tile, K] x [K, N]`` GEMM per (tile, expert) pair of :func:`_tile_pairs`,
    float32 accumulation (``Precision.HIGHEST``), each row's result selected from
    its own expert's product: the work and the memory of the expert-major rows
    themselves, where ``jax.lax.ragged_dot``'s dense lowering on CPU and GPU
    computes every row against every expert (``[C, G, N]``). Mixed operand dtypes
    meet at their promoted type one expert at a time (bf16 x bf16 stays a bf16 GEMM).
    """
    c, k = lhs.shape
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    if c == 0:
        return jnp.zeros((0, n), _F32)
    tile = _tile_rows(c)
    num_tiles = -(-c // tile)
    x = jnp.pad(lhs, ((0, num_tiles * tile - c), (0, 0))).reshape(num_tiles, tile, k)
    group, tiles, valid, starts, ends = _tile_pairs(group_sizes, c, tile)
    rows = jnp.arange(tile, dtype=_I32)
    dims = (((1,), (1,)), ((), ())) if rhs_transposed else (((1,), (0,)), ((), ()))

    def step(out, pair):
        gi, ti, vi = pair
        a, b = _common(lax.dynamic_index_in_dim(x, ti, keepdims=False), lax.dynamic_index_in_dim(rhs, gi, keepdims=False))
        y = lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=_F32)
        r = ti * tile + rows
        mine = vi & (r >= starts[gi]) & (r < ends[gi])
        cur = lax.dynamic_index_in_dim(out, ti, keepdims=False)
        return lax.dynamic_update_index_in_dim(out, cur + jnp.where(mine[:, None], y, 0.0), ti, 0), None

    out, _ = lax.scan(step, _zeros((num_tiles, tile, n), lhs, rhs, group_sizes), (group, tiles, valid))
    return out.reshape(num_tiles * tile, n)[:c]


def _gemm_t_tiled(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """:func:`_gemm_t` expert by expert: for each, one ``[tile, K]^T x [tile, N]`` GEMM
    per row tile of its slab (see :func:`_gemm_tiled`) summed in tile order into one
    ``[K, N]`` float32 accumulator, written out once. Rows of other experts are
    zeroed in both operands (a NaN row of one expert never reaches another's
    gradient); an expert without rows gets 0."""
    c, k = lhs.shape
    n = rhs.shape[1]
    g = group_sizes.shape[0]
    if c == 0:
        return jnp.zeros((g, k, n), _F32)
    tile = _tile_rows(c)
    num_tiles = -(-c // tile)
    pad = ((0, num_tiles * tile - c), (0, 0))
    a_all = jnp.pad(lhs, pad).reshape(num_tiles, tile, k)
    b_all = jnp.pad(rhs, pad).reshape(num_tiles, tile, n)
    sizes = group_sizes.astype(_I32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(tile, dtype=_I32)
    acc0 = _zeros((k, n), lhs, rhs, group_sizes)

    def expert(e, out):
        first = starts[e] // tile
        count = jnp.where(sizes[e] > 0, (ends[e] - 1) // tile - first + 1, 0)

        def one_tile(j, acc):
            ti = first + j
            r = ti * tile + rows
            mine = ((r >= starts[e]) & (r < ends[e]))[:, None]
            a = lax.dynamic_index_in_dim(a_all, ti, keepdims=False)
            b = lax.dynamic_index_in_dim(b_all, ti, keepdims=False)
            a, b = _common(jnp.where(mine, a, jnp.zeros((), a.dtype)), jnp.where(mine, b, jnp.zeros((), b.dtype)))
            return acc + lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=_F32)

        return lax.dynamic_update_index_in_dim(out, lax.fori_loop(0, count, one_tile, acc0), e, 0)

    return lax.fori_loop(0, g, expert, _zeros((g, k, n), lhs, rhs, group_sizes))


def _plain_or_decoded(t: Tensor) -> jax.Array:
    """A GEMM operand: a plain array as it is (the grouped GEMMs widen it one
    expert at a time), a block-scaled one decoded to float32 (exact)."""
    return t if isinstance(t, jax.Array) else F.decode(t)


def _swiglu_parts(config: MoeEpConfig, fc1_c: jax.Array) -> Tuple[jax.Array, ...]:
    """From the bf16 stash: ``(g, u, sig, s, h, fg, fu)`` float32 after the clamp,
    with the clamp's masks folded into ``fg = u sig (1 + g (1 - sig)) m_g`` and
    ``fu = s m_u``."""
    i, lim = config.intermediate, config.gate_up_clamp
    c = fc1_c.astype(_F32)
    g, u = c[:, :i], c[:, i:]
    masks = None
    if lim is not None:
        lim32 = jnp.float32(lim)
        masks = ((g <= lim32).astype(_F32), ((u >= -lim32) & (u <= lim32)).astype(_F32))
        g, u = jnp.minimum(g, lim32), jnp.clip(u, -lim32, lim32)
    sig = jax.nn.sigmoid(g)
    s = g * sig
    h = s * u
    fg = u * sig * (1.0 + g * (1.0 - sig))
    fu = s
    if masks is not None:
        fg, fu = fg * masks[0], fu * masks[1]
    return g, u, sig, s, h, fg, fu


class XlaKernels:
    """The XLA-native provider: tiled grouped GEMMs (:func:`_gemm`, :func:`_gemm_t`)
    with float32 accumulation on the exact operand values, elementwise SwiGLU in
    float32, and the bit-exact formats of :mod:`moe_ep_jax.formats`."""

    name = "xla"

    def __repr__(self) -> str:
        return "XlaKernels()"

    # formats -----------------------------------------------------------------

    def quantize(self, x: jax.Array, fmt: MoeFormat) -> Tensor:
        return F.quantize(x, fmt, axis=-1)

    def dequantize(self, x: Tensor) -> jax.Array:
        return F.decode(x)

    # plan and combine reduction -------------------------------------------------

    def plan_routes(self, config, topk_idx):  # type: ignore[override]
        e = config.num_experts
        flat = topk_idx.reshape(-1).astype(_I32)
        bad = (flat < -1) | (flat >= e)
        routed = (flat >= 0) & ~bad
        key = jnp.where(routed, flat, e)
        send_route = jnp.argsort(key, stable=True).astype(_I32)
        counts = jnp.bincount(key, length=e + 1)[:e].astype(_I32)
        positions = jnp.zeros_like(send_route).at[send_route].set(jnp.arange(flat.shape[0], dtype=_I32))
        route_pos = jnp.where(routed, positions, -1)
        route_expert = jnp.where(routed, flat, -1)
        counts = jnp.concatenate([counts, jnp.sum(bad, dtype=_I32)[None]])
        return LocalPlan(send_route=send_route, route_pos=route_pos, route_expert=route_expert, counts=counts)

    def slot_sum(self, rows, num_tokens, num_topk):  # type: ignore[override]
        # (XLA's simplifier may fold the +0 start away, 0 + x -> x: a token whose
        # slots all hold -0 then sums to -0 rather than the spec's +0; equal values.)
        per_slot = rows.astype(_F32).reshape(num_tokens, num_topk, rows.shape[-1])
        acc = jnp.zeros((num_tokens, per_slot.shape[-1]), _F32)
        for k in range(num_topk):
            acc = acc + per_slot[:, k]
        return acc

    # experts -----------------------------------------------------------------

    def expert_forward(self, config, x, w, fc1, fc2, group_sizes):  # type: ignore[override]
        i = config.intermediate
        c = _gemm(_plain_or_decoded(x), _plain_or_decoded(fc1), group_sizes)
        g, u = c[:, :i], c[:, i:]
        if config.gate_up_clamp is not None:
            lim = jnp.float32(config.gate_up_clamp)
            g, u = jnp.minimum(g, lim), jnp.clip(u, -lim, lim)
        s = g * jax.nn.sigmoid(g)
        h = s * u
        wc = w[:, None]
        op = wc * h if config.apply_topk_in_fc1 else h
        op = F.round_trip(op, config.intermediate_format)
        z = _gemm(op, _plain_or_decoded(fc2), group_sizes)
        y = z if config.apply_topk_in_fc1 else wc * z
        return y, c

    def expert_backward(self, config, x, w, fc1, fc2, fc1_c, dy, group_sizes):  # type: ignore[override]
        if config.backward_operand_format is not None:
            return self._expert_backward_bf16(config, x, w, fc1, fc2, fc1_c, dy, group_sizes)
        i, lim = config.intermediate, config.gate_up_clamp
        xf, w1, w2 = _plain_or_decoded(x), _plain_or_decoded(fc1), _plain_or_decoded(fc2)
        c = fc1_c.astype(_F32)
        g_raw, u_raw = c[:, :i], c[:, i:]
        if lim is None:
            g, u = g_raw, u_raw
            gate_mask = up_mask = None
        else:
            lim32 = jnp.float32(lim)
            gate_mask = (g_raw <= lim32).astype(_F32)
            up_mask = ((u_raw >= -lim32) & (u_raw <= lim32)).astype(_F32)
            g, u = jnp.minimum(g_raw, lim32), jnp.clip(u_raw, -lim32, lim32)
        sig = jax.nn.sigmoid(g)
        s = g * sig
        h = s * u
        wc = w[:, None]
        dyf = dy.astype(_F32)
        a = _gemm(dyf, w2, group_sizes, rhs_transposed=True)  # dY W2^T  [C, I]
        if config.apply_topk_in_fc1:
            dfc2 = _gemm_t(wc * h, dyf, group_sizes)
            dw = jnp.sum(a * h, axis=1)
        else:
            dfc2 = _gemm_t(h, wc * dyf, group_sizes)
            dw = jnp.sum(dyf * _gemm(h, w2, group_sizes), axis=1)
        dh = a * wc
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
        du = dh * s
        if gate_mask is not None:
            dg, du = dg * gate_mask, du * up_mask
        dc = jnp.concatenate([dg, du], axis=1)
        dfc1 = _gemm_t(xf, dc, group_sizes)
        dx = _gemm(dc, w1, group_sizes, rhs_transposed=True)
        return dx, dw, dfc1, dfc2

    def _expert_backward_bf16(self, config, x, w, fc1, fc2, fc1_c, dy, group_sizes):
        """:meth:`expert_backward` with ``backward_operand_format`` bf16: every GEMM
        that takes a rounded operand runs in bf16 where its other operand is a
        plain bf16 input (float32 accumulation and output), else in float32 on the
        exact values."""
        _, _, _, _, h, fg, fu = _swiglu_parts(config, fc1_c)
        wc = w[:, None]
        # The rounding points by F.round_to_bf16 (integer arithmetic on the bits), not astype:
        # XLA on GPU (xla_allow_excess_precision) removes an f32 -> bf16 -> f32 convert pair.
        dy_b = F.round_to_bf16(dy)  # dY_b = R_bf16(dY), exact for a bf16 cotangent
        w1, w2 = _plain_or_decoded(fc1), _plain_or_decoded(fc2)
        a = _gemm(dy_b, w2, group_sizes, rhs_transposed=True)  # dY_b W2^T  [C, I] float32
        dfc2 = _gemm_t(F.round_to_bf16(wc * h), dy_b, group_sizes)  # R_bf16(w h)^T dY_b, both placements
        if config.apply_topk_in_fc1:
            dw = jnp.sum(a * h, axis=1)
        else:
            dw = jnp.sum(dy_b.astype(_F32) * _gemm(h, w2, group_sizes), axis=1)
        dh = a * wc
        dc_b = F.round_to_bf16(jnp.concatenate([dh * fg, dh * fu], axis=1))  # dc_b = R_bf16(dc)
        dfc1 = _gemm_t(_plain_or_decoded(x), dc_b, group_sizes)
        dx = _gemm(dc_b, w1, group_sizes, rhs_transposed=True)
        return dx, dw, dfc1, dfc2


#: The provider used when none is given.
DEFAULT_KERNELS: Any = XlaKernels()
