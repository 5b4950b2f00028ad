// CPU block quantize / dequantize over the [outer, n, inner] view (blocks along n).
#include "cpu/formats.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "internal.h"

namespace moe_ep {
namespace cpu {
namespace {

inline int64_t at(int64_t o, int64_t i, int64_t k, int64_t n, int64_t inner) { return (o * n + i) * inner + k; }

// The largest finite magnitude of elements [b0, b1) of column (o, k); sets
// *nonfinite when the block holds NaN or +-Inf.
double block_amax(const float* x, int64_t o, int64_t k, int64_t b0, int64_t b1, int64_t n, int64_t inner,
                  bool* nonfinite) {
  *nonfinite = false;
  double amax = 0.0;
  for (int64_t i = b0; i < b1; ++i) {
    const float v = x[at(o, i, k, n, inner)];
    if (!std::isfinite(v)) *nonfinite = true;
    else amax = std::max(amax, std::fabs(static_cast<double>(v)));
  }
  return amax;
}

// One mxfp8 block: elements [b0, b1) of column (o, k).
void quantize_mxfp8_block(const float* x, int64_t o, int64_t k, int64_t b0, int64_t b1, int64_t n, int64_t inner,
                          uint8_t* data, uint8_t* scale_code) {
  bool nonfinite;
  const double amax = block_amax(x, o, k, b0, b1, n, inner, &nonfinite);
  if (nonfinite) {  // no finite scale: the whole block decodes to NaN
    for (int64_t i = b0; i < b1; ++i) data[at(o, i, k, n, inner)] = 0x7F;
    *scale_code = 0xFF;
    return;
  }
  int e = mxfp8_scale_exponent(amax);
  double s = std::ldexp(1.0, e);
  for (int64_t i = b0; i < b1; ++i) {
    float v = x[at(o, i, k, n, inner)];
    double scaled = std::min(std::fabs(static_cast<double>(v)) / s, 448.0);  // exact: s is a power of two
    int idx = e4m3_nearest(scaled, 1.0);
    data[at(o, i, k, n, inner)] = static_cast<uint8_t>(idx | (std::signbit(v) ? 0x80 : 0));
  }
  *scale_code = static_cast<uint8_t>(e + 127);
}

// One nvfp4 block: writes the E2M1 code of each element to codes[i - b0].
uint8_t quantize_nvfp4_block(const float* x, int64_t o, int64_t k, int64_t b0, int64_t b1, int64_t n, int64_t inner,
                             uint8_t* codes) {
  bool nonfinite;
  const double amax = block_amax(x, o, k, b0, b1, n, inner, &nonfinite);
  int sidx = e4m3_nearest(amax, 6.0);  // E4M3(amax / 6), saturating at 448
  double s = e4m3_magnitude(sidx);
  for (int64_t i = b0; i < b1; ++i) {
    float v = x[at(o, i, k, n, inner)];
    double mag = std::isfinite(v) ? std::fabs(static_cast<double>(v)) : 0.0;
    int idx = s > 0 ? e2m1_nearest(mag, s) : 0;  // a zero scale zeroes its block
    codes[i - b0] = static_cast<uint8_t>(idx | (std::signbit(v) ? 0x8 : 0));
  }
  return nonfinite ? 0x7F : static_cast<uint8_t>(sidx);  // NaN scale: the block decodes to NaN
}

}  // namespace

moe_ep_status quantize(void*, moe_ep_format fmt, const float* x, int64_t outer, int64_t n, int64_t inner, void* data,
                       void* scale) {
  if (fmt == MOE_EP_FORMAT_BF16) {
    uint16_t* out = static_cast<uint16_t*>(data);
    const int64_t total = outer * n * inner;
    for (int64_t i = 0; i < total; ++i) out[i] = bf16_from_float(x[i]);
    return MOE_EP_OK;
  }
  uint8_t* d = static_cast<uint8_t*>(data);
  uint8_t* sc = static_cast<uint8_t*>(scale);
  if (fmt == MOE_EP_FORMAT_MXFP8) {
    const int64_t nb = ceil_div(n, kMxfp8Block);
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t k = 0; k < inner; ++k)
          quantize_mxfp8_block(x, o, k, b * kMxfp8Block, std::min(n, (b + 1) * kMxfp8Block), n, inner, d,
                               &sc[(o * nb + b) * inner + k]);
    return MOE_EP_OK;
  }
  // NVFP4: codes of a block, then packed two a byte along n.
  const int64_t nb = ceil_div(n, kNvfp4Block), np = ceil_div(n, 2);
  uint8_t codes[kNvfp4Block];
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t k = 0; k < inner; ++k) {
        const int64_t b0 = b * kNvfp4Block, b1 = std::min(n, b0 + kNvfp4Block);
        sc[(o * nb + b) * inner + k] = quantize_nvfp4_block(x, o, k, b0, b1, n, inner, codes);
        for (int64_t i = b0; i < b1; i += 2) {  // b0 is even: pairs never straddle blocks
          uint8_t lo = codes[i - b0], hi = (i + 1 < b1) ? codes[i + 1 - b0] : 0;
          d[(o * np + i / 2) * inner + k] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
        }
      }
  return MOE_EP_OK;
}

namespace {

// The element (o, i, k) of a block-scaled [outer, n, inner] view, decoded exactly to
// float32 (exact except an mxfp8 magnitude >= 2^128, which is +-Inf; NaN for a NaN scale
// or code): the one decode of dequantize and dequantize_bf16.
inline float decode_one(moe_ep_format fmt, const uint8_t* d, const uint8_t* sc, int64_t o, int64_t i, int64_t k,
                        int64_t n, int64_t inner) {
  if (fmt == MOE_EP_FORMAT_MXFP8) {
    const uint8_t s = sc[(o * ceil_div(n, kMxfp8Block) + i / kMxfp8Block) * inner + k];
    const double sv = s == 0xFF ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, static_cast<int>(s) - 127);
    return static_cast<float>(e4m3_value(d[at(o, i, k, n, inner)]) * sv);
  }
  const double sv = e4m3_value(sc[(o * ceil_div(n, kNvfp4Block) + i / kNvfp4Block) * inner + k]);
  const uint8_t byte = d[(o * ceil_div(n, 2) + i / 2) * inner + k];
  const uint8_t nib = (i % 2) ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0xF);
  return static_cast<float>(e2m1_value(nib) * sv);
}

// f(index, value) for every element (o, i, k) of a block-scaled [outer, n, inner] view in
// index order: its dense index and its decode_one value.
template <typename F>
void for_each_decoded(moe_ep_format fmt, const uint8_t* d, const uint8_t* sc, int64_t outer, int64_t n, int64_t inner,
                      F f) {
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < inner; ++k) f(at(o, i, k, n, inner), decode_one(fmt, d, sc, o, i, k, n, inner));
}

}  // namespace

moe_ep_status dequantize(void*, moe_ep_format fmt, const void* data, const void* scale, int64_t outer, int64_t n,
                         int64_t inner, float* out) {
  if (fmt == MOE_EP_FORMAT_BF16) {
    const uint16_t* in = static_cast<const uint16_t*>(data);
    const int64_t total = outer * n * inner;
    for (int64_t i = 0; i < total; ++i) out[i] = bf16_to_float(in[i]);
    return MOE_EP_OK;
  }
  for_each_decoded(fmt, static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(scale), outer, n, inner,
                   [out](int64_t a, float v) { out[a] = v; });
  return MOE_EP_OK;
}

namespace {

// An output element of the bf16 decode: its bf16 bits, or their float32 value.
inline void put_bf16(uint16_t* out, int64_t at, uint16_t bits) { out[at] = bits; }
inline void put_bf16(float* out, int64_t at, uint16_t bits) { out[at] = bf16_to_float(bits); }

// dequantize_bf16's decode into out (bf16 bits or their float32 values); sets *any when a
// value is not a bf16 value.
template <typename Out>
void decode_bf16_into(moe_ep_format fmt, const void* data, const void* scale, int64_t outer, int64_t n, int64_t inner,
                      int64_t transpose_rows, Out* out, bool* any) {
  const uint8_t* d = static_cast<const uint8_t*>(data);
  const uint8_t* sc = static_cast<const uint8_t*>(scale);
  if (transpose_rows == 0) {
    for_each_decoded(fmt, d, sc, outer, n, inner,
                     [out, any](int64_t a, float v) { put_bf16(out, a, bf16_exact_bits(v, any)); });
  } else {
    // inner == 1: row o = b * R + r of the view lands in column r of matrix b: out[b, i, r].
    const int64_t R = transpose_rows;
    for (int64_t o = 0; o < outer; ++o) {
      const int64_t b = o / R, r = o % R;
      for (int64_t i = 0; i < n; ++i)
        put_bf16(out, (b * n + i) * R + r, bf16_exact_bits(decode_one(fmt, d, sc, o, i, 0, n, 1), any));
    }
  }
}

}  // namespace

moe_ep_status dequantize_bf16(void*, moe_ep_format fmt, const void* data, const void* scale, int64_t outer, int64_t n,
                              int64_t inner, int64_t transpose_rows, uint16_t* out, int32_t* inexact) {
  bool any = false;
  decode_bf16_into(fmt, data, scale, outer, n, inner, transpose_rows, out, &any);
  if (any && inexact != nullptr) *inexact |= 1;
  return MOE_EP_OK;
}

void dequantize_bf16_values(moe_ep_format fmt, const void* data, const void* scale, int64_t outer, int64_t n,
                            int64_t inner, int64_t transpose_rows, float* out, int32_t* inexact) {
  bool any = false;
  decode_bf16_into(fmt, data, scale, outer, n, inner, transpose_rows, out, &any);
  if (any && inexact != nullptr) *inexact |= 1;
}

moe_ep_status dequantize_bf16_rows(void*, moe_ep_format fmt, const void* data, int64_t data_row_bytes,
                                   const void* scale, int64_t scale_row_bytes, int64_t rows, int64_t n, uint16_t* out,
                                   int32_t* inexact, const int32_t* route, int64_t num_topk, int64_t num_sources) {
  if (route != nullptr) {  // every id checked before anything is written
    for (int64_t o = 0; o < rows; ++o) {
      const int64_t r = route[o];
      if (r < -1 || r >= num_sources * num_topk)
        return fail(MOE_EP_ERR_INVALID_ARGUMENT,
                    "moe_ep_dequantize_bf16_gather: route[" + std::to_string(o) +
                        "] must be -1 or in [0, num_tokens * num_topk) = [0, " +
                        std::to_string(num_sources * num_topk) + "); got " + std::to_string(r));
    }
  }
  bool any = false;
  for (int64_t o = 0; o < rows; ++o) {
    const int64_t src = route == nullptr ? o : (route[o] < 0 ? -1 : route[o] / num_topk);
    if (src < 0) {  // a row of no route: zero bits
      for (int64_t i = 0; i < n; ++i) out[o * n + i] = 0;
      continue;
    }
    // The source row as a one-row view of its own: its codes and scales where they lie.
    const uint8_t* d = static_cast<const uint8_t*>(data) + src * data_row_bytes;
    const uint8_t* sc = static_cast<const uint8_t*>(scale) + src * scale_row_bytes;
    for (int64_t i = 0; i < n; ++i) out[o * n + i] = bf16_exact_bits(decode_one(fmt, d, sc, 0, i, 0, n, 1), &any);
  }
  if (any && inexact != nullptr) *inexact |= 1;
  return MOE_EP_OK;
}

moe_ep_status round_trip_row(int32_t fmt, float* row, int64_t n, std::vector<uint8_t>* data,
                             std::vector<uint8_t>* scale) {
  if (fmt == MOE_EP_FORMAT_NONE) return MOE_EP_OK;
  const moe_ep_format f = static_cast<moe_ep_format>(fmt);
  data->resize(static_cast<size_t>(2 * n + 2));
  scale->resize(static_cast<size_t>(ceil_div(n, 16) + 1));
  moe_ep_status st = quantize(nullptr, f, row, 1, n, 1, data->data(), scale->data());
  if (st != MOE_EP_OK) return st;
  return dequantize(nullptr, f, data->data(), scale->data(), 1, n, 1, row);
}

}  // namespace cpu
}  // namespace moe_ep
