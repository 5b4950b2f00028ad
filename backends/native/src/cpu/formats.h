// Scalar encoders and decoders of the formats (docs/spec.md section 8),
// exact: every comparison is made in double, where the grids' midpoints times
// a scale are exact. Header-only so that the CPU kernels inline them.
#ifndef MOE_EP_NATIVE_CPU_FORMATS_H_
#define MOE_EP_NATIVE_CPU_FORMATS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace moe_ep {
namespace cpu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bf16 bits: nearest, ties to even; overflow to +-Inf; NaN stays a
// (quiet) NaN with its sign.
inline uint16_t bf16_from_float(float f) {
  uint32_t u = float_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// The bf16 bits of an exactly decoded float32 value f without rounding: bf16 is
// float32's upper half (same sign, exponent and leading 7 fraction bits, the
// subnormals included), so bf16 holds f exactly iff f's lower 16 bits are zero.
// NaN gives 0x7FC0; an inexact f gives 0x7FC0 too and sets *inexact.
inline uint16_t bf16_exact_bits(float f, bool* inexact) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  if ((u & 0xFFFFu) != 0) {
    *inexact = true;
    return 0x7FC0u;
  }
  return static_cast<uint16_t>(u >> 16);
}

// E4M3 (fn): 0x7F / 0xFF are NaN; magnitudes of codes 0..0x7E.
inline double e4m3_magnitude(int code) {
  int e = (code >> 3) & 0xF, m = code & 0x7;
  return e == 0 ? std::ldexp(static_cast<double>(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
}
inline double e4m3_value(uint8_t code) {
  if ((code & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  double v = e4m3_magnitude(code & 0x7F);
  return (code & 0x80) ? -v : v;
}
constexpr double kE2m1Values[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
constexpr double kE2m1Mids[7] = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0};
inline double e2m1_value(uint8_t nibble) {
  double v = kE2m1Values[nibble & 0x7];
  return (nibble & 0x8) ? -v : v;
}

// Index of the grid value nearest mag / scale (mag >= 0), ties to the even
// index, saturating at the last index: the count of midpoints (times scale)
// below mag, plus one at a tie whose upper neighbour is even. NaN gives 0.
template <typename MidFn>
inline int nearest_index(double mag, int num_mids, MidFn mid, double scale) {
  int idx = 0;
  for (int j = 0; j < num_mids; ++j) {
    double bound = mid(j) * scale;
    if (mag > bound) {
      ++idx;
    } else {
      if (mag == bound && (j + 1) % 2 == 0) ++idx;
      break;  // the bounds increase: no later one is below mag
    }
  }
  return idx;
}
inline double e4m3_mid(int j) { return 0.5 * (e4m3_magnitude(j) + e4m3_magnitude(j + 1)); }
constexpr int kE4m3Mids = 126;  // between the 127 finite magnitudes 0..0x7E
inline int e4m3_nearest(double mag, double scale) {
  // Binary search for the count of mids * scale below mag, then the tie rule.
  int lo = 0, hi = kE4m3Mids;  // answer in [0, 126]
  while (lo < hi) {
    int midj = (lo + hi) / 2;
    if (mag > e4m3_mid(midj) * scale) lo = midj + 1; else hi = midj;
  }
  int idx = lo;
  if (idx < kE4m3Mids && mag == e4m3_mid(idx) * scale && (idx + 1) % 2 == 0) ++idx;
  return idx;
}
inline int e2m1_nearest(double mag, double scale) {
  return nearest_index(mag, 7, [](int j) { return kE2m1Mids[j]; }, scale);
}

// mxfp8 scale exponent: the smallest e with amax <= 448 * 2^e, in [-127, 127];
// -127 for amax == 0 (amax finite, >= 0).
inline int mxfp8_scale_exponent(double amax) {
  if (!(amax > 0)) return -127;
  int e = static_cast<int>(std::ceil(std::log2(amax / 448.0)));
  while (amax > std::ldexp(448.0, e)) ++e;
  while (amax <= std::ldexp(448.0, e - 1)) --e;
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  return e;
}

}  // namespace cpu
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CPU_FORMATS_H_
