"""Bit-exact tests of the three MoeEp formats (design brief section 2).

Every expected code here is computed independently of ``moe_ep_spec.formats``:
from the golden vectors of an independent implementation, from raw bit
patterns, or from hand-derived tables.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from format_inputs import load_golden
from moe_ep_spec import (BlockScaledTensor, DTypeError, FormatError, MoeFormat, ShapeError, dequantize, quantize,
                         round_to_bf16, round_trip)

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

GOLDEN_CATEGORIES = ["heavy_tail", "mxfp8_binade_edge", "nvfp4_ties", "random", "saturation", "tiny", "zeros"]

# E4M3 (fn) value of every code 0x00..0x7E, decoded from the bit pattern by hand
# (not through ml_dtypes): subnormals m * 2^-9, normals (1 + m/8) * 2^(e - 7).
_E4M3_POS = np.array(
    [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)][:0x7F]
)
# E2M1 value of every 3-bit magnitude code.
_E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e4m3_value(code: int) -> float:
    mag = _E4M3_POS[code & 0x7F]
    return -mag if code & 0x80 else mag


def _e2m1_value(nibble: int) -> float:
    mag = _E2M1_POS[nibble & 0x7]
    return -mag if nibble & 0x8 else mag


def _unpack(packed: np.ndarray, n: int) -> np.ndarray:
    """Unpack nvfp4 bytes along the last axis into ``n`` nibbles (low nibble first)."""
    lo, hi = packed & 0xF, packed >> 4
    return np.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))[..., :n]


# ============================================================================ golden vectors


@pytest.fixture(scope="module")
def golden():
    return load_golden()


def test_golden_file_has_every_documented_category(golden):
    cats = sorted({k.split("/")[0] for k in golden})
    assert cats == GOLDEN_CATEGORIES
    for c in cats:
        rows = golden[f"{c}/input"].shape[0]
        assert rows > 0
        assert golden[f"{c}/input"].shape == (rows, 64) and golden[f"{c}/input"].dtype == np.float32
        assert golden[f"{c}/bf16_bits"].shape == (rows, 64)
        assert golden[f"{c}/mxfp8_data_bits"].shape == (rows, 64)
        assert golden[f"{c}/mxfp8_scale_bits"].shape == (rows, 2)
        assert golden[f"{c}/nvfp4_data_packed"].shape == (rows, 32)
        assert golden[f"{c}/nvfp4_scale_bits"].shape == (rows, 4)


@pytest.mark.parametrize("cat", GOLDEN_CATEGORIES)
def test_golden_bf16(golden, cat):
    x = golden[f"{cat}/input"]
    want = golden[f"{cat}/bf16_bits"]
    got = round_to_bf16(x)
    assert got.dtype == BF16 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint16), want)
    via_quantize = quantize(x, "bf16")
    np.testing.assert_array_equal(np.asarray(via_quantize).view(np.uint16), want)
    # float64 input of the same values gives the same bits
    np.testing.assert_array_equal(round_to_bf16(x.astype(np.float64)).view(np.uint16), want)


#: format -> (golden key of its data codes, of its scale codes, data dtype, scale dtype)
_GOLDEN_CODES = {"mxfp8": ("mxfp8_data_bits", "mxfp8_scale_bits", E4M3, E8M0),
                 "nvfp4": ("nvfp4_data_packed", "nvfp4_scale_bits", np.dtype(np.uint8), E4M3)}


def _golden_quantized(golden, cat, fmt):
    """``(x, q, want_data, want_scale)``: category ``cat``'s golden input quantized to
    ``fmt``, its codes checked against the golden ones (format, dtypes, data, scales)."""
    data_key, scale_key, data_dtype, scale_dtype = _GOLDEN_CODES[fmt]
    x = golden[f"{cat}/input"]
    want_data, want_scale = golden[f"{cat}/{data_key}"], golden[f"{cat}/{scale_key}"]
    q = quantize(x, fmt)
    assert isinstance(q, BlockScaledTensor) and q.format is MoeFormat(fmt)
    assert q.data.dtype == data_dtype and q.scale.dtype == scale_dtype
    np.testing.assert_array_equal(q.data_codes(), want_data)
    np.testing.assert_array_equal(q.scale_codes(), want_scale)
    return x, q, want_data, want_scale


@pytest.mark.parametrize("cat", GOLDEN_CATEGORIES)
def test_golden_mxfp8(golden, cat):
    x, q, want_data, want_scale = _golden_quantized(golden, cat, "mxfp8")
    gold = BlockScaledTensor(
        data=want_data.view(E4M3), scale=want_scale.view(E8M0), format="mxfp8", shape=x.shape, axis=1
    )
    np.testing.assert_array_equal(dequantize(gold, np.float64), dequantize(q, np.float64))
    np.testing.assert_array_equal(dequantize(gold), dequantize(q))


@pytest.mark.parametrize("cat", GOLDEN_CATEGORIES)
def test_golden_nvfp4(golden, cat):
    x, q, want_data, want_scale = _golden_quantized(golden, cat, "nvfp4")
    gold = BlockScaledTensor(data=want_data, scale=want_scale.view(E4M3), format="nvfp4", shape=x.shape, axis=-1)
    np.testing.assert_array_equal(dequantize(gold, np.float64), dequantize(q, np.float64))


@pytest.mark.parametrize("cat", GOLDEN_CATEGORIES)
def test_golden_dequantize_matches_hand_decoding(golden, cat):
    """Decode the golden codes by hand (no library) and compare with dequantize."""
    x = golden[f"{cat}/input"]
    rows = x.shape[0]
    d = golden[f"{cat}/mxfp8_data_bits"]
    s = golden[f"{cat}/mxfp8_scale_bits"].astype(np.int64)
    vals = np.vectorize(_e4m3_value)(d.astype(np.int64)) if d.size else d.astype(np.float64)
    vals = np.where((d & 0x7F) == 0x7F, np.nan, vals)
    scale = np.where(s == 0xFF, np.nan, np.ldexp(1.0, s - 127))
    want = vals * np.repeat(scale, 32, axis=1)
    got = dequantize(quantize(x, "mxfp8"), np.float64)
    np.testing.assert_array_equal(got, want)

    nib = _unpack(golden[f"{cat}/nvfp4_data_packed"], 64).astype(np.int64)
    v4 = np.vectorize(_e2m1_value)(nib)
    sc = golden[f"{cat}/nvfp4_scale_bits"].astype(np.int64)
    sv = np.where((sc & 0x7F) == 0x7F, np.nan, np.vectorize(_e4m3_value)(sc))
    want4 = v4 * np.repeat(sv, 16, axis=1)
    got4 = dequantize(quantize(x, "nvfp4"), np.float64)
    np.testing.assert_array_equal(got4, want4)
    assert got4.shape == (rows, 64)


# ============================================================================ code round trips

_ALL_E4M3_CODES = np.concatenate([np.arange(0x00, 0x7F), np.arange(0x80, 0xFF)]).astype(np.uint8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_e4m3_code_round_trips_through_mxfp8(dtype):
    vals = np.array([_e4m3_value(int(c)) for c in _ALL_E4M3_CODES])
    x = np.zeros((len(vals), 32), dtype=dtype)
    x[:, 0] = 448.0  # amax 448: scale exactly 2^0
    x[:, 7] = vals
    q = quantize(x, "mxfp8")
    np.testing.assert_array_equal(q.scale_codes(), np.full((len(vals), 1), 127, np.uint8))
    np.testing.assert_array_equal(q.data_codes()[:, 7], _ALL_E4M3_CODES)
    np.testing.assert_array_equal(q.data_codes()[:, 0], np.full(len(vals), 0x7E, np.uint8))
    # and the decoded value is the code's value, sign of zero included
    dec = dequantize(q, np.float64)[:, 7]
    np.testing.assert_array_equal(dec, vals)
    assert np.signbit(dec[_ALL_E4M3_CODES == 0x80]).all()


@pytest.mark.parametrize("k", [-20, -1, 3, 100])
def test_every_e4m3_code_round_trips_at_power_of_two_scale(k):
    vals = np.array([_e4m3_value(int(c)) for c in _ALL_E4M3_CODES]) * 2.0**k
    x = np.zeros((len(vals), 32))
    x[:, 31] = -448.0 * 2.0**k
    x[:, 3] = vals
    q = quantize(x, "mxfp8")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], np.full(len(vals), 127 + k, np.uint8))
    np.testing.assert_array_equal(q.data_codes()[:, 3], _ALL_E4M3_CODES)
    np.testing.assert_array_equal(q.data_codes()[:, 31], np.full(len(vals), 0xFE, np.uint8))


def test_every_positive_e4m3_code_round_trips_as_nvfp4_scale():
    codes = np.arange(0x01, 0x7F, dtype=np.uint8)
    x = np.zeros((len(codes), 16))
    x[:, 5] = 6.0 * _E4M3_POS[codes]  # amax / 6 is exactly the code's value
    q = quantize(x, "nvfp4")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], codes)
    # the amax element is then exactly 6 = E2M1 code 7, in the high nibble of byte 2
    np.testing.assert_array_equal(q.data_codes()[:, 2], np.full(len(codes), 0x70, np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_every_e2m1_code_round_trips_at_scale_one(dtype):
    nibbles = np.arange(16)
    vals = np.array([_e2m1_value(int(c)) for c in nibbles])
    x = np.zeros((16, 16), dtype=dtype)
    x[:, 0] = 6.0  # amax 6: scale E4M3(1.0) = 0x38
    x[:, 1] = vals
    q = quantize(x, "nvfp4")
    np.testing.assert_array_equal(q.scale_codes(), np.full((16, 1), 0x38, np.uint8))
    np.testing.assert_array_equal(q.scale.astype(np.float64), np.ones((16, 1)))
    np.testing.assert_array_equal(q.data_codes()[:, 0], ((nibbles << 4) | 0x7).astype(np.uint8))
    dec = dequantize(q, np.float64)
    np.testing.assert_array_equal(dec[:, 1], vals)
    assert np.signbit(dec[8, 1]) and dec[8, 1] == 0.0


# ============================================================================ ties to even: bf16


def _bf16_decode(codes: np.ndarray) -> np.ndarray:
    return (codes.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _even_of(c: np.ndarray) -> np.ndarray:
    """Of the neighbouring codes c and c + 1, the one with an even mantissa."""
    return np.where(c % 2 == 0, c, c + 1)


def test_bf16_float32_midpoints_tie_to_even_exhaustive():
    c = np.arange(0x0000, 0x7F80, dtype=np.uint32)  # every finite non-negative bf16, max included
    mid_bits = (c << 16) | 0x8000  # exactly half a bf16 ulp above c
    for sign in (0, 0x80000000):
        mid = (mid_bits | sign).view(np.float32)
        want = (_even_of(c) | (sign >> 16)).astype(np.uint16)
        np.testing.assert_array_equal(round_to_bf16(mid).view(np.uint16), want)
        above = ((mid_bits + 1) | sign).view(np.float32)
        np.testing.assert_array_equal(round_to_bf16(above).view(np.uint16), ((c + 1) | (sign >> 16)).astype(np.uint16))
        below = ((mid_bits - 1) | sign).view(np.float32)
        np.testing.assert_array_equal(round_to_bf16(below).view(np.uint16), (c | (sign >> 16)).astype(np.uint16))


def test_bf16_float32_random_bits_match_ml_dtypes():
    # ml_dtypes' float32 -> bfloat16 cast is a single correct rounding: an independent oracle.
    rng = np.random.default_rng(1234)
    x = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)]
    np.testing.assert_array_equal(round_to_bf16(x).view(np.uint16), x.astype(BF16).view(np.uint16))


def test_bf16_float64_midpoints_tie_to_even_and_neighbours_round_correctly():
    c = np.arange(0x0000, 0x7F7F, dtype=np.uint32)  # pairs (c, c + 1), both finite
    lo, hi = _bf16_decode(c), _bf16_decode(c + 1)
    mid = (lo + hi) / 2  # exact in float64
    np.testing.assert_array_equal(round_to_bf16(mid).view(np.uint16), _even_of(c).astype(np.uint16))
    np.testing.assert_array_equal(round_to_bf16(-mid).view(np.uint16), (_even_of(c) | 0x8000).astype(np.uint16))
    # one float64 ulp off the midpoint: float32 would round these back onto the midpoint
    up = np.nextafter(mid, np.inf)
    down = np.nextafter(mid, 0.0)
    np.testing.assert_array_equal(round_to_bf16(up).view(np.uint16), (c + 1).astype(np.uint16))
    np.testing.assert_array_equal(round_to_bf16(down[1:]).view(np.uint16), c[1:].astype(np.uint16))


def test_bf16_float64_no_double_rounding():
    v = 1.0 + 2.0**-8 + 2.0**-30  # just above the midpoint between 1 and 1 + 2^-7
    assert float(np.float32(v)) == 1.0 + 2.0**-8  # float32 would land exactly on the midpoint ...
    assert float(np.float32(v).astype(BF16)) == 1.0  # ... and then tie to even (down): double rounding
    u = 2.0 + 2.0**-7 + 2.0**-29  # just above the midpoint between 2 and 2 + 2^-6
    assert float(np.float32(u)) == 2.0 + 2.0**-7
    got = round_to_bf16(np.array([v, -v, u]))
    np.testing.assert_array_equal(got.astype(np.float64), [1.0 + 2.0**-7, -(1.0 + 2.0**-7), 2.0 + 2.0**-6])
    # and a value just below a midpoint that float32 rounds up onto it
    w = 1.0 + 3 * 2.0**-8 - 2.0**-30  # below the midpoint of 1+2^-7 (odd) and 1+2^-6 (even)
    assert float(np.float32(w)) == 1.0 + 3 * 2.0**-8
    assert float(round_to_bf16(np.float64(w))) == 1.0 + 2.0**-7


def test_bf16_float64_subnormals():
    x = np.array([2.0**-133, 2.0**-134, 2.0**-134 + 2.0**-170, 3 * 2.0**-134, -(2.0**-134), 1e-310, -1e-310])
    np.testing.assert_array_equal(round_to_bf16(x).view(np.uint16), [0x0001, 0x0000, 0x0001, 0x0002, 0x8000, 0, 0x8000])


def test_bf16_exact_inputs_are_unchanged():
    bits = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    b = bits.view(BF16)
    nan = np.isnan(b.astype(np.float32))
    got = round_to_bf16(b)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], bits[~nan])
    assert np.isnan(got.astype(np.float32)[nan]).all()
    h = np.array([1.5, -0.0, 65504.0, 2.0**-24], dtype=np.float16)
    np.testing.assert_array_equal(round_to_bf16(h).view(np.uint16), [0x3FC0, 0x8000, 0x4780, 0x3380])


# ============================================================================ ties to even: E4M3 (mxfp8)


@pytest.mark.parametrize("k", [0, -30, 12])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mxfp8_e4m3_midpoints_tie_to_even(k, dtype):
    c = np.arange(0x00, 0x7E)  # pairs (c, c + 1), c + 1 <= 0x7E
    mids = (_E4M3_POS[c] + _E4M3_POS[c + 1]) / 2
    x = np.zeros((len(c), 32), dtype=dtype)
    x[:, 0] = 448.0 * 2.0**k
    x[:, 1] = mids * 2.0**k
    x[:, 2] = -mids * 2.0**k
    x[:, 3] = np.nextafter((mids * 2.0**k).astype(dtype), dtype(np.inf))
    x[:, 4] = np.nextafter((mids * 2.0**k).astype(dtype), dtype(0))
    q = quantize(x, "mxfp8")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], np.full(len(c), 127 + k))
    codes = q.data_codes()
    even = _even_of(c)
    np.testing.assert_array_equal(codes[:, 1], even)
    np.testing.assert_array_equal(codes[:, 2], even | 0x80)
    np.testing.assert_array_equal(codes[:, 3], c + 1)
    np.testing.assert_array_equal(codes[1:, 4], c[1:])  # c = 0: mid 2^-10, below it is still code 0
    assert codes[0, 4] == 0


def test_mxfp8_float64_no_double_rounding():
    mid = 1.0625  # midpoint between 1.0 (0x38, even) and 1.125 (0x39)
    v = mid + 2.0**-40
    assert float(np.float32(v)) == mid
    x = np.zeros(32)
    x[0], x[1], x[2], x[3] = 448.0, v, mid, -v
    codes = quantize(x, "mxfp8").data_codes()
    assert list(codes[1:4]) == [0x39, 0x38, 0xB9]
    # float32 rounding first would have produced the tie result
    assert quantize(x.astype(np.float32), "mxfp8").data_codes()[1] == 0x38


# ============================================================================ ties to even: E2M1 (nvfp4)

# E2M1 midpoints and the even code each must tie to (value / magnitude code)
_E2M1_TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]
# and the codes just above / just below each midpoint
_E2M1_ABOVE = [1, 2, 3, 4, 5, 6, 7]
_E2M1_BELOW = [0, 1, 2, 3, 4, 5, 6]


def _nvfp4_tie_block(s: float, dtype=np.float64) -> np.ndarray:
    mids = np.array([m for m, _ in _E2M1_TIES])
    x = np.zeros((4, 16), dtype=dtype)
    x[:, 0] = 6.0 * s  # amax / 6 = s exactly: the scale is E4M3(s) = s
    x[0, 1:8] = mids * s
    x[1, 1:8] = -mids * s
    x[2, 1:8] = np.nextafter(mids * s, np.inf)
    x[3, 1:8] = np.nextafter(mids * s, 0.0)
    return x


@pytest.mark.parametrize("s", [1.0, 1.5, 0.75, 1.375, 1.625, 1.875, 3.5, 448.0, 2.0**-9, 5 * 2.0**-9])
def test_nvfp4_e2m1_midpoints_tie_to_even(s):
    x = _nvfp4_tie_block(s)
    q = quantize(x, "nvfp4")
    assert (q.scale.astype(np.float64) == s).all()
    nib = _unpack(q.data_codes(), 16)
    np.testing.assert_array_equal(nib[0, 1:8], [c for _, c in _E2M1_TIES])
    np.testing.assert_array_equal(nib[1, 1:8], [c | 8 for _, c in _E2M1_TIES])
    np.testing.assert_array_equal(nib[2, 1:8], _E2M1_ABOVE)
    np.testing.assert_array_equal(nib[3, 1:8], _E2M1_BELOW)
    np.testing.assert_array_equal(nib[:, 0], [7, 7, 7, 7])


def test_nvfp4_ties_at_every_e4m3_scale():
    """At every E4M3 scale (1/s inexact for most), the exact quotient decides ties."""
    blocks = [_nvfp4_tie_block(float(s)) for s in _E4M3_POS[1:]]
    x = np.concatenate(blocks, axis=0)
    q = quantize(x, "nvfp4")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], np.repeat(np.arange(1, 0x7F), 4))
    nib = _unpack(q.data_codes(), 16)
    want = np.tile(
        np.array(
            [[c for _, c in _E2M1_TIES], [c | 8 for _, c in _E2M1_TIES], _E2M1_ABOVE, _E2M1_BELOW], dtype=np.uint8
        ),
        (0x7E, 1),
    )
    np.testing.assert_array_equal(nib[:, 1:8], want)


def test_nvfp4_float64_no_double_rounding():
    s = 1.5
    mid = 2.5 * s  # 3.75: tie between 2.0 (code 4) and 3.0 (code 5)
    v = mid + 2.0**-40
    assert float(np.float32(v)) == mid
    x = np.zeros(16)
    x[0], x[1], x[2] = 6 * s, v, mid
    nib = _unpack(quantize(x, "nvfp4").data_codes(), 16)
    assert list(nib[:3]) == [7, 5, 4]


def test_nvfp4_scale_itself_rounds_to_nearest_even():
    # amax / 6 exactly between E4M3 1.0 (0x38) and 1.125 (0x39): ties to 0x38
    x = np.zeros((3, 16))
    x[0, 0] = 6 * 1.0625
    x[1, 0] = np.nextafter(6 * 1.0625, np.inf)
    x[2, 0] = 6 * 1.1875  # between 1.125 (0x39) and 1.25 (0x3A): ties to 0x3A
    q = quantize(x, "nvfp4")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], [0x38, 0x39, 0x3A])


# ============================================================================ saturation


def test_mxfp8_never_produces_nan_codes_for_finite_input():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, size=64 * 1024, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.where(np.isfinite(x), x, np.float32(1.0)).reshape(-1, 64)
    q = quantize(x, "mxfp8")
    codes = q.data_codes()
    assert not ((codes & 0x7F) == 0x7F).any()
    assert not (q.scale_codes() == 0xFF).any()
    assert np.isfinite(dequantize(q, np.float64)).all()


def test_mxfp8_saturates_when_scale_is_clamped():
    # float64 values beyond 448 * 2^127 need a scale above E8M0's max: the data saturates at +-448.
    x = np.zeros((2, 32))
    x[0, :3] = [1e300, -1e300, 448.0 * 2.0**127]
    x[1, :2] = [np.finfo(np.float64).max, -np.finfo(np.float64).max]
    q = quantize(x, "mxfp8")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], [254, 254])
    np.testing.assert_array_equal(q.data_codes()[0, :3], [0x7E, 0xFE, 0x7E])
    np.testing.assert_array_equal(q.data_codes()[1, :2], [0x7E, 0xFE])
    np.testing.assert_array_equal(dequantize(q, np.float64)[0, :2], [448.0 * 2.0**127, -448.0 * 2.0**127])


def test_mxfp8_largest_float32_is_not_saturated():
    fmax = np.finfo(np.float32).max
    x = np.zeros(32, np.float32)
    x[0], x[1] = fmax, -fmax
    q = quantize(x, "mxfp8")
    # 448 * 2^119 < fmax <= 448 * 2^120
    assert q.scale_codes()[0] == 127 + 120
    # fmax / 2^120 = 256 - 2^-16: rounds to 256 = 0x78, not saturated at 448
    assert list(q.data_codes()[:2]) == [0x78, 0xF8]


def test_nvfp4_scale_saturates_at_448():
    x = np.zeros((5, 16))
    x[0, 0] = 1e30
    x[1, 0] = -float(np.finfo(np.float32).max)
    x[2, 0] = 6 * 432.0  # tie between 416 (0x7D) and 448 (0x7E): even is 0x7E
    x[3, 0] = np.nextafter(6 * 432.0, 0.0)
    x[4, 0] = 1e300
    q = quantize(x, "nvfp4")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], [0x7E, 0x7E, 0x7E, 0x7D, 0x7E])
    nib = _unpack(q.data_codes(), 16)
    np.testing.assert_array_equal(nib[:, 0], [7, 15, 7, 7, 7])
    dec = dequantize(q, np.float64)[:, 0]
    np.testing.assert_array_equal(dec, [2688.0, -2688.0, 2688.0, 6 * 416.0, 2688.0])


def test_bf16_overflow_to_inf():
    bmax = float(np.array(0x7F7F, np.uint16).view(BF16).astype(np.float64))
    assert bmax == 2.0**128 - 2.0**120
    mid = 2.0**128 - 2.0**119  # between max (odd mantissa) and 2^128: ties up, to inf
    x = np.array([bmax, np.nextafter(mid, 0.0), mid, np.nextafter(mid, np.inf), 1e39, 1e300, -1e300, -mid])
    got = round_to_bf16(x).view(np.uint16)
    np.testing.assert_array_equal(got, [0x7F7F, 0x7F7F, 0x7F80, 0x7F80, 0x7F80, 0x7F80, 0xFF80, 0xFF80])
    f32max = np.float32(np.finfo(np.float32).max)
    assert round_to_bf16(f32max).view(np.uint16) == 0x7F80
    assert round_to_bf16(-f32max).view(np.uint16) == 0xFF80


def test_bf16_passes_inf_and_nan():
    got = round_to_bf16(np.array([np.inf, -np.inf, np.nan], dtype=np.float32))
    assert list(got.view(np.uint16)[:2]) == [0x7F80, 0xFF80]
    assert np.isnan(got[2].astype(np.float32))


# ============================================================================ zero blocks


def test_mxfp8_all_zero_blocks():
    x = np.zeros((2, 70), dtype=np.float32)
    x[0, 1] = -0.0
    x[0, 33] = -0.0
    x[1, 64:] = -0.0  # partial last block of -0.0 only
    q = quantize(x, "mxfp8")
    np.testing.assert_array_equal(q.scale_codes(), np.zeros((2, 3), np.uint8))
    codes = q.data_codes()
    want = np.zeros((2, 70), np.uint8)
    want[0, 1] = want[0, 33] = 0x80
    want[1, 64:] = 0x80
    np.testing.assert_array_equal(codes, want)
    dec = dequantize(q, np.float64)
    assert (dec == 0).all()
    np.testing.assert_array_equal(np.signbit(dec), want == 0x80)
    # E8M0 code 0 decodes as 2^-127 (not the NaN that a cast of 0.0 gives)
    assert float(q.scale[0, 0].astype(np.float64)) == 2.0**-127


def test_nvfp4_all_zero_blocks():
    x = np.zeros((2, 40))
    x[0, 0] = -0.0
    x[0, 17] = -0.0
    x[1, 32:] = -0.0
    q = quantize(x, "nvfp4")
    np.testing.assert_array_equal(q.scale_codes(), np.zeros((2, 3), np.uint8))
    nib = _unpack(q.data_codes(), 40)
    want = np.zeros((2, 40), np.uint8)
    want[0, 0] = want[0, 17] = 0x8
    want[1, 32:] = 0x8
    np.testing.assert_array_equal(nib, want)
    assert q.data_codes()[0, 0] == 0x08 and q.data_codes()[0, 8] == 0x80
    dec = dequantize(q, np.float64)
    assert (dec == 0).all()
    np.testing.assert_array_equal(np.signbit(dec), want == 0x8)


def test_nvfp4_scale_that_rounds_to_zero_zeroes_its_block_keeping_signs():
    x = np.zeros((2, 16))
    x[0, :3] = [6 * 2.0**-10, -1e-5, 1e-6]  # amax / 6 = 2^-10: tie between 0 and 2^-9 -> 0
    x[1, :3] = [np.nextafter(6 * 2.0**-10, np.inf), -1e-5, 1e-6]  # just above: smallest subnormal
    q = quantize(x, "nvfp4")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], [0x00, 0x01])
    nib = _unpack(q.data_codes(), 16)
    np.testing.assert_array_equal(nib[0, :3], [0, 8, 0])
    np.testing.assert_array_equal(nib[1, :3], [5, 8, 0])  # 3 + a hair -> 3.0 (code 5); -0.005 -> -0
    dec = dequantize(q, np.float64)
    np.testing.assert_array_equal(dec[0], np.zeros(16))
    assert np.signbit(dec[0, 1])


# ============================================================================ mxfp8 scale at binade edges


def test_mxfp8_scale_at_exact_powers_of_two_float32():
    ks = np.arange(-127, 120)
    a = (448.0 * np.exp2(ks.astype(np.float64))).astype(np.float32)
    assert (a.astype(np.float64) == 448.0 * np.exp2(ks.astype(np.float64))).all()
    up = np.nextafter(a, np.float32(np.inf))
    down = np.nextafter(a, np.float32(0))
    x = np.zeros((3 * len(ks), 32), np.float32)
    x[0::3, 0] = a
    x[1::3, 9] = -up
    x[2::3, 31] = down
    s = quantize(x, "mxfp8").scale_codes()[:, 0].astype(np.int64) - 127
    np.testing.assert_array_equal(s[0::3], ks)
    np.testing.assert_array_equal(s[1::3], ks + 1)
    np.testing.assert_array_equal(s[2::3], ks)


def test_mxfp8_scale_at_exact_powers_of_two_float64():
    ks = np.arange(-126, 127)
    a = 448.0 * np.exp2(ks.astype(np.float64))
    x = np.zeros((3 * len(ks), 32))
    x[0::3, 0] = a
    x[1::3, 0] = np.nextafter(a, np.inf)
    x[2::3, 0] = np.nextafter(a, 0.0)
    q = quantize(x, "mxfp8")
    s = q.scale_codes()[:, 0].astype(np.int64) - 127
    np.testing.assert_array_equal(s[0::3], ks)
    np.testing.assert_array_equal(s[1::3], ks + 1)
    np.testing.assert_array_equal(s[2::3], ks)
    codes = q.data_codes()[:, 0]
    np.testing.assert_array_equal(codes[0::3], np.full(len(ks), 0x7E))  # exactly 448
    np.testing.assert_array_equal(codes[1::3], np.full(len(ks), 0x76))  # 224 + a hair -> 224
    np.testing.assert_array_equal(codes[2::3], np.full(len(ks), 0x7E))  # 448 - a hair -> 448


def test_mxfp8_scale_clamps_at_e8m0_minimum():
    x = np.zeros((2, 32))
    x[0, 0] = 448.0 * 2.0**-128  # would need 2^-128: clamped to 2^-127, value 224
    x[1, 0] = 2.0**-200
    q = quantize(x, "mxfp8")
    np.testing.assert_array_equal(q.scale_codes()[:, 0], [0, 0])
    np.testing.assert_array_equal(q.data_codes()[:, 0], [0x76, 0x00])


# ============================================================================ packing and shapes


def test_nvfp4_nibble_order():
    x = np.array([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 0.0, -0.0])
    q = quantize(x, "nvfp4")
    assert q.scale_codes().tolist() == [0x38]
    assert q.data_codes().tolist() == [0x21, 0x43, 0x65, 0x97, 0xBA, 0xDC, 0xFE, 0x80]
    np.testing.assert_array_equal(dequantize(q, np.float64), x)


@pytest.mark.parametrize("n", [1, 3, 15, 17, 31, 33])
def test_nvfp4_odd_length_last_high_nibble_is_zero(n):
    rng = np.random.default_rng(n)
    x = -np.abs(rng.standard_normal((3, n)))  # all negative: every real nibble has the sign bit
    x[:, -1] = -6.0
    q = quantize(x, "nvfp4")
    assert q.data.shape == (3, (n + 1) // 2)
    assert q.scale.shape == (3, -(-n // 16))
    last = q.data_codes()[:, -1]
    np.testing.assert_array_equal(last >> 4, [0, 0, 0])
    np.testing.assert_array_equal(last & 0xF, [0xF, 0xF, 0xF])  # -6 at scale amax/6 -> code 7 | sign
    # the same codes as the even-length array with a +0 appended
    padded = quantize(np.concatenate([x, np.zeros((3, 1))], axis=1), "nvfp4")
    np.testing.assert_array_equal(q.data_codes(), padded.data_codes())
    np.testing.assert_array_equal(dequantize(q, np.float64), dequantize(padded, np.float64)[:, :n])


def test_nvfp4_odd_length_along_axis_0():
    x = np.full((5, 2), -1.0)
    x[0] = -6.0
    q = quantize(x, "nvfp4", axis=0)
    assert q.data.shape == (3, 2) and q.scale.shape == (1, 2) and q.axis == 0
    # rows (0, 1) -> byte 0, rows (2, 3) -> byte 1, row 4 -> low nibble of byte 2
    np.testing.assert_array_equal(q.data_codes(), [[0xAF, 0xAF], [0xAA, 0xAA], [0x0A, 0x0A]])


@pytest.mark.parametrize("fmt,block", [("mxfp8", 32), ("nvfp4", 16)])
@pytest.mark.parametrize("n", [1, 5, 16, 17, 33, 40, 47, 100])
def test_partial_last_block(fmt, block, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((2, n)) * 1000.0
    tail = (n // block) * block
    if tail < n:
        x[:, tail:] = rng.standard_normal((2, n - tail))  # small last block: its own scale
    q = quantize(x, fmt)
    nb = -(-n // block)
    assert q.scale.shape == (2, nb)
    assert q.data.shape == ((2, n) if fmt == "mxfp8" else (2, (n + 1) // 2))
    assert q.shape == (2, n) and q.axis == 1
    # the zero-padded full-block array gives the same scales and codes
    full = np.zeros((2, nb * block))
    full[:, :n] = x
    qf = quantize(full, fmt)
    np.testing.assert_array_equal(q.scale_codes(), qf.scale_codes())
    if fmt == "mxfp8":
        np.testing.assert_array_equal(q.data_codes(), qf.data_codes()[:, :n])
    else:
        np.testing.assert_array_equal(_unpack(q.data_codes(), n), _unpack(qf.data_codes(), n))
    dq = dequantize(q, np.float64)
    assert dq.shape == (2, n)
    np.testing.assert_array_equal(dq, dequantize(qf, np.float64)[:, :n])
    # the last block's scale comes from its own elements only
    if tail < n:
        amax = np.abs(x[:, tail:]).max(axis=1)
        if fmt == "mxfp8":
            e = q.scale_codes()[:, -1].astype(np.int64) - 127
            assert (amax <= 448.0 * np.exp2(e)).all() and (amax > 448.0 * np.exp2(e - 1)).all()
        else:
            assert (q.scale.astype(np.float64)[:, -1] < 2.0).all()


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape,axis", [((37, 5, 3), 0), ((5, 37, 4), 1), ((4, 3, 50), 2), ((37, 5, 3), -3), ((5, 37, 4), -2)])
def test_quantize_along_any_axis_equals_transposed(fmt, shape, axis):
    rng = np.random.default_rng(sum(shape) + axis)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))).astype(np.float32)
    q = quantize(x, fmt, axis=axis)
    a = axis % 3
    block = 32 if fmt == "mxfp8" else 16
    n = shape[a]
    want_data = list(shape)
    want_scale = list(shape)
    want_scale[a] = -(-n // block)
    if fmt == "nvfp4":
        want_data[a] = -(-n // 2)
    assert q.axis == a and q.shape == shape
    assert q.data.shape == tuple(want_data) and q.scale.shape == tuple(want_scale)
    ref = quantize(np.ascontiguousarray(np.moveaxis(x, a, -1)), fmt)
    np.testing.assert_array_equal(np.moveaxis(q.data_codes(), a, -1), ref.data_codes())
    np.testing.assert_array_equal(np.moveaxis(q.scale_codes(), a, -1), ref.scale_codes())
    np.testing.assert_array_equal(np.moveaxis(dequantize(q, np.float64), a, -1), dequantize(ref, np.float64))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_empty_arrays(fmt):
    q = quantize(np.zeros((0, 64), np.float32), fmt)
    assert q.scale.shape == (0, 64 // q.block_size)
    assert dequantize(q).shape == (0, 64)
    q = quantize(np.zeros((3, 0), np.float32), fmt)
    assert q.data.shape == (3, 0) and q.scale.shape == (3, 0)
    assert dequantize(q).shape == (3, 0)


# ============================================================================ NaN / Inf


@pytest.mark.parametrize("fmt,block,nan_scale", [("mxfp8", 32, 0xFF), ("nvfp4", 16, 0x7F)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_poisons_only_its_block(fmt, block, nan_scale, bad):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3 * block)).astype(np.float32)
    y = x.copy()
    y[0, block + 3] = bad
    q, q0 = quantize(y, fmt), quantize(x, fmt)
    d, d0 = dequantize(q, np.float64), dequantize(q0, np.float64)
    poisoned = np.zeros(d.shape, bool)
    poisoned[0, block : 2 * block] = True
    np.testing.assert_array_equal(np.isnan(d), poisoned)
    np.testing.assert_array_equal(d[~poisoned], d0[~poisoned])
    sc, sc0 = q.scale_codes(), q0.scale_codes()
    assert sc[0, 1] == nan_scale
    if fmt == "mxfp8":  # spec 8.3: every data code of the block is 0x7F; other blocks unchanged
        codes, codes0 = q.data_codes(), q0.data_codes()
        np.testing.assert_array_equal(codes[0, block : 2 * block], np.full(block, 0x7F, np.uint8))
        np.testing.assert_array_equal(codes[~poisoned], codes0[~poisoned])
    else:
        np.testing.assert_array_equal(_unpack(q.data_codes(), 3 * block)[~poisoned],
                                      _unpack(q0.data_codes(), 3 * block)[~poisoned])
    mask = np.ones(sc.shape, bool)
    mask[0, 1] = False
    np.testing.assert_array_equal(sc[mask], sc0[mask])


def test_nvfp4_non_finite_block_codes():
    # spec 8.4: the block gets scale 0x7F; the reference encodes its finite elements by the
    # ordinary rules (scale from the finite amax) and its non-finite ones as signed zeros
    x = np.zeros(16)
    x[:6] = [np.nan, -np.inf, 6 * 1.5, -0.75 * 1.5, np.inf, 3.5 * 1.5]
    q = quantize(x, "nvfp4")
    assert q.scale_codes().tolist() == [0x7F]
    nib = _unpack(q.data_codes(), 16)
    assert nib[:6].tolist() == [0, 8, 7, 0xA, 0, 6]
    assert np.isnan(dequantize(q, np.float64)).all()


# ============================================================================ BlockScaledTensor validation


def _mx(shape=(4, 64), data_shape=None, scale_shape=None, axis=-1, data_dtype=E4M3, scale_dtype=E8M0, fmt="mxfp8"):
    data = np.zeros(data_shape if data_shape is not None else shape, dtype=data_dtype)
    s = list(shape)
    s[axis] = -(-s[axis] // 32)
    scale = np.zeros(scale_shape if scale_shape is not None else tuple(s), dtype=scale_dtype)
    return BlockScaledTensor(data=data, scale=scale, format=fmt, shape=shape, axis=axis)


def test_block_scaled_tensor_accepts_valid_and_normalises():
    data = np.zeros((4, 64), E4M3)
    scale = np.zeros((4, 2), E8M0)
    t = BlockScaledTensor(data=data, scale=scale, format="MXFP8", shape=[4, 64], axis=-1)
    assert t.format is MoeFormat.MXFP8 and t.axis == 1 and t.shape == (4, 64) and t.block_size == 32 and t.ndim == 2
    assert t.data is data and t.scale is scale  # not copied
    t4 = BlockScaledTensor(
        data=np.zeros((17, 3), np.uint8), scale=np.zeros((3, 3), E4M3), format=MoeFormat.NVFP4, shape=(33, 3), axis=-2
    )
    assert t4.axis == 0 and t4.block_size == 16
    assert BlockScaledTensor.data_shape_for("nvfp4", (33, 3), 0) == (17, 3)
    assert BlockScaledTensor.scale_shape_for("nvfp4", (33, 3), 0) == (3, 3)
    assert BlockScaledTensor.scale_shape_for("mxfp8", (5, 65), 1) == (5, 3)


def test_block_scaled_tensor_rejects_data_shape():
    with pytest.raises(ShapeError, match=re.escape(
        "mxfp8 data for logical shape (4, 64) blocked along axis 1 must have shape (4, 64); got (4, 63)"
    )) as ei:
        _mx(data_shape=(4, 63))
    assert ei.value.expected == (4, 64) and ei.value.got == (4, 63) and ei.value.name == "data"
    with pytest.raises(ShapeError, match=re.escape(
        "nvfp4 data for logical shape (4, 64) blocked along axis 1 must have shape (4, 32); got (4, 64)"
    )):
        BlockScaledTensor(
            data=np.zeros((4, 64), np.uint8), scale=np.zeros((4, 4), E4M3), format="nvfp4", shape=(4, 64)
        )


def test_block_scaled_tensor_rejects_scale_shape():
    with pytest.raises(ShapeError, match=re.escape(
        "mxfp8 scale for logical shape (4, 64) blocked along axis 1 must have shape (4, 2) (one per 32 elements); "
        "got (4, 1)"
    )) as ei:
        _mx(scale_shape=(4, 1))
    assert ei.value.name == "scale" and ei.value.expected == (4, 2)
    with pytest.raises(ShapeError, match=re.escape(
        "nvfp4 scale for logical shape (33, 3) blocked along axis 0 must have shape (3, 3) (one per 16 elements); "
        "got (2, 3)"
    )):
        BlockScaledTensor(data=np.zeros((17, 3), np.uint8), scale=np.zeros((2, 3), E4M3), format="nvfp4",
                          shape=(33, 3), axis=0)


def test_block_scaled_tensor_rejects_dtypes():
    with pytest.raises(DTypeError, match=re.escape("mxfp8 data must have dtype float8_e4m3fn; got float32")) as ei:
        _mx(data_dtype=np.float32)
    assert ei.value.name == "data" and ei.value.expected == "float8_e4m3fn" and ei.value.got == "float32"
    with pytest.raises(DTypeError, match=re.escape("mxfp8 scale must have dtype float8_e8m0fnu; got float8_e4m3fn")):
        _mx(scale_dtype=E4M3)
    with pytest.raises(DTypeError, match=re.escape("nvfp4 scale must have dtype float8_e4m3fn; got uint8")):
        BlockScaledTensor(data=np.zeros((4, 32), np.uint8), scale=np.zeros((4, 4), np.uint8), format="nvfp4",
                          shape=(4, 64))
    with pytest.raises(DTypeError, match=re.escape("nvfp4 data must have dtype uint8; got float8_e4m3fn")):
        BlockScaledTensor(data=np.zeros((4, 32), E4M3), scale=np.zeros((4, 4), E4M3), format="nvfp4", shape=(4, 64))
    with pytest.raises(DTypeError, match=re.escape("BlockScaledTensor.data must be a numpy array; got list")):
        BlockScaledTensor(data=[[0]], scale=np.zeros((4, 2), E8M0), format="mxfp8", shape=(4, 64))


@pytest.mark.parametrize("axis", [2, -3, 7])
def test_block_scaled_tensor_rejects_axis(axis):
    with pytest.raises(FormatError, match=re.escape(
        f"BlockScaledTensor.axis must be in [-2, 2) for a 2-d shape (4, 64); got {axis}"
    )):
        BlockScaledTensor(data=np.zeros((4, 64), E4M3), scale=np.zeros((4, 2), E8M0), format="mxfp8", shape=(4, 64),
                          axis=axis)


def test_block_scaled_tensor_rejects_non_block_format():
    with pytest.raises(FormatError, match=re.escape(
        "BlockScaledTensor.format must be a block-scaled format ('mxfp8' or 'nvfp4'); got 'bf16'"
    )):
        BlockScaledTensor(data=np.zeros((4, 64), BF16), scale=np.zeros((4, 2), E8M0), format="bf16", shape=(4, 64))
    with pytest.raises(FormatError, match=re.escape(
        "BlockScaledTensor.format must be one of 'bf16', 'mxfp8', 'nvfp4'; got 'fp8'"
    )):
        _mx(fmt="fp8")
    with pytest.raises(FormatError, match=re.escape(
        "BlockScaledTensor.format must be one of 'bf16', 'mxfp8', 'nvfp4'; got None"
    )):
        _mx(fmt=None)


def test_block_scaled_tensor_rejects_bad_logical_shape():
    with pytest.raises(ShapeError, match=re.escape("BlockScaledTensor.shape must have at least one axis; got ()")):
        BlockScaledTensor(data=np.zeros((), E4M3), scale=np.zeros((), E8M0), format="mxfp8", shape=())
    with pytest.raises(ShapeError, match=re.escape("BlockScaledTensor.shape must be non-negative; got (4, -1)")):
        BlockScaledTensor(data=np.zeros((4, 1), E4M3), scale=np.zeros((4, 1), E8M0), format="mxfp8", shape=(4, -1))


def test_quantize_and_dequantize_reject_bad_arguments():
    with pytest.raises(DTypeError, match=re.escape(
        "x must be a real float array (float64, float32, float16 or bfloat16); got dtype int64"
    )):
        quantize(np.arange(32, dtype=np.int64), "mxfp8")
    with pytest.raises(ShapeError, match="quantize needs at least one axis for a block-scaled format; got a scalar"):
        quantize(np.float32(1.0), "nvfp4")
    with pytest.raises(FormatError, match=re.escape("axis must be in [-2, 2) for a 2-d input; got 2")):
        quantize(np.zeros((2, 32)), "mxfp8", axis=2)
    with pytest.raises(FormatError, match=re.escape("format must be one of 'bf16', 'mxfp8', 'nvfp4'; got 'int8'")):
        quantize(np.zeros(32), "int8")
    with pytest.raises(DTypeError, match=re.escape("dequantize takes a BlockScaledTensor or a numpy float array; got list")):
        dequantize([1.0, 2.0])


def test_round_trip_helper():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 48)).astype(np.float32)
    np.testing.assert_array_equal(round_trip(x, None), x.astype(np.float64))
    assert round_trip(x, None).dtype == np.float64
    np.testing.assert_array_equal(round_trip(x, "mxfp8"), dequantize(quantize(x, "mxfp8"), np.float64))
    np.testing.assert_array_equal(round_trip(x, "nvfp4", axis=0), dequantize(quantize(x, "nvfp4", axis=0), np.float64))
    np.testing.assert_array_equal(round_trip(x, "bf16"), x.astype(BF16).astype(np.float64))
