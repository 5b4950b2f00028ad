"""The spec's formats in ``jax.numpy``, bit-exact with :mod:`moe_ep_spec.formats`.

Every rounding decision is made on the integer bit patterns of float32 values,
never with float arithmetic on values that may be subnormal:

- XLA:CPU runs with denormals flushed to zero (FTZ/DAZ), so ``x / 2**e`` or
  ``x * s`` on a subnormal float32 gives 0 there, and an mxfp8 block of
  subnormals (scale ``2^-127``) would encode as zeros;
- XLA may drop a float32 -> bfloat16 -> float32 convert pair as "excess
  precision", which would remove a rounding point of the spec.

Integer arithmetic is immune to both, so the same codes come out on every XLA
platform. The float multiplications that remain (nvfp4 thresholds
``midpoint * scale``) only ever see normal float32 values and are exact.

Formats (``n`` = extent of the blocked axis, ``B`` = block size):

======  =========================  ===========================  ==================================
format  data                       scale                        rule
======  =========================  ===========================  ==================================
bf16    ``[...] bfloat16``         (none)                       round to nearest even, overflow to inf
mxfp8   ``[...] float8_e4m3fn``    ``[..., ceil(n/32)] e8m0``   ``s = 2^e``, e smallest with ``amax <= 448 * 2^e``
nvfp4   ``[..., ceil(n/2)] uint8`` ``[..., ceil(n/16)] e4m3``   ``s = E4M3(amax / 6)``, data E2M1, two codes a byte
======  =========================  ===========================  ==================================

A block holding NaN or +-inf gets the NaN scale code (E8M0 ``0xFF``, E4M3
``0x7F``); mxfp8 data of such a block is ``0x7F`` throughout, nvfp4 data keeps
the finite elements' codes and encodes non-finite ones as signed zeros, exactly
as the numpy reference does.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from .devices import prepare_environment as _prepare_environment

_prepare_environment()  # XLA_FLAGS must ask for enough CPU devices before jax's first import

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from moe_ep_spec.errors import DTypeError, FormatError, ShapeError
from moe_ep_spec.formats import E2M1_VALUES, E4M3_VALUES, BlockScaledTensor, MoeFormat, parse_format

__all__ = ["BlockScaled", "quantize", "dequantize", "decode", "round_trip", "round_to_bf16", "bf16_round_trip",
           "from_numpy", "to_numpy", "PLAIN_DTYPES"]

#: Plain float dtypes the layer accepts for activations, weights and cotangents.
PLAIN_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

_U32 = jnp.uint32
_I32 = jnp.int32
_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_HI16 = np.uint32(0xFFFF0000)

_BLOCK = {MoeFormat.MXFP8: 32, MoeFormat.NVFP4: 16}
_DATA_DTYPE = {MoeFormat.MXFP8: jnp.dtype(jnp.float8_e4m3fn), MoeFormat.NVFP4: jnp.dtype(jnp.uint8)}
_SCALE_DTYPE = {MoeFormat.MXFP8: jnp.dtype(jnp.float8_e8m0fnu), MoeFormat.NVFP4: jnp.dtype(jnp.float8_e4m3fn)}

# Decode tables (host constants; every entry exact in float32).
_E4M3_LUT = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # NaN at 0x7F, 0xFF
_E2M1_LUT = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)  # nibble -> value (bit 3 = sign)
_E4M3_POS = E4M3_VALUES.astype(np.float32)  # code 0x00..0x7E -> value
# nvfp4 scale: E4M3(amax / 6) is the index of amax among 6 * (E4M3 midpoints); each
# 6 * midpoint has at most 7 significant bits and is a normal float32: exact.
_NV_SCALE_BOUNDS = (6.0 * (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2).astype(np.float32).view(np.uint32)
_E2M1_MIDS = ((E2M1_VALUES[:-1] + E2M1_VALUES[1:]) / 2).astype(np.float32)
# A tie between grid index j and j + 1 goes up when j + 1 is even (the even code).
_TIE_UP_126 = (np.arange(126) + 1) % 2 == 0
_TIE_UP_7 = (np.arange(7) + 1) % 2 == 0


# ----------------------------------------------------------------------------- the container


@jax.tree_util.register_pytree_node_class
class BlockScaled:
    """A block-scaled tensor as a JAX pytree (two array leaves, the rest static).

    Attributes:
        data: mxfp8: ``[logical shape] float8_e4m3fn`` (one E4M3 code per element);
            nvfp4: ``[logical shape with axis -> ceil(n/2)] uint8``, two E2M1 codes
            a byte along ``axis``, element ``2j`` in the low nibble, ``2j+1`` in
            the high nibble (an odd ``n`` leaves the last high nibble 0).
        scale: ``[logical shape with axis -> ceil(n/B)]``: mxfp8
            ``float8_e8m0fnu`` (E8M0, ``0xFF`` = NaN), nvfp4 ``float8_e4m3fn``.
        format: :class:`~moe_ep_spec.MoeFormat` ``MXFP8`` or ``NVFP4`` (static).
        n: the logical extent of the blocked axis (static). Need not be a
            multiple of the block size ``B`` (32 or 16): the last block may be partial.
        axis: the blocked axis, ``0 <= axis < data.ndim`` (static).

    The same layout as :class:`moe_ep_spec.formats.BlockScaledTensor`
    (:func:`from_numpy` / :func:`to_numpy` convert without copying codes). The
    logical shape is derived from ``data``, so the object stays consistent when
    ``jax.shard_map`` splits a non-blocked axis (tokens, experts) across ranks.
    """

    __slots__ = ("data", "scale", "format", "n", "axis")

    def __init__(self, data: Any, scale: Any, format: Union[MoeFormat, str], n: int, axis: int = -1) -> None:
        self.data = data
        self.scale = scale
        self.format = parse_format(format)
        self.n = int(n)
        nd = getattr(data, "ndim", None)
        self.axis = int(axis) % nd if isinstance(nd, int) and nd > 0 else int(axis)

    def tree_flatten(self) -> Tuple[Tuple[Any, Any], Tuple[MoeFormat, int, int]]:
        return (self.data, self.scale), (self.format, self.n, self.axis)

    @classmethod
    def tree_unflatten(cls, aux: Tuple[MoeFormat, int, int], children: Tuple[Any, Any]) -> "BlockScaled":
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        obj.format, obj.n, obj.axis = aux
        return obj

    @property
    def shape(self) -> Tuple[int, ...]:
        """The logical shape (of the decoded tensor)."""
        s = list(self.data.shape)
        s[self.axis] = self.n
        return tuple(s)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def block_size(self) -> int:
        return _BLOCK[self.format]

    def validate(self, name: str = "tensor") -> None:
        """Raise :class:`FormatError`, :class:`DTypeError` or :class:`ShapeError`
        when data and scale do not describe a tensor of this format."""
        fmt = self.format
        if fmt not in _BLOCK:
            raise FormatError(f"{name}: BlockScaled.format must be 'mxfp8' or 'nvfp4'; got {fmt.value!r}")
        for label, arr, dtype in (("data", self.data, _DATA_DTYPE[fmt]), ("scale", self.scale, _SCALE_DTYPE[fmt])):
            got = getattr(arr, "dtype", None)
            if got is None or jnp.dtype(got) != dtype:
                raise DTypeError(
                    f"{name}: {fmt.value} {label} must have dtype {dtype.name}; got {getattr(got, 'name', type(arr).__name__)}",
                    name=label,
                    expected=dtype.name,
                    got=str(got),
                )
        shape = self.shape
        want_data = BlockScaledTensor.data_shape_for(fmt, shape, self.axis)
        want_scale = BlockScaledTensor.scale_shape_for(fmt, shape, self.axis)
        if tuple(self.data.shape) != want_data or tuple(self.scale.shape) != want_scale:
            raise ShapeError(
                f"{name}: {fmt.value} data {tuple(self.data.shape)} and scale {tuple(self.scale.shape)} must have shapes "
                f"{want_data} and {want_scale} for logical shape {shape} blocked along axis {self.axis} "
                f"(one scale per {self.block_size} elements)",
                name=name,
                expected=(want_data, want_scale),
                got=(tuple(self.data.shape), tuple(self.scale.shape)),
            )

    def __repr__(self) -> str:
        return f"BlockScaled(format={self.format.value}, shape={self.shape}, axis={self.axis})"


def from_numpy(t: BlockScaledTensor) -> BlockScaled:
    """A :class:`moe_ep_spec.formats.BlockScaledTensor` as a :class:`BlockScaled` of jax arrays."""
    return BlockScaled(jnp.asarray(t.data), jnp.asarray(t.scale), t.format, t.shape[t.axis], t.axis)


def to_numpy(t: BlockScaled) -> BlockScaledTensor:
    """A :class:`BlockScaled` (concrete arrays) as a numpy :class:`BlockScaledTensor`."""
    fmt = t.format
    data = np.asarray(t.data)
    scale = np.asarray(t.scale)
    return BlockScaledTensor(
        data=data.view(fmt.data_dtype) if data.dtype != fmt.data_dtype else data,
        scale=scale.view(fmt.scale_dtype) if scale.dtype != fmt.scale_dtype else scale,
        format=fmt,
        shape=t.shape,
        axis=t.axis,
    )


# ----------------------------------------------------------------------------- bit helpers


def _bits(x: jax.Array) -> jax.Array:
    """uint32 bit pattern of ``x`` read as float32 (conversion from f16/bf16 is exact)."""
    return lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), _U32)


def _from_bits(u: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(u.astype(_U32), jnp.float32)


def _codes(x: jax.Array) -> jax.Array:
    """One-byte codes (float8 or uint8 arrays) as uint8."""
    return x if x.dtype == jnp.uint8 else lax.bitcast_convert_type(x, jnp.uint8)


def _shift_rne(m: jax.Array, sh: jax.Array) -> jax.Array:
    """``round_half_even(m * 2^sh)`` for uint32 ``m < 2^24`` and int32 ``sh``
    (a left shift never has to overflow: callers keep the result below 2^5)."""
    left = jnp.clip(sh, 0, 31).astype(_U32)
    r = jnp.clip(-sh, 0, 31).astype(_U32)
    base = lax.shift_right_logical(m, r)
    rem = m & (lax.shift_left(jnp.ones_like(m), r) - np.uint32(1))
    half = lax.shift_left(jnp.ones_like(m), jnp.maximum(r, np.uint32(1)) - np.uint32(1))
    up = (r > 0) & ((rem > half) | ((rem == half) & ((base & np.uint32(1)) == 1)))
    return jnp.where(sh >= 0, lax.shift_left(m, left), base + up.astype(_U32))


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """``[..., n]`` -> ``[..., ceil(n/block), block]`` (zero-padded)."""
    n = x.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (nb, block))


def _unblock(b: jax.Array, n: int) -> jax.Array:
    return b.reshape(b.shape[:-2] + (b.shape[-2] * b.shape[-1],))[..., :n]


# ----------------------------------------------------------------------------- bf16


def _bf16_bits(u: jax.Array) -> jax.Array:
    """Round float32 bits to bfloat16 (nearest, ties to even), as float32 bits.
    Overflow goes to +-inf; NaN stays NaN (quieted); zeros keep their sign."""
    nan = (u & _ABS) > _INF
    rounded = (u + (np.uint32(0x7FFF) + (lax.shift_right_logical(u, np.uint32(16)) & np.uint32(1)))) & _HI16
    return jnp.where(nan, (u | np.uint32(0x00400000)) & _HI16, rounded)


def round_to_bf16(x: jax.Array) -> jax.Array:
    """``[...]`` float -> ``[...] bfloat16``: round to nearest even from the exact
    float32 value (one rounding), overflow to +-inf. A bfloat16 ``x`` is its own
    rounding (only its NaNs are quieted, as from float32): no float32 pass."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        b = lax.bitcast_convert_type(x, jnp.uint16)
        nan = (b & np.uint16(0x7FFF)) > np.uint16(0x7F80)
        return lax.bitcast_convert_type(jnp.where(nan, b | np.uint16(0x0040), b), jnp.bfloat16)
    r = _bf16_bits(_bits(x))
    return lax.bitcast_convert_type(lax.shift_right_logical(r, np.uint32(16)).astype(jnp.uint16), jnp.bfloat16)


def bf16_round_trip(x: jax.Array) -> jax.Array:
    """``[...]`` float -> ``[...] float32`` holding the bf16 rounding of ``x``
    (a rounding point XLA cannot remove)."""
    return _from_bits(_bf16_bits(_bits(x)))


# ----------------------------------------------------------------------------- mxfp8


def _e4m3_codes(mag: jax.Array, e: jax.Array) -> jax.Array:
    """E4M3 magnitude code (0..0x7E, saturating) of ``min(|x| / 2^e, 448)``,
    round to nearest even, from the float32 bits ``mag`` (non-negative, finite)."""
    ex = lax.shift_right_logical(mag, np.uint32(23)).astype(_I32)
    fx = mag & np.uint32(0x7FFFFF)
    m = jnp.where(ex > 0, fx | np.uint32(0x800000), fx)  # |x| = m * 2^q exactly
    q = jnp.where(ex > 0, ex - 150, -149)
    bitlen = 32 - lax.clz(m).astype(_I32)
    bv = bitlen - 1 + q - e  # binade of v = |x| / 2^e
    bq = jnp.maximum(bv, -6)  # E4M3 quantum is 2^(bq - 3); subnormals below 2^-6
    n = _shift_rne(m, q - e - (bq - 3)).astype(_I32)  # v / quantum, rounded: 0..16
    code = (bq + 6) * 8 + n  # a carry to 16 lands on the next binade's first code
    return jnp.where(m == 0, 0, jnp.minimum(code, 0x7E)).astype(_U32)


def _block_parts(u: jax.Array, block: int) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """float32 bits ``[..., n]`` in blocks: (magnitude bits ``[..., nb, block]`` with
    non-finite elements zeroed, sign bits, ``[..., nb]`` whether the block holds NaN
    or inf, ``[..., nb]`` the largest finite magnitude)."""
    b = _blocks(u, block)
    mag = b & _ABS
    sign = lax.shift_right_logical(b, np.uint32(31))
    nonfinite = mag >= _INF
    mag = jnp.where(nonfinite, np.uint32(0), mag)
    return mag, sign, jnp.any(nonfinite, axis=-1), jnp.max(mag, axis=-1)


def _quantize_mxfp8_last(u: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """float32 bits ``[..., n]`` -> (data codes ``[..., n]`` uint8, E8M0 codes ``[..., ceil(n/32)]`` uint8)."""
    n = u.shape[-1]
    mag, sign, bad, amax = _block_parts(u, 32)
    ea = lax.shift_right_logical(amax, np.uint32(23)).astype(_I32)
    frac = amax & np.uint32(0x7FFFFF)
    # amax = 1.f * 2^(ea - 127); 448 = 1.75 * 2^8: e = k - 8, plus one when 1.f > 1.75.
    # Zero or subnormal amax lies below 448 * 2^-127: e = -127.
    e = jnp.where(ea == 0, -127, ea - 135 + (frac > np.uint32(0x600000)).astype(_I32))
    e = jnp.clip(e, -127, 127)
    codes = _e4m3_codes(mag, e[..., None]) | lax.shift_left(sign, np.uint32(7))
    codes = jnp.where(bad[..., None], np.uint32(0x7F), codes)
    scale = jnp.where(bad, 0xFF, e + 127)
    return _unblock(codes, n).astype(jnp.uint8), scale.astype(jnp.uint8)


def _ldexp_exact(v: jax.Array, k: jax.Array) -> jax.Array:
    """``v * 2^k`` for float32 ``v`` that are zero, NaN or normal with at most a
    few significant bits (E4M3 values), built from bits: subnormal results are
    exact (no flush to zero), overflow gives +-inf."""
    u = _bits(v)
    sign = u & _SIGN
    mag = u & _ABS
    ex = lax.shift_right_logical(mag, np.uint32(23)).astype(_I32)
    new_e = ex + k
    normal = (mag.astype(_I32) + k * (1 << 23)).astype(_U32)
    m = (mag & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    sub = _shift_rne(m, new_e - 1)
    out = jnp.where(new_e >= 255, _INF, jnp.where(new_e >= 1, normal, sub))
    out = jnp.where(mag == 0, np.uint32(0), out)
    out = jnp.where(mag > _INF, np.uint32(0x7FC00000), out)
    return _from_bits(out | sign)


def _decode_mxfp8_last(data: jax.Array, scale: jax.Array, n: int) -> jax.Array:
    vals = jnp.asarray(_E4M3_LUT)[_codes(data).astype(_I32)]
    codes = _codes(scale).astype(_I32)
    full = jnp.repeat(codes, 32, axis=-1, total_repeat_length=codes.shape[-1] * 32)[..., :n]
    out = _ldexp_exact(vals, full - 127)
    return jnp.where(full == 0xFF, jnp.float32(jnp.nan), out)


# ----------------------------------------------------------------------------- nvfp4


def _count_above(mag: jax.Array, bounds_bits: jax.Array, tie_up: np.ndarray) -> jax.Array:
    """Index into a grid of the value nearest ``mag`` given the grid's midpoints
    (float32 bits, increasing): midpoints below, plus one at a tie that goes up."""
    mag = mag[..., None]
    above = (mag > bounds_bits).astype(_I32)
    tie = ((mag == bounds_bits) & jnp.asarray(tie_up)).astype(_I32)
    return jnp.sum(above + tie, axis=-1)


def _quantize_nvfp4_last(u: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """float32 bits ``[..., n]`` -> (packed data ``[..., ceil(n/2)]`` uint8, E4M3 scale codes ``[..., ceil(n/16)]`` uint8)."""
    n = u.shape[-1]
    mag, sign, bad, amax = _block_parts(u, 16)
    sidx = _count_above(amax, jnp.asarray(_NV_SCALE_BOUNDS), _TIE_UP_126)  # saturates at 0x7E (448)
    s = jnp.asarray(_E4M3_POS)[sidx]
    # E2M1(|x| / s) against the exact thresholds midpoint * s (normal float32, exact).
    thresholds = _bits(jnp.asarray(_E2M1_MIDS) * s[..., None])  # [..., nb, 7]
    idx = _count_above(mag, thresholds[..., None, :], _TIE_UP_7)
    idx = jnp.where((s == 0)[..., None], 0, idx)  # a zero scale zeroes its block (signs kept)
    codes = idx.astype(_U32) | lax.shift_left(sign, np.uint32(3))
    flat = _unblock(codes, n)
    if n % 2:
        flat = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, 1)])
    packed = (flat[..., 0::2] & np.uint32(0xF)) | lax.shift_left(flat[..., 1::2] & np.uint32(0xF), np.uint32(4))
    scale = jnp.where(bad, 0x7F, sidx)
    return packed.astype(jnp.uint8), scale.astype(jnp.uint8)


def _decode_nvfp4_last(data: jax.Array, scale: jax.Array, n: int) -> jax.Array:
    packed = _codes(data).astype(_I32)
    nib = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))[..., :n]
    vals = jnp.asarray(_E2M1_LUT)[nib]
    s = jnp.asarray(_E4M3_LUT)[_codes(scale).astype(_I32)]
    full = jnp.repeat(s, 16, axis=-1, total_repeat_length=s.shape[-1] * 16)[..., :n]
    return vals * full  # both factors have <= 4 significant bits, product >= 2^-10: exact


# ----------------------------------------------------------------------------- public


def quantize(x: jax.Array, fmt: Union[MoeFormat, str], axis: int = -1) -> Union[BlockScaled, jax.Array]:
    """Encode ``x`` in ``fmt``, bit-exact with :func:`moe_ep_spec.formats.quantize`.

    Args:
        x: ``[any shape]`` float32/float16/bfloat16: the values, read exactly.
        fmt: ``bf16``, ``mxfp8`` or ``nvfp4``.
        axis: the blocked axis (block formats). Its extent need not be a
            multiple of the block size.

    Returns:
        bf16: ``[same shape] bfloat16``. Otherwise a :class:`BlockScaled`.
    """
    fmt = parse_format(fmt)
    if fmt is MoeFormat.BF16:
        return round_to_bf16(x)
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ShapeError("quantize needs at least one axis for a block-scaled format; got a scalar", name="x")
    axis %= x.ndim
    u = jnp.moveaxis(_bits(x), axis, -1)
    n = u.shape[-1]
    if fmt is MoeFormat.MXFP8:
        data, scale = _quantize_mxfp8_last(u)
    else:
        data, scale = _quantize_nvfp4_last(u)
    data = jnp.moveaxis(data, -1, axis)
    scale = jnp.moveaxis(scale, -1, axis)
    return BlockScaled(
        lax.bitcast_convert_type(data, _DATA_DTYPE[fmt]) if fmt is MoeFormat.MXFP8 else data,
        lax.bitcast_convert_type(scale, _SCALE_DTYPE[fmt]),
        fmt,
        n,
        axis,
    )


def dequantize(t: BlockScaled) -> jax.Array:
    """Decode a :class:`BlockScaled` to its logical shape in float32: exact,
    subnormal results included, except overflow of float32 (+-inf)."""
    if not isinstance(t, BlockScaled):
        raise DTypeError(f"dequantize takes a BlockScaled; got {type(t).__name__}", name="t", got=type(t))
    axis = t.axis
    data = jnp.moveaxis(t.data, axis, -1)
    scale = jnp.moveaxis(t.scale, axis, -1)
    if t.format is MoeFormat.MXFP8:
        out = _decode_mxfp8_last(data, scale, t.n)
    else:
        out = _decode_nvfp4_last(data, scale, t.n)
    return jnp.moveaxis(out, -1, axis)


def decode(x: Union[BlockScaled, jax.Array]) -> jax.Array:
    """The exact float32 value of a plain array or a :class:`BlockScaled`."""
    if isinstance(x, BlockScaled):
        return dequantize(x)
    return jnp.asarray(x).astype(jnp.float32)


def round_trip(x: jax.Array, fmt: Optional[MoeFormat]) -> jax.Array:
    """``dequantize(quantize(x, fmt))`` along the last axis, float32; identity
    (as float32) for None."""
    x = jnp.asarray(x).astype(jnp.float32)
    if fmt is None:
        return x
    fmt = parse_format(fmt)
    if fmt is MoeFormat.BF16:
        return bf16_round_trip(x)
    return dequantize(quantize(x, fmt, axis=-1))  # type: ignore[arg-type]
