// Device encoders and decoders of the formats (docs/spec.md section 8),
// bit-exact with moe_ep_spec/formats.py and the CPU implementation.
//
// Every rounding decision is made on float32 bit patterns or by comparing an
// input with an exactly representable threshold, never by dividing by a scale
// (mirrors backends/jax/moe_ep_jax/formats.py):
// - bf16: integer round-to-nearest-even on the bits;
// - mxfp8: the scale exponent from the bits of amax, the E4M3 code by shifting
//   the input's integer significand with round-half-even;
// - nvfp4: E4M3(amax / 6) through the hardware's E4M3 convert of the IEEE quotient
//   (provably the spec's count of the bounds 6 * (E4M3 midpoints) below amax, see
//   nvfp4_scale_index), E2M1 of |x| / s by comparing |x| with (E2M1 midpoints) * s;
//   these thresholds have at most 7 significant bits and are normal float32 values: exact.
// Decoding multiplies a code's value (<= 4 significant bits) by the scale:
// exact, except that a result beyond float32 range is +-Inf.
// Two mxfp8 helpers take the hardware's E4M3 converts instead (sm_89+), where the
// values are provably the same: the FC2 epilogue's round trip (mxfp8_round_trip_cvt4:
// x times a power of two, then cvt.rn.satfinite) and the bf16 decodes (mxfp8_values2:
// cvt to f16, exact); the encoders keep the integer method. Every decoded
// NaN is the positive quiet NaN 0x7FC00000 (as the CPU implementation).
// No flush-to-zero is assumed anywhere (nvcc's default -ftz=false; subnormal
// inputs are handled on their bits).
#ifndef MOE_EP_NATIVE_CUDA_FORMAT_MATH_CUH_
#define MOE_EP_NATIVE_CUDA_FORMAT_MATH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace moe_ep {
namespace cuda {
namespace detail {

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kQuietNaN = 0x7FC00000u;

__device__ __forceinline__ uint32_t fbits(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float bitsf(uint32_t u) { return __uint_as_float(u); }

// ------------------------------------------------------------------ bf16

// float32 -> bf16 bits, nearest, ties to even (add 0x7FFF plus the lsb of the
// kept half, truncate); overflow carries into the exponent and gives +-Inf;
// +-Inf stay; NaN stays NaN with its sign, quieted (bit 6 of the bf16 set).
__device__ __forceinline__ uint16_t bf16_from_float(float f) {
  const uint32_t u = fbits(f);
  if ((u & kAbsMask) > kInfBits) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float bf16_to_float(uint16_t b) { return bitsf(static_cast<uint32_t>(b) << 16); }

// The pair (a, b) as bf16 bits, a in the low half, by the hardware's convert
// (cvt.rn.bf16x2.f32: one instruction for two values): bf16_pair(bf16_from_float(a),
// bf16_from_float(b)) for every a and b that is not NaN (nearest, ties to even, overflow to
// +-Inf, subnormals kept; moe_ep_gemm_check checks every float32). A NaN gives the hardware's
// NaN, not bf16_from_float's: callers test for NaN apart (any_nan) and round those with
// bf16_from_float.
__device__ __forceinline__ uint32_t bf16_pair_rn_cvt(float a, float b) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}
// Whether a or b is NaN (the unordered compare: one FSETP.NAN).
__device__ __forceinline__ bool any_nan(float a, float b) { return (a != a) | (b != b); }
__device__ __forceinline__ float bf16_round_trip(float f) { return bf16_to_float(bf16_from_float(f)); }

// bf16 bit patterns packed in memory order: a pair as one word (a in the low half), four
// as the 8 bytes of a uint2 (a first); bf16x4_from_float rounds four float32 first.
__device__ __forceinline__ uint32_t bf16_pair(uint16_t a, uint16_t b) { return uint32_t{a} | (uint32_t{b} << 16); }
__device__ __forceinline__ uint2 bf16x4(uint16_t a, uint16_t b, uint16_t c, uint16_t d) {
  return make_uint2(bf16_pair(a, b), bf16_pair(c, d));
}
__device__ __forceinline__ uint2 bf16x4_from_float(float a, float b, float c, float d) {
  return bf16x4(bf16_from_float(a), bf16_from_float(b), bf16_from_float(c), bf16_from_float(d));
}

// A 16-byte load as float32 values: four float32, or eight bf16 (element 0 in the low
// half of r.x; exact, bf16's bits are the high half of the float's).
__device__ __forceinline__ void unpack(uint4 r, float (&v)[4]) {
  v[0] = __uint_as_float(r.x), v[1] = __uint_as_float(r.y), v[2] = __uint_as_float(r.z), v[3] = __uint_as_float(r.w);
}
__device__ __forceinline__ void unpack(uint4 r, float (&v)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    v[2 * i] = bf16_to_float(static_cast<uint16_t>(w[i])), v[2 * i + 1] = bf16_to_float(static_cast<uint16_t>(w[i] >> 16));
}

// ------------------------------------------------------------------ E4M3 / E8M0 / E2M1 values

// The magnitude of an E4M3 (fn) code 0x00..0x7E: subnormals m * 2^-9, normals
// (8 + m) * 2^(e - 10) built from bits (exponent field e - 7 + 127).
__device__ __forceinline__ float e4m3_magnitude(uint32_t c7) {
  const uint32_t ex = c7 >> 3, man = c7 & 7u;
  if (ex == 0) return fmul(static_cast<float>(man), 0.001953125f);  // exact
  return bitsf(((ex + 120u) << 23) | (man << 20));
}

// 2^k for k in [-127, 127], exact (2^-127 is the float32 subnormal 0x00400000).
__device__ __forceinline__ float exp2_exact(int k) {
  return k >= -126 ? bitsf(static_cast<uint32_t>(k + 127) << 23) : bitsf(0x00400000u);
}

// E2M1 magnitude codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float e2m1_magnitude(uint32_t c3) {
  if (c3 < 2) return c3 ? 0.5f : 0.0f;
  return bitsf(((126u + (c3 >> 1)) << 23) | ((c3 & 1u) << 22));
}

// ------------------------------------------------------------------ block scan

// Largest finite magnitude (as float32 bits: the integer order of non-negative
// floats is their numeric order) and whether the block holds NaN or +-Inf.
struct BlockMax {
  uint32_t amax;
  bool nonfinite;
};

__device__ __forceinline__ BlockMax block_max(const float* p, int64_t stride, int len) {
  BlockMax r{0u, false};
  for (int j = 0; j < len; ++j) {
    const uint32_t m = fbits(p[j * stride]) & kAbsMask;
    if (m >= kInfBits) r.nonfinite = true;
    else r.amax = m > r.amax ? m : r.amax;
  }
  return r;
}

// The BlockMax of the block of which this lane holds the kN consecutive values v, agreed
// by the block's kGroup lanes (kGroup-aligned within the warp) through shuffles. All 32
// lanes must call it (full-mask shuffles); a lane with nothing to hold passes zeros, which
// reach only the lanes of its own (equally absent) block.
template <int kGroup, int kN>
__device__ __forceinline__ BlockMax group_block_max(const float (&v)[kN]) {
  BlockMax bm = block_max(v, 1, kN);
  uint32_t nonfinite = bm.nonfinite ? 1u : 0u;
#pragma unroll
  for (int o = kGroup / 2; o > 0; o >>= 1) {
    const uint32_t a = __shfl_xor_sync(0xFFFFFFFFu, bm.amax, o);
    bm.amax = a > bm.amax ? a : bm.amax;
    nonfinite |= __shfl_xor_sync(0xFFFFFFFFu, nonfinite, o);
  }
  bm.nonfinite = nonfinite != 0u;
  return bm;
}

// ------------------------------------------------------------------ mxfp8

// Smallest e with amax <= 448 * 2^e, clamped to [-127, 127], from the bits:
// amax = 1.f * 2^(ea - 127) and 448 = 1.75 * 2^8, so e = ea - 135, plus one when
// 1.f > 1.75 (fraction bits > 0x600000). A zero or subnormal amax is below
// 448 * 2^-127: e = -127 (the all-zero block's scale code 0).
__device__ __forceinline__ int mxfp8_exponent(uint32_t amax) {
  const int ea = static_cast<int>(amax >> 23);
  int e = ea == 0 ? -127 : ea - 135 + ((amax & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// round_half_even(m * 2^sh) for m < 2^24 (callers keep a left shift small).
__device__ __forceinline__ uint32_t shift_rne(uint32_t m, int sh) {
  if (sh >= 0) return m << sh;
  const int r = -sh < 31 ? -sh : 31;  // m < 2^24: a shift of 31 already rounds to 0
  const uint32_t base = m >> r;
  const uint32_t rem = m & ((1u << r) - 1u);
  const uint32_t half = 1u << (r - 1);
  return base + ((rem > half || (rem == half && (base & 1u))) ? 1u : 0u);
}

// E4M3 magnitude code (0..0x7E) of min(|x| / 2^e, 448), nearest, ties to the
// even code, from the float32 bits `mag` of a finite |x|. |x| = m * 2^q exactly;
// v = |x| / 2^e lies in binade bv; the E4M3 quantum there is 2^(bq - 3) with
// bq = max(bv, -6) (subnormals below 2^-6). n = round(v / quantum) in 0..16 and
// the code is (bq + 6) * 8 + n: a carry to n = 16 lands on the next binade's
// first code. Saturates at 0x7E (448).
__device__ __forceinline__ uint32_t e4m3_mag_code(uint32_t mag, int e) {
  if (mag == 0) return 0;
  const int ex = static_cast<int>(mag >> 23);
  const uint32_t fx = mag & 0x7FFFFFu;
  const uint32_t m = ex > 0 ? (fx | 0x800000u) : fx;
  const int q = ex > 0 ? ex - 150 : -149;
  const int bitlen = 32 - __clz(static_cast<int>(m));
  const int bv = bitlen - 1 + q - e;
  const int bq = bv > -6 ? bv : -6;
  const int n = static_cast<int>(shift_rne(m, q - e - (bq - 3)));
  const int code = (bq + 6) * 8 + n;
  return static_cast<uint32_t>(code < 0x7E ? code : 0x7E);
}

// One mxfp8 element given its block's scale value sv = 2^(scale - 127) (any
// value when nan_scale): E4M3(code) * sv; NaN for a NaN scale or a NaN data code
// (0x7F / 0xFF). Exact except overflow to +-Inf (E4M3 has 4 significant bits and
// is a multiple of 2^-9, so the product is a multiple of 2^-136: never below
// float32's subnormal grid).
__device__ __forceinline__ float mxfp8_value(uint32_t code, float sv, bool nan_scale) {
  if (nan_scale || (code & 0x7Fu) == 0x7Fu) return bitsf(kQuietNaN);
  const float v = fmul(e4m3_magnitude(code & 0x7Fu), sv);
  return (code & 0x80u) ? -v : v;
}

// Two mxfp8 elements (codes in the low and high byte of `two`) with their scale values
// sa and sb: mxfp8_value's values (NaN where a scale is NaN or a code is 0x7F / 0xFF),
// through the hardware's E4M3 -> f16 convert (exact: E4M3 lies in f16's range and grid;
// the signs of zeros kept), then the exact product with the scale.
__device__ __forceinline__ float2 mxfp8_values2(uint32_t two, float sa, bool nan_a, float sb, bool nan_b) {
  const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two),
                                                                     __NV_E4M3)));
  return make_float2(nan_a ? bitsf(kQuietNaN) : fmul(v.x, sa), nan_b ? bitsf(kQuietNaN) : fmul(v.y, sb));
}

// Decode one mxfp8 element: E4M3(code) * 2^(scale - 127); NaN for a NaN scale
// (0xFF) or a NaN data code (0x7F / 0xFF). Exact except overflow to +-Inf.
__device__ __forceinline__ float mxfp8_decode(uint32_t code, uint32_t scale_code) {
  return mxfp8_value(code, exp2_exact(static_cast<int>(scale_code) - 127), scale_code == 0xFFu);
}

// The E8M0 scale code of an mxfp8 block whose BlockMax is bm: e + 127, or 0xFF for a
// block with NaN/Inf. Split from the element codes so that lanes sharing a block agree
// on bm first; a finite block's code is at most 254, so 0xFF alone marks the NaN block.
__device__ __forceinline__ uint32_t mxfp8_scale_code(const BlockMax& bm) {
  return bm.nonfinite ? 0xFFu : static_cast<uint32_t>(mxfp8_exponent(bm.amax) + 127);
}

// The data code of one element (float32 bits u) of a block whose scale code is sc:
// 0x7F in a NaN-scale block, else sign | E4M3 code of |x| / 2^(sc - 127) (zeros keep
// their sign).
__device__ __forceinline__ uint32_t mxfp8_code(uint32_t u, uint32_t sc) {
  if (sc == 0xFFu) return 0x7Fu;
  return e4m3_mag_code(u & kAbsMask, static_cast<int>(sc) - 127) | ((u >> 31) << 7);
}

// The codes of 4 consecutive elements of one block, element j in byte j: one lane's
// share of a block split over lanes, stored as one little-endian word.
__device__ __forceinline__ uint32_t mxfp8_codes4(const float (&v)[4], uint32_t sc) {
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) w |= mxfp8_code(fbits(v[j]), sc) << (8 * j);
  return w;
}

// Encode one mxfp8 block of `len` (1..32) elements x[j * stride] into
// data[j * dstride] and *scale_code. A block with NaN/Inf: scale 0xFF, data 0x7F.
// Otherwise scale e + 127, data = sign | E4M3 code of |x| / 2^e (zeros keep their sign).
__device__ __forceinline__ void mxfp8_encode_block(const float* x, int64_t stride, int len, uint8_t* data,
                                                   int64_t dstride, uint8_t* scale_code) {
  const uint32_t sc = mxfp8_scale_code(block_max(x, stride, len));
  for (int j = 0; j < len; ++j) data[j * dstride] = static_cast<uint8_t>(mxfp8_code(fbits(x[j * stride]), sc));
  *scale_code = static_cast<uint8_t>(sc);
}

// quantize + dequantize in place of len values of one mxfp8 block whose BlockMax is bm
// (the block's, which may span more values than p holds: a block split over lanes).
__device__ __forceinline__ void mxfp8_round_trip_with(const BlockMax& bm, float* p, int len) {
  if (bm.nonfinite) {
    for (int j = 0; j < len; ++j) p[j] = bitsf(kQuietNaN);
    return;
  }
  const int e = mxfp8_exponent(bm.amax);
  const uint32_t scale_code = static_cast<uint32_t>(e + 127);
  for (int j = 0; j < len; ++j) {
    const uint32_t u = fbits(p[j]);
    p[j] = mxfp8_decode(e4m3_mag_code(u & kAbsMask, e) | ((u >> 31) << 7), scale_code);
  }
}

// mxfp8_round_trip_with for four values through the hardware E4M3 conversions (sm_89
// and later; emulated before): the same values, fewer instructions. q = x * 2^-e is
// exact unless |q| < 2^-126, where q and x / 2^e both round to a zero E4M3 code (the
// smallest nonzero magnitude is 2^-9); |q| <= 448 (e is chosen so), so cvt.rn.satfinite
// is the round-half-even of x / 2^e that e4m3_mag_code computes on the bits, sign and
// zero sign included; E4M3 -> f16 -> f32 is exact, and so is the product with 2^e (at
// most 4 significant bits, a multiple of 2^-136, below float32's maximum since a finite
// amax keeps e <= 120).
__device__ __forceinline__ void mxfp8_round_trip_cvt4(const BlockMax& bm, float (&p)[4]) {
  if (bm.nonfinite) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = bitsf(kQuietNaN);
    return;
  }
  const int e = mxfp8_exponent(bm.amax);
  const float down = exp2_exact(-e), up = exp2_exact(e);
#pragma unroll
  for (int j = 0; j < 4; j += 2) {
    const __nv_fp8x2_storage_t c =
        __nv_cvt_float2_to_fp8x2(make_float2(fmul(p[j], down), fmul(p[j + 1], down)), __NV_SATFINITE, __NV_E4M3);
    const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(c, __NV_E4M3)));
    p[j] = fmul(v.x, up);
    p[j + 1] = fmul(v.y, up);
  }
}

// quantize + dequantize of one mxfp8 block in place (R_int): the same codes as
// mxfp8_encode_block, decoded.
__device__ __forceinline__ void mxfp8_round_trip_block(float* p, int len) {
  mxfp8_round_trip_with(block_max(p, 1, len), p, len);
}

// ------------------------------------------------------------------ nvfp4

// E4M3 code (0..0x7E) of amax / 6 (amax finite, >= 0), nearest, ties to the even code,
// saturating at 0x7E (448), as the spec counts the bounds 6 * (E4M3 midpoint) below
// amax: the hardware's E4M3 convert (sm_89 and later; cvt.rn.satfinite) of the IEEE
// quotient q = fl(amax / 6). Exact: a bound 6 m (m a midpoint, a normal float32 with at
// most 5 significant bits; 6 m has a factor 3, so it is no power of two) is a float32
// whose neighbours lie ulp(6 m) >= 4 ulp(m) away. So an amax on a bound gives q = m
// exactly (the convert's tie rule is the spec's), and any other amax is at least
// 4/6 ulp(m) from 6 m, its quotient more than half an ulp(m) from m: q rounds to the same
// side of m as amax / 6. The convert's code is the spec's; every bound and its float32
// neighbours are tested on the device (test_native_cuda.py).
__device__ __forceinline__ uint32_t nvfp4_scale_index(float amax) {
  return __nv_cvt_float_to_fp8(__fdiv_rn(amax, 6.0f), __NV_SATFINITE, __NV_E4M3) & 0x7Fu;
}

// The E2M1 rounding thresholds of a block with scale value s > 0: the midpoints of the
// E2M1 magnitudes times s (exact), computed once per block.
struct E2m1Thresholds {
  float t[7];
};
__device__ __forceinline__ E2m1Thresholds e2m1_thresholds(float s) {
  const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  E2m1Thresholds th;
#pragma unroll
  for (int j = 0; j < 7; ++j) th.t[j] = fmul(mids[j], s);
  return th;
}

// E2M1 magnitude code of min(mag / s, 6), nearest, ties to the even code: the count of
// thresholds below mag, where a tie with the odd midpoints 0.75, 1.75 and 3.5 counts
// too (it goes up, to the even code 2, 4, 6).
__device__ __forceinline__ uint32_t e2m1_index(float mag, const E2m1Thresholds& th) {
  uint32_t idx = 0;
#pragma unroll
  for (int j = 0; j < 7; ++j) idx += ((j & 1) ? mag >= th.t[j] : mag > th.t[j]) ? 1u : 0u;
  return idx;
}

__device__ __forceinline__ uint32_t e2m1_mag_index(float mag, float s) { return e2m1_index(mag, e2m1_thresholds(s)); }

// The 4-bit code of one element given its block's scale value s: sign bit 3 is
// the sign of x (zeros and non-finite values included); a non-finite element
// (only in a NaN-scale block) or a zero scale gives magnitude code 0.
__device__ __forceinline__ uint32_t nvfp4_code(uint32_t u, float s) {
  const uint32_t sign = (u >> 31) << 3;
  const uint32_t mag = u & kAbsMask;
  if (mag >= kInfBits || !(s > 0.0f)) return sign;
  return sign | e2m1_mag_index(bitsf(mag), s);
}

// The signed value of an nvfp4 scale code (E4M3); nan: the NaN codes 0x7F / 0xFF.
__device__ __forceinline__ float nvfp4_scale_value(uint32_t scale_code, bool& nan) {
  nan = (scale_code & 0x7Fu) == 0x7Fu;
  const float s = e4m3_magnitude(scale_code & 0x7Fu);
  return (scale_code & 0x80u) ? -s : s;
}

// One nvfp4 element given its block's scale value s (nvfp4_scale_value):
// E2M1(nibble) * s, NaN for a NaN scale. The product is exact.
__device__ __forceinline__ float nvfp4_value(uint32_t nibble, float s, bool nan_scale) {
  if (nan_scale) return bitsf(kQuietNaN);
  float v = e2m1_magnitude(nibble & 7u);
  if (nibble & 8u) v = -v;
  return fmul(v, s);
}

// Decode one nvfp4 element: E2M1(nibble) * E4M3(scale code); NaN for a NaN
// scale (0x7F / 0xFF). The product is exact.
__device__ __forceinline__ float nvfp4_decode(uint32_t nibble, uint32_t scale_code) {
  bool nan;
  const float s = nvfp4_scale_value(scale_code, nan);
  return nvfp4_value(nibble, s, nan);
}

// The scale code of one nvfp4 block of `len` (1..16) elements x[j * stride] and
// the scale value used for its elements (0x7F = NaN for a block with NaN/Inf; the
// elements are then still encoded from the finite amax, non-finite ones as
// signed zeros, as the reference does).
struct Nvfp4Scale {
  uint32_t code;
  float value;
};

// The scale of an nvfp4 block whose BlockMax is bm (the block's, also when its
// elements are spread over lanes).
__device__ __forceinline__ Nvfp4Scale nvfp4_scale_of(const BlockMax& bm) {
  const uint32_t sidx = nvfp4_scale_index(bitsf(bm.amax));
  return Nvfp4Scale{bm.nonfinite ? 0x7Fu : sidx, e4m3_magnitude(sidx)};
}

__device__ __forceinline__ Nvfp4Scale nvfp4_block_scale(const float* x, int64_t stride, int len) {
  return nvfp4_scale_of(block_max(x, stride, len));
}

// The 4-bit codes of 4 consecutive elements of one block (scale value s), element j
// in bits 4j..4j + 3: the two packed bytes of the data (low nibble first), as one
// lane's share of a block split over lanes.
__device__ __forceinline__ uint32_t nvfp4_codes4(const float (&v)[4], float s) {
  uint32_t h = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) h |= nvfp4_code(fbits(v[j]), s) << (4 * j);
  return h;
}

// quantize + dequantize in place of len values of one nvfp4 block whose BlockMax is bm
// (as nvfp4_block_scale derives the scale from it; the block's, which may span more
// values than p holds: a block split over lanes). The values of nvfp4_decode(nvfp4_code)
// with fewer instructions: the thresholds computed once (e2m1_index, as nvfp4_code),
// the magnitude read from a packed table of twice the E2M1 values (0, 1, 2, 3, 4, 6, 8,
// 12) times s / 2 (exact: s >= 2^-9 is an E4M3 value), the element's sign put back on the
// bits as nvfp4_value's negation gives; a zero scale leaves signed zeros, a NaN/Inf
// block NaN.
__device__ __forceinline__ void nvfp4_round_trip_with(const BlockMax& bm, float* p, int len) {
  if (bm.nonfinite) {
    for (int j = 0; j < len; ++j) p[j] = bitsf(kQuietNaN);
    return;
  }
  const float s = e4m3_magnitude(nvfp4_scale_index(bitsf(bm.amax)));
  if (!(s > 0.0f)) {
    for (int j = 0; j < len; ++j) p[j] = bitsf(fbits(p[j]) & 0x80000000u);
    return;
  }
  const E2m1Thresholds th = e2m1_thresholds(s);
  const float half = fmul(0.5f, s);
  for (int j = 0; j < len; ++j) {
    const uint32_t u = fbits(p[j]);
    const uint32_t idx = e2m1_index(bitsf(u & kAbsMask), th);
    const float v = fmul(static_cast<float>((0xC8643210u >> (4u * idx)) & 0xFu), half);
    p[j] = bitsf(fbits(v) | (u & 0x80000000u));
  }
}

// quantize + dequantize of one nvfp4 block in place (R_int).
__device__ __forceinline__ void nvfp4_round_trip_block(float* p, int len) {
  nvfp4_round_trip_with(block_max(p, 1, len), p, len);
}

// ------------------------------------------------------------------ bf16 operands

// The bf16 bits of an exactly decoded float32 value f, without rounding: bf16 is
// float32's upper half (sign, exponent, the leading 7 fraction bits; its
// subnormals are float32's subnormals with a zero lower half), so bf16 holds f
// exactly iff f's lower 16 bits are zero. NaN gives 0x7FC0; so does an f bf16
// cannot hold, with inexact set (moe_ep_dequantize_bf16: exact or NaN, never rounded).
//
// Which decoded values bf16 holds (the claims of moe_ep_native.h):
// - nvfp4: E2M1 magnitudes are 0 or s * 2^q with significand s in {1, 1.5} (<= 2
//   significant bits); E4M3 magnitudes have <= 4 (normals 1.xxx, subnormals m * 2^-9,
//   m <= 7). A product has <= 6 significant bits (1.1b * 1.111b = 10.1101b) and a
//   magnitude in [0.5 * 2^-9, 6 * 448] = [2^-10, 2688], inside bf16's normal range
//   (8 significant bits, 2^-126 .. 2^128): always exact.
// - mxfp8: E4M3 * 2^(c - 127) has <= 4 significant bits and is a multiple of
//   2^(c - 136). At or above 2^-126 bf16 is normal and holds it (below 2^128; from
//   2^128 on float32 and bf16 are both +-Inf, as the spec's decode). Below 2^-126 bf16
//   holds exactly the multiples of 2^-133: guaranteed for c >= 3, not for c <= 2
//   (e.g. E4M3 2^-9 at c = 0 is 2^-136). Those are the only inexact values.
__device__ __forceinline__ uint16_t bf16_exact_bits(float f, bool& inexact) {
  const uint32_t u = fbits(f);
  if ((u & kAbsMask) > kInfBits) return 0x7FC0u;
  if ((u & 0xFFFFu) != 0u) {
    inexact = true;
    return 0x7FC0u;
  }
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_FORMAT_MATH_CUH_
