"""The three number formats of MoeEp, bit-exact, in numpy.

``bf16``
    IEEE-style bfloat16, round to nearest, ties to even.
``mxfp8``
    Blocks of 32 along one axis. Scale ``s = 2^ceil(log2(amax / 448))`` computed
    exactly, stored as E8M0; data ``E4M3(clamp(x / s, -448, 448))`` round to
    nearest even. An all-zero block has scale code 0 (2^-127) and zero data.
``nvfp4``
    Blocks of 16 along one axis. Scale ``s = E4M3(amax / 6)`` (round to nearest
    even, saturating at 448); data ``E2M1(clamp(x / s, -6, 6))`` with ties to the
    even code, packed two codes per byte along the blocked axis, low nibble first.
    A scale that rounds to zero zeroes its block (signs kept).

Every rounding here is computed on exact values: quotients that are not exact in
float64 are resolved by comparing the input against exactly representable
midpoints, never by multiplying with a rounded reciprocal. Zeros keep their
sign in the data codes. Inputs may be any real float dtype (float64, float32,
float16, bfloat16); they are read exactly.

Storage of a :class:`BlockScaledTensor` (``n`` = logical extent of the blocked
axis, ``B`` = block size):

======  ===========================  ======================  =====================
format  data dtype                   data shape              scale (dtype, shape)
======  ===========================  ======================  =====================
mxfp8   ``ml_dtypes.float8_e4m3fn``  logical shape           ``float8_e8m0fnu``, axis -> ceil(n/B)
nvfp4   ``uint8`` (2 codes a byte)   axis -> ceil(n/2)       ``float8_e4m3fn``, axis -> ceil(n/B)
======  ===========================  ======================  =====================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Union

import ml_dtypes
import numpy as np

from .errors import DTypeError, FormatError, ShapeError

__all__ = [
    "MoeFormat",
    "BlockScaledTensor",
    "parse_format",
    "quantize",
    "dequantize",
    "round_trip",
    "round_to_bf16",
    "block_scale",
    "round_with_scale",
    "block_axis",
    "E4M3_VALUES",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E2M1_MAX",
    "BF16",
    "FLOAT8_E4M3",
    "FLOAT8_E8M0",
    "FLOAT4_E2M1",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FLOAT4_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)

#: Non-negative E4M3 (fn) values, indexed by their 7-bit code 0x00..0x7E.
E4M3_VALUES: np.ndarray = np.arange(0x7F, dtype=np.uint8).view(FLOAT8_E4M3).astype(np.float64)
#: Non-negative E2M1 values, indexed by their 3-bit code 0..7.
E2M1_VALUES: np.ndarray = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E4M3_MIDS = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2  # exact in float64
_E2M1_MIDS = (E2M1_VALUES[:-1] + E2M1_VALUES[1:]) / 2
_E8M0_BIAS = 127


class MoeFormat(str, enum.Enum):
    """An encoding of a tensor in the MoeEp contract."""

    BF16 = "bf16"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"

    @property
    def block_size(self) -> int | None:
        """Elements per scale block along the blocked axis; None for bf16."""
        return {"bf16": None, "mxfp8": 32, "nvfp4": 16}[self.value]

    @property
    def is_block_scaled(self) -> bool:
        return self is not MoeFormat.BF16

    @property
    def data_dtype(self) -> np.dtype:
        return {"bf16": BF16, "mxfp8": FLOAT8_E4M3, "nvfp4": np.dtype(np.uint8)}[self.value]

    @property
    def scale_dtype(self) -> np.dtype | None:
        return {"bf16": None, "mxfp8": FLOAT8_E8M0, "nvfp4": FLOAT8_E4M3}[self.value]

    def __str__(self) -> str:
        return self.value


FormatLike = Union[MoeFormat, str]


def parse_format(fmt: FormatLike, *, name: str = "format") -> MoeFormat:
    """Return the :class:`MoeFormat` for ``fmt`` (a member or its name)."""
    if isinstance(fmt, MoeFormat):
        return fmt
    if isinstance(fmt, str):
        try:
            return MoeFormat(fmt.lower())
        except ValueError:
            pass
    allowed = ", ".join(repr(f.value) for f in MoeFormat)
    raise FormatError(f"{name} must be one of {allowed}; got {fmt!r}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class BlockScaledTensor:
    """A tensor stored as low-precision codes plus one scale per block.

    Attributes:
        data: the codes. mxfp8: ``[logical shape] float8_e4m3fn``; nvfp4:
            ``[logical shape with axis -> ceil(n/2)] uint8``, two E2M1 codes per
            byte along ``axis``, element ``2j`` in the low nibble, ``2j+1`` in the
            high nibble; an odd ``n`` leaves the last high nibble 0.
        scale: ``[logical shape with axis -> ceil(n/B)]``; mxfp8: ``float8_e8m0fnu``
            (power-of-two scales), nvfp4: ``float8_e4m3fn``.
        format: :class:`MoeFormat` ``MXFP8`` or ``NVFP4``.
        shape: the logical shape (of the decoded tensor).
        axis: the blocked axis, normalised to ``0 <= axis < len(shape)``. The last
            block may be partial (``n`` need not be a multiple of ``B``).

    Construction validates every rule above and raises :class:`FormatError`,
    :class:`ShapeError` or :class:`DTypeError`. The arrays are not copied.
    """

    data: np.ndarray
    scale: np.ndarray
    format: MoeFormat
    shape: tuple[int, ...]
    axis: int = -1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every rule of the class docstring again; raise on the first
        broken one. Construction does this; backends call it again because a
        frozen dataclass can still be altered with ``object.__setattr__``."""
        fmt = parse_format(self.format, name="BlockScaledTensor.format")
        if not fmt.is_block_scaled:
            raise FormatError(
                f"BlockScaledTensor.format must be a block-scaled format ('mxfp8' or 'nvfp4'); got {fmt.value!r}"
            )
        object.__setattr__(self, "format", fmt)
        shape = tuple(int(s) for s in self.shape)
        if any(s < 0 for s in shape):
            raise ShapeError(f"BlockScaledTensor.shape must be non-negative; got {shape}", name="shape", got=shape)
        object.__setattr__(self, "shape", shape)
        ndim = len(shape)
        if ndim == 0:
            raise ShapeError("BlockScaledTensor.shape must have at least one axis; got ()", name="shape", got=shape)
        axis = int(self.axis)
        if not -ndim <= axis < ndim:
            raise FormatError(
                f"BlockScaledTensor.axis must be in [-{ndim}, {ndim}) for a {ndim}-d shape {shape}; got {self.axis}"
            )
        axis %= ndim
        object.__setattr__(self, "axis", axis)
        for label, arr, dtype in (("data", self.data, fmt.data_dtype), ("scale", self.scale, fmt.scale_dtype)):
            if not isinstance(arr, np.ndarray):
                raise DTypeError(
                    f"BlockScaledTensor.{label} must be a numpy array; got {type(arr).__name__}",
                    name=label,
                    got=type(arr),
                )
            if arr.dtype != dtype:
                raise DTypeError(
                    f"{fmt.value} {label} must have dtype {dtype.name}; got {arr.dtype.name}",
                    name=label,
                    expected=dtype.name,
                    got=arr.dtype.name,
                )
        parts = (("data", self.data, self.data_shape_for, ""),
                 ("scale", self.scale, self.scale_shape_for, f" (one per {fmt.block_size} elements)"))
        for label, arr, shape_for, note in parts:
            expected = shape_for(fmt, shape, axis)
            if tuple(arr.shape) != expected:
                raise ShapeError(
                    f"{fmt.value} {label} for logical shape {shape} blocked along axis {axis} must have shape "
                    f"{expected}{note}; got {tuple(arr.shape)}",
                    name=label,
                    expected=expected,
                    got=tuple(arr.shape),
                )

    @staticmethod
    def data_shape_for(fmt: FormatLike, shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
        """The data array's shape for a logical ``shape`` blocked along ``axis``."""
        fmt = parse_format(fmt)
        out = list(shape)
        if fmt is MoeFormat.NVFP4:
            out[axis] = _ceil_div(shape[axis], 2)
        return tuple(out)

    @staticmethod
    def scale_shape_for(fmt: FormatLike, shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
        """The scale array's shape for a logical ``shape`` blocked along ``axis``."""
        fmt = parse_format(fmt)
        out = list(shape)
        out[axis] = _ceil_div(shape[axis], fmt.block_size or 1)
        return tuple(out)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def block_size(self) -> int:
        return int(self.format.block_size)  # type: ignore[arg-type]

    def data_codes(self) -> np.ndarray:
        """The data as raw ``uint8`` (mxfp8: one E4M3 code per element; nvfp4: packed)."""
        return self.data.view(np.uint8)

    def scale_codes(self) -> np.ndarray:
        """The scales as raw ``uint8`` codes (E8M0 or E4M3)."""
        return self.scale.view(np.uint8)

    def dequantize(self, dtype: Any = np.float32) -> np.ndarray:
        """Decode to a plain array; see :func:`dequantize`."""
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        return f"BlockScaledTensor(format={self.format.value}, shape={self.shape}, axis={self.axis})"


# ----------------------------------------------------------------------------- rounding


def _as_exact_float64(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == np.float64:
        return arr
    if arr.dtype in (np.float32, np.float16, BF16):
        with np.errstate(invalid="ignore"):  # NaN payloads convert as NaN
            return arr.astype(np.float64)  # exact
    raise DTypeError(
        f"{name} must be a real float array (float64, float32, float16 or bfloat16); got dtype {arr.dtype.name}",
        name=name,
        expected="float64, float32, float16, bfloat16",
        got=arr.dtype.name,
    )


def _nearest_index(magnitude: np.ndarray, mids: np.ndarray, scale: np.ndarray | float = 1.0) -> np.ndarray:
    """Index into a value grid of the value nearest ``magnitude / scale``.

    ``mids`` are the exact midpoints of the grid. ``magnitude >= 0`` is compared
    against ``mids * scale``, which is exact in float64 for the grids here (few
    significant bits), so the result is the correctly rounded code with ties
    going to the even index (= the even code). Values beyond the last midpoint
    get the last index (saturation). NaN magnitudes give index 0; callers
    handle NaN separately.
    """
    magnitude = np.asarray(magnitude, dtype=np.float64)
    if np.ndim(scale) == 0:
        bounds = mids * float(scale)
        idx = np.searchsorted(bounds, magnitude, side="left")  # count of bounds < magnitude
        at = np.minimum(idx, len(bounds) - 1)
        tie = (idx < len(bounds)) & (magnitude == bounds[at]) & ((idx + 1) % 2 == 0)
        idx = idx + tie
        return np.where(np.isnan(magnitude), 0, idx)
    scale = np.asarray(scale, dtype=np.float64)
    idx = np.zeros(np.broadcast_shapes(magnitude.shape, scale.shape), dtype=np.int64)
    for j, mid in enumerate(mids):
        bound = mid * scale
        idx += magnitude > bound
        if (j + 1) % 2 == 0:  # tie between index j and j + 1 goes up when j + 1 is even
            idx += magnitude == bound
    return idx


def round_to_bf16(x: Any) -> np.ndarray:
    """Round to bfloat16, nearest, ties to even, overflow to +-inf; NaN stays NaN.

    Exact for every float input dtype, float64 included (no double rounding).
    Returns a ``bfloat16`` array of the input's shape.
    """
    v = _as_exact_float64(x, "x")
    finite = np.isfinite(v) & (v != 0)
    mant, exp = np.frexp(np.where(finite, v, 1.0))  # v = mant * 2^exp, 0.5 <= |mant| < 1
    del mant
    e = np.maximum(exp - 1, -126)  # binade exponent, clamped at bf16's minimum normal
    quantum = np.ldexp(1.0, e - 7)
    rounded = np.round(np.where(finite, v, 0.0) / quantum) * quantum  # exact: power-of-two scaling
    out = np.where(finite, rounded, v)  # zeros keep their sign, inf and NaN pass through
    # Anything that rounded to 2^128 or beyond overflows to inf; float32 holds that as inf.
    with np.errstate(over="ignore"):
        return out.astype(np.float32).astype(BF16)


def _mxfp8_scale_exponent(amax: np.ndarray) -> np.ndarray:
    """Smallest integer e with amax <= 448 * 2^e, clamped to E8M0's [-127, 127]."""
    safe = np.where((amax > 0) & np.isfinite(amax), amax, 448.0)
    with np.errstate(divide="ignore", over="ignore"):
        e = np.ceil(np.log2(safe / 448.0)).astype(np.int64)
        # log2 is only approximate near binade edges; settle e with exact comparisons.
        e = np.where(safe > np.ldexp(448.0, e), e + 1, e)
        e = np.where(safe <= np.ldexp(448.0, e - 1), e - 1, e)
        e = np.where(safe > np.ldexp(448.0, e), e + 1, e)
    return np.clip(e, -_E8M0_BIAS, _E8M0_BIAS)


def _blocks(v: np.ndarray, axis: int, block: int) -> tuple[np.ndarray, int]:
    """Move ``axis`` last and reshape into ``[..., nblocks, block]`` (zero-padded)."""
    moved = np.moveaxis(v, axis, -1)
    n = moved.shape[-1]
    nblocks = _ceil_div(n, block)
    pad = nblocks * block - n
    if pad:
        moved = np.concatenate([moved, np.zeros(moved.shape[:-1] + (pad,), dtype=moved.dtype)], axis=-1)
    return moved.reshape(moved.shape[:-1] + (nblocks, block)), n


def _unblock(b: np.ndarray, n: int, axis: int) -> np.ndarray:
    flat = b.reshape(b.shape[:-2] + (b.shape[-2] * b.shape[-1],))[..., :n]
    return np.moveaxis(flat, -1, axis)


def block_scale(amax: Any, fmt: FormatLike) -> np.ndarray:
    """The scale (float64 value) a block with maximum magnitude ``amax`` gets.

    mxfp8: ``2^e``, e the smallest integer with ``amax <= 448 * 2^e`` (clamped to
    [-127, 127]; ``2^-127`` for ``amax == 0``). nvfp4: ``E4M3(amax / 6)``, exact,
    saturating at 448 (0 when it rounds to zero).
    """
    fmt = parse_format(fmt)
    a = np.abs(np.asarray(amax, dtype=np.float64))
    if fmt is MoeFormat.MXFP8:
        e = np.where(a == 0, -_E8M0_BIAS, _mxfp8_scale_exponent(a))
        return np.ldexp(1.0, e)
    if fmt is MoeFormat.NVFP4:
        return E4M3_VALUES[_nearest_index(a, _E4M3_MIDS, 6.0)]
    raise FormatError(f"block_scale needs a block-scaled format ('mxfp8' or 'nvfp4'); got {fmt.value!r}")


def round_with_scale(x: Any, scale: Any, fmt: FormatLike) -> np.ndarray:
    """Round ``x`` elementwise to the element grid of ``fmt`` at a given ``scale``
    (broadcastable, float64 values as :func:`block_scale` returns): mxfp8
    ``s * E4M3(clamp(x / s))``, nvfp4 ``s * E2M1(clamp(x / s))`` (0 where s is 0).
    Exact; returns float64 values with the sign of ``x``."""
    fmt = parse_format(fmt)
    v = np.asarray(x, dtype=np.float64)
    s = np.broadcast_to(np.asarray(scale, dtype=np.float64), v.shape)
    mag = np.abs(v)
    if fmt is MoeFormat.MXFP8:
        idx = _nearest_index(np.minimum(mag / s, E4M3_MAX), _E4M3_MIDS)  # x / s exact: s is a power of two
        out = E4M3_VALUES[idx] * s
    elif fmt is MoeFormat.NVFP4:
        idx = np.where(s > 0, _nearest_index(mag, _E2M1_MIDS, s), 0)
        out = E2M1_VALUES[idx] * s
    else:
        raise FormatError(f"round_with_scale needs a block-scaled format ('mxfp8' or 'nvfp4'); got {fmt.value!r}")
    return np.where(np.signbit(v), -out, out)


def _quantize_mxfp8(v: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    blocks, n = _blocks(v, axis, 32)
    mag = np.abs(blocks)
    has_nan = np.isnan(blocks).any(axis=-1) | np.isinf(blocks).any(axis=-1)
    amax = np.where(has_nan, 0.0, mag.max(axis=-1, initial=0.0))
    e = _mxfp8_scale_exponent(amax)
    e = np.where(amax == 0, -_E8M0_BIAS, e)
    scaled = np.abs(np.where(np.isfinite(blocks), blocks, 0.0)) / np.ldexp(1.0, e)[..., None]  # exact
    idx = _nearest_index(np.minimum(scaled, E4M3_MAX), _E4M3_MIDS)
    codes = idx.astype(np.uint8) | np.where(np.signbit(blocks), 0x80, 0).astype(np.uint8)
    # A block holding NaN or Inf has no finite scale: it decodes to NaN throughout.
    codes = np.where(has_nan[..., None], np.uint8(0x7F), codes)
    scale_codes = np.where(has_nan, 0xFF, e + _E8M0_BIAS).astype(np.uint8)
    data = _unblock(codes, n, axis).view(FLOAT8_E4M3)
    scale = np.moveaxis(scale_codes, -1, axis).view(FLOAT8_E8M0)
    return np.ascontiguousarray(data), np.ascontiguousarray(scale)


def _quantize_nvfp4(v: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    blocks, n = _blocks(v, axis, 16)
    nonfinite = ~np.isfinite(blocks).all(axis=-1)
    mag = np.abs(np.where(np.isfinite(blocks), blocks, 0.0))
    amax = mag.max(axis=-1, initial=0.0)
    # E4M3(amax / 6), exact: compare amax against 6 * (exact E4M3 midpoints).
    sidx = _nearest_index(amax, _E4M3_MIDS, 6.0)  # saturates at 448 (index 0x7E)
    scale_val = E4M3_VALUES[sidx]
    didx = _nearest_index(mag, _E2M1_MIDS, scale_val[..., None])  # E2M1(clamp(x / s)), exact
    didx = np.where(scale_val[..., None] == 0, 0, didx)  # a zero scale zeroes its block
    codes = didx.astype(np.uint8) | np.where(np.signbit(blocks), 0x8, 0).astype(np.uint8)
    # A block holding NaN or Inf gets the NaN scale code (0x7F): it decodes to NaN.
    scale_codes = np.where(nonfinite, 0x7F, sidx).astype(np.uint8)
    flat = _unblock(codes, n, axis)
    flat = np.moveaxis(flat, axis, -1)
    if n % 2:
        flat = np.concatenate([flat, np.zeros(flat.shape[:-1] + (1,), dtype=np.uint8)], axis=-1)
    packed = (flat[..., 0::2] & 0xF) | ((flat[..., 1::2] & 0xF) << 4)
    data = np.moveaxis(packed.astype(np.uint8), -1, axis)
    scale = np.moveaxis(scale_codes, -1, axis).view(FLOAT8_E4M3)
    return np.ascontiguousarray(data), np.ascontiguousarray(scale)


def block_axis(ndim: int, axis: int) -> int:
    """The blocked axis of an ``ndim``-d input as ``0 <= axis < ndim``: the one
    rule every quantizer (numpy, native, FFI) applies. Raises
    :class:`ShapeError` for a scalar and :class:`FormatError` outside
    ``[-ndim, ndim)``."""
    if ndim == 0:
        raise ShapeError("quantize needs at least one axis for a block-scaled format; got a scalar", name="x")
    if not -ndim <= axis < ndim:
        raise FormatError(f"axis must be in [-{ndim}, {ndim}) for a {ndim}-d input; got {axis}")
    return axis % ndim


def quantize(x: Any, fmt: FormatLike, *, axis: int = -1) -> Union[BlockScaledTensor, np.ndarray]:
    """Encode ``x`` in ``fmt``.

    Args:
        x: ``[any shape]`` float64/float32/float16/bfloat16: the values, read exactly.
        fmt: ``"bf16"``, ``"mxfp8"`` or ``"nvfp4"``.
        axis: the blocked axis for block-scaled formats (ignored for bf16). The
            extent along it need not be a multiple of the block size: the last
            block is then partial.

    Returns:
        bf16: a ``bfloat16`` array (see :func:`round_to_bf16`). Otherwise a
        :class:`BlockScaledTensor`. A block that holds NaN or +-Inf gets the NaN
        scale code (E8M0 0xFF, E4M3 0x7F) so that the whole block decodes to NaN;
        other blocks are unaffected.
    """
    fmt = parse_format(fmt)
    v = _as_exact_float64(x, "x")
    if fmt is MoeFormat.BF16:
        return round_to_bf16(v)
    axis = block_axis(v.ndim, axis)
    if fmt is MoeFormat.MXFP8:
        data, scale = _quantize_mxfp8(v, axis)
    else:
        data, scale = _quantize_nvfp4(v, axis)
    return BlockScaledTensor(data=data, scale=scale, format=fmt, shape=tuple(v.shape), axis=axis)


def _decode_e2m1(nibbles: np.ndarray) -> np.ndarray:
    mag = E2M1_VALUES[nibbles & 0x7]
    return np.where(nibbles & 0x8, -mag, mag)


def dequantize(t: Union[BlockScaledTensor, np.ndarray], dtype: Any = np.float32) -> np.ndarray:
    """Decode a :class:`BlockScaledTensor` (or a plain float array) to ``dtype``.

    Decoding is exact in float64; float32 is exact too except where a block's
    value overflows float32 (scale near 2^127), which becomes +-inf.
    """
    out_dtype = np.dtype(dtype)
    if isinstance(t, np.ndarray):
        return _as_exact_float64(t, "t").astype(out_dtype)
    if not isinstance(t, BlockScaledTensor):
        raise DTypeError(
            f"dequantize takes a BlockScaledTensor or a numpy float array; got {type(t).__name__}",
            name="t",
            got=type(t),
        )
    axis, n, block = t.axis, t.shape[t.axis], t.block_size
    if t.format is MoeFormat.MXFP8:
        vals = t.data.astype(np.float64)
        scale_codes = t.scale_codes().astype(np.int64)
        scale = np.where(scale_codes == 0xFF, np.nan, np.ldexp(1.0, scale_codes - _E8M0_BIAS))
    else:
        packed = np.moveaxis(t.data_codes(), axis, -1)
        nib = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
        vals = np.moveaxis(_decode_e2m1(nib[..., :n]), -1, axis)
        scale = t.scale.astype(np.float64)
    scale_full = np.repeat(scale, block, axis=axis)
    scale_full = np.take(scale_full, np.arange(n), axis=axis)
    with np.errstate(over="ignore", invalid="ignore"):
        return (vals * scale_full).astype(out_dtype)


def round_trip(x: Any, fmt: FormatLike | None, *, axis: int = -1) -> np.ndarray:
    """``dequantize(quantize(x, fmt, axis=axis))`` in float64; identity for None."""
    v = _as_exact_float64(x, "x")
    if fmt is None:
        return v
    q = quantize(v, fmt, axis=axis)
    if isinstance(q, BlockScaledTensor):
        return dequantize(q, np.float64)
    return q.astype(np.float64)
