"""``FfiKernels``: the :class:`moe_ep_jax.kernels.ExpertKernels` provider over
the native core, through XLA FFI.

Every method traces to ``jax.ffi.ffi_call`` of a target of
:mod:`moe_ep_jax_ffi._ffi` (see :mod:`moe_ep_jax_ffi.native`); the handlers call
the C ABI of ``backends/native`` on the CPU, or on XLA's CUDA stream when jax
runs on CUDA GPUs and the extension was built with ``MOE_EP_NATIVE_CUDA=ON``.

Inputs reach the handlers as the C ABI wants them:

- the expert steps run the native layer object's stages (one layer per
  configuration, device and operand dtype, cached in the extension), the
  forward returning the bf16 stash itself as ``c``. Their operands, by the
  inputs' encodings (activation / weights):

  - bf16 / bf16: bf16 as they are; on CUDA the tensor cores (the FC2 operand one
    bf16 plane with ``intermediate_format`` bf16 or nvfp4, else three; the
    float32 cotangent as three planes);
  - float32, float16, or mixed: float32 (exact ``astype``), the float32 kernels;
  - mxfp8 / nvfp4 with the rest bf16 or block-scaled: bf16 from
    ``moe_ep_dequantize_bf16`` (exact, or NaN and a flag where bf16 cannot hold
    a value), the tensor cores; when the flag is set (mxfp8 scale codes 0 to 2
    only) ``lax.cond`` takes float32 operands (``moe_ep_dequantize``) and the
    float32 kernels, so the result never depends on a rounded value;
  - mxfp8 / nvfp4 with a float32 or float16 input: float32
    (``moe_ep_dequantize``), the float32 kernels;
- plain float16/bfloat16/float32 tensors are converted to float32 with
  ``astype`` (exact) where float32 is wanted;
- :class:`moe_ep_jax.formats.BlockScaled` tensors are decoded by the native
  ``moe_ep_dequantize``: their codes (mxfp8 ``float8_e4m3fn`` data and
  ``float8_e8m0fnu`` scales, nvfp4 ``uint8`` data and ``float8_e4m3fn`` scales)
  travel as ``uint8`` (``lax.bitcast_convert_type``), viewed as
  ``[outer, n, inner]`` around the blocked axis (``inner`` = 1 for the last axis;
  FC1/FC2 weights are blocked along axis 1 of ``[E_local, n, inner]``);
- :meth:`FfiKernels.quantize` returns exactly what the XLA provider returns: a
  ``bfloat16`` array for bf16, else a :class:`~moe_ep_jax.formats.BlockScaled`
  with the same dtypes (bit for bit: both follow the spec).

Inside ``jax.shard_map`` the handlers' results are typed as varying over the
mesh axes their operands vary over (an FFI call has no such rule of its own).

Shapes with a zero extent never reach a handler: the XLA provider's result is
used (empty, or a trivial plan), so every target sees non-empty buffers.
"""

from __future__ import annotations

import math
from typing import Any, FrozenSet, List, Sequence, Tuple, Union

from moe_ep_jax.devices import prepare_environment as _prepare_environment

_prepare_environment()  # XLA_FLAGS must ask for enough CPU devices before jax's first import

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_ep_jax import formats as F
from moe_ep_jax.core import gather_route_rows, rebuild, tensor_parts
from moe_ep_jax.kernels import LocalPlan, XlaKernels
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import FormatError, ShapeError
from moe_ep_spec.formats import MoeFormat, block_axis, parse_format

from . import native

__all__ = ["FfiKernels"]

Tensor = Union[jax.Array, F.BlockScaled]

_F32 = jnp.float32
_I32 = jnp.int32
_U8 = jnp.uint8
_XLA = XlaKernels()

_DATA_DTYPE = {MoeFormat.MXFP8: jnp.dtype(jnp.float8_e4m3fn), MoeFormat.NVFP4: jnp.dtype(jnp.uint8)}
#: Dtypes :meth:`FfiKernels.gather_rows` hands to ``moe_ep_permute_rows`` as they are.
_ROW_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.int32))
#: Dtypes :meth:`FfiKernels.poison` hands to ``moe_ep_poison``.
_POISON_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SCALE_DTYPE = {MoeFormat.MXFP8: jnp.dtype(jnp.float8_e8m0fnu), MoeFormat.NVFP4: jnp.dtype(jnp.float8_e4m3fn)}


# ----------------------------------------------------------------------------- calling a target


def _vma(x: Any) -> FrozenSet[str]:
    """The mesh axes ``x`` varies over inside ``jax.shard_map`` (empty outside,
    or when the check is off)."""
    try:
        t = jax.typeof(x)
    except Exception:  # noqa: BLE001 - not an array: no axes
        return frozenset()
    vma = getattr(t, "vma", None)
    if vma is None:
        vma = getattr(getattr(t, "mat", None), "varying", None)
    return frozenset(vma or ())


def _varying(x: jax.Array, axes: FrozenSet[str]) -> jax.Array:
    """``x`` typed as varying over ``axes`` (a no-op where it already is)."""
    missing = tuple(sorted(axes - _vma(x)))
    if not missing:
        return x
    pcast = getattr(lax, "pcast", None)
    try:
        if pcast is not None:
            return pcast(x, missing, to="varying")
        pvary = getattr(lax, "pvary", None)
        return pvary(x, missing) if pvary is not None else x
    except (TypeError, ValueError, NameError):  # check_vma off
        return x


def _call(target: str, results: Sequence[jax.ShapeDtypeStruct], *args: jax.Array, aliases: Any = None,
          **attrs: Any) -> List[jax.Array]:
    """``jax.ffi.ffi_call`` of ``target`` (registering the targets first), with
    the operands brought to one varying type and the results given it.
    ``aliases``: ``{operand index: result index}`` (``input_output_aliases``)."""
    native.register()
    axes: FrozenSet[str] = frozenset().union(*(_vma(a) for a in args))
    if axes:
        args = tuple(_varying(a, axes) for a in args)
    call = jax.ffi.ffi_call(target, list(results), vmap_method="sequential", input_output_aliases=aliases)
    out = call(*args, **attrs)
    out = list(out)
    if axes:
        out = [_varying(o, axes) for o in out]
    return out


def _sds(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), jnp.dtype(dtype))


def _u8(x: jax.Array) -> jax.Array:
    """One-byte codes (float8 or uint8) as uint8 (a bit cast)."""
    return x if x.dtype == _U8 else lax.bitcast_convert_type(x, _U8)


def _view(shape: Sequence[int], axis: int) -> Tuple[int, int, int]:
    """``(outer, n, inner)`` of ``shape`` around ``axis``."""
    return math.prod(shape[:axis]), int(shape[axis]), math.prod(shape[axis + 1 :])


def _code(fmt: Any) -> np.int32:
    return np.int32(native.FORMAT_CODES[None if fmt is None else parse_format(fmt)])


def _encoded_extents(fmt: MoeFormat, n: int) -> Tuple[int, int, Any]:
    """``(data extent, scale extent, data dtype)`` of ``n`` values encoded in ``fmt`` along
    their blocked axis (the C ABI's storage: bf16 bits and no scale, or one-byte codes)."""
    if fmt is MoeFormat.BF16:
        return n, 0, jnp.uint16
    block = int(fmt.block_size or 0)  # 32 (mxfp8) or 16 (nvfp4)
    return (-(-n // 2) if fmt is MoeFormat.NVFP4 else n), -(-n // block), _U8


def _encoded(fmt: MoeFormat, data: jax.Array, scale: jax.Array, n: int, axis: int) -> Tensor:
    """The layer's Tensor of a handler's encoded storage (already in its logical shape):
    bf16 bits as ``bfloat16``, or a :class:`~moe_ep_jax.formats.BlockScaled` with the
    format's dtypes (a bit cast)."""
    if fmt is MoeFormat.BF16:
        return data if data.dtype == jnp.bfloat16 else lax.bitcast_convert_type(data, jnp.bfloat16)
    if fmt is MoeFormat.MXFP8:
        data = lax.bitcast_convert_type(data, _DATA_DTYPE[fmt])
    return F.BlockScaled(data, lax.bitcast_convert_type(scale, _SCALE_DTYPE[fmt]), fmt, n, axis)


def _sum_rows(rows: Any, round_trip: Any) -> Tuple[jax.Array, Any]:
    """``(rows, round-trip format or None)`` as the combine_reduce handlers take them:
    float32, or bfloat16 as they are when nothing rounds them."""
    rows = jnp.asarray(rows)
    fmt = None if round_trip is None else parse_format(round_trip, name="round_trip")
    if fmt is not None and fmt not in (MoeFormat.MXFP8, MoeFormat.NVFP4):
        raise FormatError(f"round_trip must be None, 'mxfp8' or 'nvfp4' (a block format); got {round_trip!r}")
    if rows.dtype != jnp.bfloat16 or fmt is not None:
        rows = rows.astype(_F32)
    return rows, fmt


# ----------------------------------------------------------------------------- the provider


class FfiKernels:
    """The native core as an :class:`moe_ep_jax.kernels.ExpertKernels` provider.

    Stateless: every instance is equal to every other (one jit cache entry),
    and it pickles (``moe-ep conformance --isolate`` sends backends to fresh
    processes; the targets are registered again there on first use).

    Its numbers: the formats are bit-exact with the spec (and so with
    :class:`~moe_ep_jax.kernels.XlaKernels`), the plan and the slot-order sum
    are identical to the XLA provider's; the expert GEMMs accumulate in float32
    in ascending order of the contracted index (the XLA provider's
    ``ragged_dot`` may order its sums differently: results agree to float32
    rounding, within the spec's budgets).
    """

    name = "ffi-native"
    #: :meth:`expert_backward` writes bf16 weight gradients for plain bf16 operands
    #: (:meth:`with_bf16_weight_grads`).
    bf16_weight_grads = False
    #: :meth:`expert_backward` takes bf16 cotangent rows as they are (the native layer reads
    #: them exactly): the jax layer passes them without a float32 copy.
    bf16_cotangent_rows = True
    #: The forward's stash ``c`` holds +0 (zero bits) in every row past the last slab (the
    #: native layer writes rows of no expert as zero): the jax layer zeroes only the slabs'
    #: alignment padding rows in it (:meth:`zero_rows`), with no select over ``[C, 2I]``.
    stash_zero_past_slabs = True

    def __repr__(self) -> str:
        return "FfiKernels()"

    def with_bf16_weight_grads(self) -> "FfiKernels":
        """This provider with :meth:`expert_backward` returning ``dfc1`` and ``dfc2`` as
        ``bfloat16`` when the operands are plain ``bfloat16`` arrays: the native layer
        rounds the float32 gradients to nearest even (``MOE_EP_BACKWARD_WEIGHT_GRADS_BF16``;
        on tensor cores in the weight-gradient GEMMs' epilogue), the values a cast of the
        float32 result gives. The VJP of a layer with bf16 weights (:mod:`moe_ep_jax.api`)
        uses it, so their cotangents come out in the primal dtype with no cast pass. Other
        operands (float32, block-scaled) keep float32 weight gradients."""
        return _FfiKernelsBf16WeightGrads()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self).__qualname__)

    # formats -----------------------------------------------------------------

    def quantize(self, x: jax.Array, fmt: Any, axis: int = -1) -> Tensor:
        """Encode ``x`` (any float dtype, read exactly) in ``fmt`` along ``axis``
        (the protocol's is the last): ``bfloat16`` array for bf16, else a
        :class:`~moe_ep_jax.formats.BlockScaled` (bit-exact with the spec)."""
        fmt = parse_format(fmt)
        x = jnp.asarray(x)
        axis = block_axis(x.ndim, axis)
        if x.size == 0:
            return F.quantize(x, fmt, axis=axis)
        x = x.astype(_F32)
        shape = tuple(x.shape)
        outer, n, inner = _view(shape, axis)
        data_n, scale_n, data_dtype = _encoded_extents(fmt, n)
        data, scale = _call(
            "moe_ep_quantize", [_sds((outer, data_n, inner), data_dtype), _sds((outer, scale_n, inner), _U8)],
            x.reshape(outer, n, inner), format=_code(fmt),
        )

        def logical(a: jax.Array, extent: int) -> jax.Array:
            s = list(shape)
            s[axis] = extent
            return a.reshape(s)

        return _encoded(fmt, logical(data, data_n), logical(scale, scale_n), n, axis)

    def dequantize(self, x: Tensor) -> jax.Array:
        """Decode to float32, exactly: plain arrays with ``astype``, block-scaled
        ones with the native ``moe_ep_dequantize`` over their ``[outer, n, inner]`` view."""
        if not isinstance(x, F.BlockScaled):
            return jnp.asarray(x).astype(_F32)
        shape = x.shape
        if math.prod(shape) == 0:
            return F.dequantize(x)
        axis = x.axis
        outer, n, inner = _view(shape, axis)
        data = _u8(x.data).reshape(outer, x.data.shape[axis], inner)
        scale = _u8(x.scale).reshape(outer, x.scale.shape[axis], inner)
        (out,) = _call(
            "moe_ep_dequantize", [_sds((outer, n, inner), _F32)], data, scale, format=_code(x.format), n=int(n)
        )
        return out.reshape(shape)

    # plan and combine reduction ------------------------------------------------

    def plan_routes(self, config: MoeEpConfig, topk_idx: jax.Array) -> LocalPlan:
        idx = jnp.asarray(topk_idx).astype(_I32)
        if idx.ndim != 2:
            raise ShapeError(f"topk_idx must have rank 2 (num_tokens, num_topk); got shape {idx.shape}", name="topk_idx")
        if idx.size == 0:
            return _XLA.plan_routes(config, idx)
        routes, e = idx.shape[0] * idx.shape[1], config.num_experts
        send_route, route_pos, route_expert, counts = _call(
            "moe_ep_plan_routes",
            [_sds((routes,), _I32), _sds((routes,), _I32), _sds((routes,), _I32), _sds((e + 1,), _I32)],
            idx,
            num_experts=int(e),
        )
        return LocalPlan(send_route=send_route, route_pos=route_pos, route_expert=route_expert, counts=counts)

    def slot_sum(self, rows: jax.Array, num_tokens: int, num_topk: int) -> jax.Array:
        rows = jnp.asarray(rows).astype(_F32)
        rows = rows.reshape(num_tokens * num_topk, rows.shape[-1])
        if rows.size == 0:
            return _XLA.slot_sum(rows, num_tokens, num_topk)
        (out,) = _call(
            "moe_ep_slot_sum", [_sds((num_tokens, rows.shape[1]), _F32)], rows, num_topk=int(num_topk)
        )
        return out

    def gather_rows(self, x: jax.Array, route: jax.Array, num_topk: int) -> jax.Array:
        """``[M, ...] x.dtype``: row ``i`` is ``x[route[i] // num_topk]``, zero bits where
        ``route[i]`` is -1 (the native ``moe_ep_permute_rows``: whole rows copied as bytes,
        16 at a time where they allow). The jax layer's gathers at one rank, which XLA's
        fusions did with the row index recomputed for every element.

        Args:
            x: ``[rows, ...]`` any dtype (moved as unsigned integers of its width).
            route: ``[M] int32``: -1, or an id in ``[0, rows * num_topk)``.
        """
        x = jnp.asarray(x)
        route = jnp.asarray(route).astype(_I32)
        shape = (route.shape[0],) + tuple(x.shape[1:])
        if x.dtype == jnp.bool_ or x.shape[0] == 0 or math.prod(shape) == 0:
            return gather_route_rows(x, route, num_topk)  # XLA's: shapes no handler sees
        width = jnp.dtype(x.dtype).itemsize
        # The handler copies bytes of any whole-byte dtype: the common float dtypes go as they
        # are (a bit cast around the call can be a copy of its own in XLA); others as uint.
        plain = jnp.issubdtype(x.dtype, jnp.unsignedinteger) or x.dtype in _ROW_DTYPES
        bits = x if plain else lax.bitcast_convert_type(x, f"uint{8 * width}")
        (out,) = _call("moe_ep_permute_rows", [_sds(shape, bits.dtype)], bits, route, num_topk=int(num_topk))
        return out if out.dtype == x.dtype else lax.bitcast_convert_type(out, x.dtype)

    def reduce_rows(self, rows: jax.Array, route_rows: jax.Array, num_tokens: int, num_topk: int,
                    round_trip: Any = None) -> jax.Array:
        """``[T, H] float32``: ``((+0 + rows[r_0]) + rows[r_1]) + ...`` over token t's slots in
        order, ``r_k = route_rows[t*K + k]``, a -1 adding nothing (the native
        ``moe_ep_combine_reduce``). The jax layer's combine at one rank: the routes' rows read
        straight from the buffer, without a gather into route order first.

        Args:
            rows: ``[R, H] float32``, or ``bfloat16`` (read as they are: half the bytes, the
                same sums; ``moe_ep_combine_reduce_bf16``).
            route_rows: ``[T*K] int32``: -1 or a row in ``[0, R)``.
            round_trip: None, or a block format (``mxfp8``, ``nvfp4``): each row read goes
                through its round trip first, bit for bit the format's encode and decode
                (``moe_ep_combine_reduce_round_trip``; float32 rows).
        """
        rows, fmt = _sum_rows(rows, round_trip)
        h = rows.shape[1]
        if num_tokens == 0 or h == 0 or rows.shape[0] == 0:  # nothing any route could read
            return jnp.zeros((num_tokens, h), _F32)
        (out,) = _call("moe_ep_combine_reduce", [_sds((num_tokens, h), _F32)], rows,
                       jnp.asarray(route_rows).astype(_I32), num_topk=int(num_topk), round_trip=_code(fmt))
        return out

    def poison(self, error: jax.Array, x: jax.Array) -> jax.Array:
        """``jnp.where(error, nan, x)`` in ``x``'s dtype (the jax layer's
        :func:`~moe_ep_jax.core.poison`, the same bits) without a pass over ``x``: the native
        ``moe_ep_poison`` overwrites ``x`` in place (aliased) only when the device flag
        ``error`` is set, and leaves it unread otherwise. The layer applies it to the weight
        gradients, the largest arrays of the backward. Other dtypes and empty arrays: the select.

        Args:
            error: ``[] bool``: the layer's data-dependent error flag.
            x: any shape, float32, bfloat16 or float16.
        """
        x = jnp.asarray(x)
        if x.size == 0 or x.dtype not in _POISON_DTYPES:
            return jnp.where(error, jnp.asarray(jnp.nan, x.dtype), x)
        flag = jnp.asarray(error, jnp.bool_).reshape(())
        (out,) = _call("moe_ep_poison", [_sds(x.shape, x.dtype)], x, flag, aliases={0: 0})
        return out

    def zero_rows(self, x: jax.Array, rows: jax.Array) -> jax.Array:
        """``x`` with the listed rows all zero bits (``rows`` ``[N] int32``, -1: none), the
        others untouched: the native ``moe_ep_zero_rows`` writes them in place (aliased), where
        a select would read and write every row. The layer zeroes the stash's alignment
        padding rows with it. Empty arrays and bool: XLA's scatter.

        Args:
            x: ``[R, ...]`` any whole-byte dtype.
            rows: ``[N] int32``: -1 or a row in ``[0, R)``.
        """
        x = jnp.asarray(x)
        rows = jnp.asarray(rows).astype(_I32)
        if x.size == 0 or rows.size == 0 or x.dtype == jnp.bool_:
            keep = jnp.ones((x.shape[0],), jnp.bool_).at[rows].set(False, mode="drop")
            return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))
        (out,) = _call("moe_ep_zero_rows", [_sds(x.shape, x.dtype)], x, rows, aliases={0: 0})
        return out

    # experts -----------------------------------------------------------------

    @staticmethod
    def _expert_attrs(config: MoeEpConfig, combined: bool) -> dict:
        """The expert targets' attributes. ``combined``: the forward returns y after the
        combine format's round trip. The backward passes the same as the one-rank forward
        (:meth:`_one_rank_combined`: a bf16 combine format at one rank), so that both stages
        share one layer object (the round trip changes nothing backward)."""
        clamp = config.gate_up_clamp
        return {
            "apply_topk_in_fc1": bool(config.apply_topk_in_fc1),
            "has_clamp": clamp is not None,
            "gate_up_clamp": np.float32(0.0 if clamp is None else clamp),
            "intermediate_format": _code(config.intermediate_format),
            "combine_format": _code(config.combine_format if combined else None),
            "backward_operand_format": _code(config.backward_operand_format),
        }

    def dequantize_bf16(self, x: F.BlockScaled) -> Tuple[jax.Array, jax.Array]:
        """``(values, inexact)``: an mxfp8 or nvfp4 array's exact values as bfloat16
        (the native ``moe_ep_dequantize_bf16`` over its ``[outer, n, inner]`` view), NaN
        where bf16 cannot hold a value (mxfp8 magnitudes below 2^-126 off bf16's grid:
        scale codes 0..2 only; nvfp4 never), and ``inexact`` ``[] bool``: whether that
        happened. Never rounds."""
        shape = x.shape
        axis = x.axis
        outer, n, inner = _view(shape, axis)
        data = _u8(x.data).reshape(outer, x.data.shape[axis], inner)
        scale = _u8(x.scale).reshape(outer, x.scale.shape[axis], inner)
        bits, flag = _call(
            "moe_ep_dequantize_bf16", [_sds((outer, n, inner), jnp.uint16), _sds((1,), _I32)],
            data, scale, jnp.zeros((1,), _I32), aliases={2: 1}, format=_code(x.format), n=int(n),
        )
        return lax.bitcast_convert_type(bits, jnp.bfloat16).reshape(shape), flag[0] != 0

    def dequantize_bf16_gather(self, tokens: F.BlockScaled, route: jax.Array, num_topk: int
                               ) -> Tuple[jax.Array, jax.Array]:
        """``(values [C, H] bfloat16, inexact [] bool)``: buffer row i is the exact bf16
        decode of token row ``route[i] // num_topk`` (zero where ``route[i]`` is -1), as
        :meth:`dequantize_bf16` of the rows :meth:`gather_rows` would gather, in one pass
        (``moe_ep_dequantize_bf16_gather``: the tokens' codes read where they lie).

        Args:
            tokens: ``[T, H]`` mxfp8 or nvfp4, blocked along its rows (axis 1).
            route: ``[C] int32``: -1 or a route id in ``[0, T * num_topk)``.
        """
        t, h = tokens.shape
        data = _u8(tokens.data).reshape(t, -1)
        scale = _u8(tokens.scale).reshape(t, -1)
        bits, flag = _call(
            "moe_ep_dequantize_bf16_gather", [_sds((route.shape[0], h), jnp.uint16), _sds((1,), _I32)],
            data, scale, jnp.asarray(route).astype(_I32), jnp.zeros((1,), _I32), aliases={3: 1},
            format=_code(tokens.format), n=int(h), num_topk=int(num_topk),
        )
        return lax.bitcast_convert_type(bits, jnp.bfloat16), flag[0] != 0

    @staticmethod
    def _gathers_from(x: Tensor, source: Any) -> bool:
        """Whether the buffer rows ``x`` can be decoded straight from ``source`` ``(tokens,
        route, num_topk)``: both block-scaled in one format, the tokens ``[T, H]`` blocked
        along their rows, something to decode."""
        if source is None or not isinstance(x, F.BlockScaled):
            return False
        tokens = source[0]
        return (isinstance(tokens, F.BlockScaled) and tokens.format is x.format and len(tokens.shape) == 2
                and tokens.axis == 1 and math.prod(tokens.shape) > 0 and math.prod(x.shape) > 0)

    def _exact_rows(self, x: Tensor, source: Any) -> jax.Array:
        """``x``'s float32 values; with a ``source``, gathered from it here (inside the
        exact branch of :meth:`_either`, so that the gathered codes exist only when taken)."""
        if source is None:
            return self.dequantize(x)
        tokens, route, k = source
        return self.dequantize(rebuild(tokens, [self.gather_rows(p, route, k) for p in tensor_parts(tokens)]))

    def _operands(self, x: Tensor, fc1: Tensor, fc2: Tensor, source: Any = None) -> Tuple[Any, ...]:
        """The layer object's operands: ``(x, fc1, fc2, inexact)``.

        - All three plain bfloat16: the arrays themselves (operand dtype bf16: the
          tensor-core GEMMs on CUDA); ``inexact`` None.
        - Block-scaled ones (mxfp8, nvfp4, non-empty) with the others plain bfloat16:
          the block-scaled ones decoded to bfloat16 (:meth:`dequantize_bf16`, exact; x from
          ``source`` ``(tokens, route, num_topk)`` when given, which :meth:`_gathers_from`
          has accepted: :meth:`dequantize_bf16_gather`);
          ``inexact`` ``[] bool``: some value was not a bf16 value (then decoded to NaN;
          the caller takes the float32 path instead, :meth:`_either`).
        - Otherwise all three decoded to float32 (exact); ``inexact`` None.
        """
        ops = (x, fc1, fc2)
        blocked = [isinstance(t, F.BlockScaled) for t in ops]
        if all(b or jnp.asarray(t).dtype == jnp.bfloat16 for t, b in zip(ops, blocked)) and not any(
            b and math.prod(t.shape) == 0 for t, b in zip(ops, blocked)
        ):
            if not any(blocked):
                return jnp.asarray(x), jnp.asarray(fc1), jnp.asarray(fc2), None
            decoded, flags = [], []
            for i, (t, b) in enumerate(zip(ops, blocked)):
                if b and i == 0 and source is not None:  # (a source the caller checked: _gathers_from)
                    values, flag = self.dequantize_bf16_gather(*source)
                    decoded.append(values)
                    flags.append(flag)
                elif b:
                    values, flag = self.dequantize_bf16(t)
                    decoded.append(values)
                    flags.append(flag)
                else:
                    decoded.append(jnp.asarray(t))
            inexact = flags[0]
            for flag in flags[1:]:
                inexact = inexact | flag
            return decoded[0], decoded[1], decoded[2], inexact
        return self.dequantize(x), self.dequantize(fc1), self.dequantize(fc2), None

    def _either(self, inexact: Any, on_tensor_cores: Any, exact: Any) -> Any:
        """``on_tensor_cores()`` (bf16 operands), or ``exact()`` (float32 operands) when
        ``inexact`` (a device flag: ``lax.cond``, no host synchronisation in the program);
        ``inexact`` None: ``on_tensor_cores()``."""
        if inexact is None:
            return on_tensor_cores()
        return lax.cond(inexact, exact, on_tensor_cores)

    def expert_forward(self, config, x, w, fc1, fc2, group_sizes):  # type: ignore[no-untyped-def]
        """``(y [C, H] float32, c [C, 2I] bfloat16)``: ``c`` is the stash itself
        (the bf16 rounding of the pre-clamp FC1 output, which the layer object
        writes in its epilogue), so the jax layer's ``round_to_bf16`` of it is
        the identity."""
        return self._expert_forward(config, x, w, fc1, fc2, group_sizes, combined=False)

    def expert_forward_combined(self, config, x, w, fc1, fc2, group_sizes):  # type: ignore[no-untyped-def]
        """:meth:`expert_forward` with ``y`` after ``config.combine_format``'s round trip,
        done by the layer object in its FC2 epilogue (bit for bit the format's encode and
        decode, on every row). The jax layer at one rank then sums the routes' rows
        straight from the buffer (:meth:`reduce_rows`), with no pass of its own over y.
        A bf16 combine format's ``y`` is ``[C, H] bfloat16`` (its values are bf16 values:
        exact, half the bytes; on CUDA the FC2 GEMM writes it itself where the router
        weight went into FC1); other formats' is float32."""
        return self._expert_forward(config, x, w, fc1, fc2, group_sizes, combined=True)

    def reduce_rows_encode(self, rows: jax.Array, route_rows: jax.Array, num_tokens: int, num_topk: int,
                           out_format: Any, error: Any, round_trip: Any = None) -> Tensor:
        """:meth:`reduce_rows`' ``[T, H]`` sums (``round_trip`` as there), all NaN where
        ``error``, encoded in ``out_format`` in the same pass (the native
        ``moe_ep_combine_reduce_encode``): the bits of ``quantize(poison(error, sums),
        out_format)``, without the float32 sums ever being written.

        Args:
            rows: ``[R, H] float32``, or ``bfloat16`` (no round trip).
            route_rows: ``[T*K] int32``: -1 or a row in ``[0, R)``.
            out_format: bf16, mxfp8 or nvfp4 (blocks along H).
            error: ``[] bool``: the layer's data-dependent error flag.
            round_trip: None, ``mxfp8`` or ``nvfp4`` (float32 rows).

        Returns:
            ``[T, H] bfloat16``, or a :class:`~moe_ep_jax.formats.BlockScaled` blocked along axis 1.
        """
        fmt = parse_format(out_format, name="out_format")
        rows, rt = _sum_rows(rows, round_trip)
        h = rows.shape[1]
        flag = jnp.asarray(error, jnp.bool_).reshape(())
        if num_tokens == 0 or h == 0 or rows.shape[0] == 0:  # nothing any route could read: +0 sums
            sums = jnp.where(flag, jnp.float32(jnp.nan), jnp.zeros((num_tokens, h), _F32))
            return F.round_to_bf16(sums) if fmt is MoeFormat.BF16 else self.quantize(sums, fmt)
        data_n, scale_n, data_dtype = _encoded_extents(fmt, h)
        if fmt is MoeFormat.BF16:  # (the handler writes bfloat16 itself: no bit cast after it)
            data_dtype = jnp.bfloat16
        data, scale = _call("moe_ep_combine_reduce_encode",
                            [_sds((num_tokens, data_n), data_dtype), _sds((num_tokens, scale_n), _U8)],
                            rows, jnp.asarray(route_rows).astype(_I32), flag, num_topk=int(num_topk),
                            round_trip=_code(rt), out_format=_code(fmt))
        return _encoded(fmt, data, scale, h, 1)

    def expert_forward_output(self, config, x, w, fc1, fc2, group_sizes, route_rows, num_tokens, error,  # type: ignore[no-untyped-def]
                              tokens=None, token_route=None, stash=True):
        """``(output, c [C, 2I] bfloat16 or None)``: the fused forward at one rank after the
        dispatch, in two calls: the layer object's experts, then :meth:`reduce_rows_encode`
        (each token's routes summed in slot order, NaN on ``error``, the output encode). A
        block combine format (mxfp8, nvfp4) rounds each row inside the sum (``round_trip``):
        the layer object writes y unrounded and the sum reads it once, where a round trip in
        the FC2 epilogue would read and write all of y first; a bf16 one is rounded by the
        layer object (bf16 rows, :meth:`expert_forward_combined`).

        ``tokens`` ``[T, H]`` and ``token_route`` ``[C] int32`` (the route id of every buffer
        row, -1 for none): the dispatch's source, of which ``x`` is the gather. Block-scaled
        tokens blocked along their rows are then decoded straight from the token rows
        (:meth:`dequantize_bf16_gather`): no gathered copy of the codes is made (in a program
        that keeps no residuals XLA drops the dispatch's gather of ``x``). ``stash`` False:
        the layer object writes no stash and ``c`` is None."""
        k = config.num_topk
        source = (tokens, token_route, k) if tokens is not None and token_route is not None else None
        fmt = config.combine_format
        combined = fmt is MoeFormat.BF16
        y, c = self._expert_forward(config, x, w, fc1, fc2, group_sizes, combined=combined, source=source,
                                    stash=stash)
        rt = None if combined else fmt  # (combine formats: bf16, mxfp8, nvfp4)
        out = self.reduce_rows_encode(y, route_rows, num_tokens, k, config.output_format, error, round_trip=rt)
        return out, (c if stash else None)

    @staticmethod
    def _one_rank_combined(config: MoeEpConfig) -> bool:
        """Whether the layer object rounds y through the combine format at one rank (the
        backward passes the same, so that both stages share one object): bf16 only; the
        block formats round inside the sum (:meth:`expert_forward_output`)."""
        return config.num_ranks == 1 and config.combine_format is MoeFormat.BF16

    def _expert_forward(self, config, x, w, fc1, fc2, group_sizes, combined, source=None, stash=True):  # type: ignore[no-untyped-def]
        source = source if self._gathers_from(x, source) else None
        xs, w1, w2, inexact = self._operands(x, fc1, fc2, source)
        c_rows, h = xs.shape
        i2 = w1.shape[2]
        i = i2 // 2
        if c_rows == 0:  # no rows: nothing to round either
            return _XLA.expert_forward(config, self.dequantize(x), w, self.dequantize(fc1), self.dequantize(fc2),
                                       group_sizes)
        wf, gs = jnp.asarray(w).astype(_F32), jnp.asarray(group_sizes).astype(_I32)
        bf16_y = combined and config.combine_format is MoeFormat.BF16  # the handler's rule: y bf16 iff format bf16
        # No stash asked for: a [0, 2I] one, which the handler reads as "write none".
        results = [_sds((c_rows, h), jnp.bfloat16 if bf16_y else _F32), _sds((c_rows if stash else 0, 2 * i), jnp.bfloat16)]
        attrs = self._expert_attrs(config, combined)

        def run(a: jax.Array, b: jax.Array, d: jax.Array) -> Tuple[jax.Array, jax.Array]:
            y, c = _call("moe_ep_expert_forward", results, a, wf, b, d, gs, **attrs)
            return y, c

        return self._either(
            inexact, lambda: run(xs, w1, w2),
            lambda: run(self._exact_rows(x, source), self.dequantize(fc1), self.dequantize(fc2)),
        )

    def expert_backward(self, config, x, w, fc1, fc2, fc1_c, dy, group_sizes):  # type: ignore[no-untyped-def]
        xs, w1, w2, inexact = self._operands(x, fc1, fc2)
        c_rows, h = xs.shape
        el, _, i2 = w1.shape
        i = i2 // 2
        if c_rows == 0:
            return _XLA.expert_backward(config, self.dequantize(x), w, self.dequantize(fc1), self.dequantize(fc2),
                                        fc1_c, dy, group_sizes)
        dy = jnp.asarray(dy)
        if dy.dtype != jnp.bfloat16:  # a bf16 cotangent enters the layer as is (exact)
            dy = dy.astype(_F32)
        wf, gs = jnp.asarray(w).astype(_F32), jnp.asarray(group_sizes).astype(_I32)
        stash = jnp.asarray(fc1_c).astype(jnp.bfloat16)
        # bf16 weight gradients (with_bf16_weight_grads) for plain bf16 operands only: the float32
        # path of an inexact block-scaled decode (lax.cond) needs the same result types.
        gdt = jnp.bfloat16 if self.bf16_weight_grads and inexact is None and xs.dtype == jnp.bfloat16 else _F32
        results = [_sds((c_rows, h), _F32), _sds((c_rows,), _F32), _sds((el, h, 2 * i), gdt), _sds((el, i, h), gdt)]

        def run(a: jax.Array, b: jax.Array, d: jax.Array) -> Tuple[jax.Array, ...]:
            dx, dw, dfc1, dfc2 = _call("moe_ep_expert_backward", results, a, wf, b, d, stash, dy, gs,
                                       **self._expert_attrs(config, self._one_rank_combined(config)))
            return dx, dw, dfc1, dfc2

        return self._either(
            inexact, lambda: run(xs, w1, w2),
            lambda: run(self.dequantize(x), self.dequantize(fc1), self.dequantize(fc2)),
        )


class _FfiKernelsBf16WeightGrads(FfiKernels):
    """:class:`FfiKernels` whose backward writes bf16 weight gradients for plain bf16
    operands (:meth:`FfiKernels.with_bf16_weight_grads`); equal to every instance of
    its own class only."""

    bf16_weight_grads = True

    def __repr__(self) -> str:
        return "FfiKernels().with_bf16_weight_grads()"

    def with_bf16_weight_grads(self) -> "FfiKernels":
        return self
