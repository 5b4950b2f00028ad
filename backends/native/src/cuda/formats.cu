// CUDA quantize / dequantize over the [outer, n, inner] view (blocks along n).
// Index order of the threads: inner fastest, so that neighbouring threads touch
// neighbouring addresses whenever inner > 1. Blocks along contiguous rows (inner = 1,
// n a multiple of the block, aligned buffers) take the vec4 kernels instead, which give
// the same bytes through the same format_math.cuh helpers.
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/format_math.cuh"
#include "internal.h"

namespace moe_ep {
namespace cuda {
namespace {

using namespace detail;

// One thread per element: data[i] = bf16 bits of x[i] (nearest even).
__global__ void bf16_quantize_kernel(const float* __restrict__ x, int64_t total, uint16_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = bf16_from_float(x[i]);
}

// One thread per element: out[i] = the exact float32 value of bf16 bits data[i].
__global__ void bf16_dequantize_kernel(const uint16_t* __restrict__ in, int64_t total, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = bf16_to_float(in[i]);
}

// One thread per 4 elements t (total a multiple of 4): a float4 in, 4 bf16 (8 bytes) out.
__global__ void bf16_quantize_vec4_kernel(const float4* __restrict__ x, int64_t total4, uint2* __restrict__ out) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total4; t += int64_t{gridDim.x} * blockDim.x) {
    const float4 v = x[t];
    out[t] = bf16x4_from_float(v.x, v.y, v.z, v.w);
  }
}

// One thread per 4 elements t (total a multiple of 4): 4 bf16 (8 bytes) in, a float4 out.
__global__ void bf16_dequantize_vec4_kernel(const uint2* __restrict__ in, int64_t total4, float4* __restrict__ out) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total4; t += int64_t{gridDim.x} * blockDim.x) {
    const uint2 w = in[t];
    out[t] = make_float4(bf16_to_float(static_cast<uint16_t>(w.x)), bf16_to_float(static_cast<uint16_t>(w.x >> 16)),
                         bf16_to_float(static_cast<uint16_t>(w.y)), bf16_to_float(static_cast<uint16_t>(w.y >> 16)));
  }
}

// One thread per (outer o, block b, inner i): encodes elements k0..k0+len-1 of
// column (o, i), writes their E4M3 codes and the block's E8M0 code. The scale
// index (o * nb + b) * inner + i is the thread index itself.
__global__ void mxfp8_quantize_kernel(const float* __restrict__ x, int64_t outer, int64_t n, int64_t inner,
                                      uint8_t* __restrict__ data, uint8_t* __restrict__ scale) {
  const int64_t nb = div_up(n, kMxfp8Block);
  const int64_t total = outer * nb * inner;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t % inner, ob = t / inner, b = ob % nb, o = ob / nb;
    const int64_t k0 = b * kMxfp8Block;
    const int len = static_cast<int>(n - k0 < kMxfp8Block ? n - k0 : kMxfp8Block);
    const int64_t base = (o * n + k0) * inner + i;
    mxfp8_encode_block(x + base, inner, len, data + base, inner, scale + t);
  }
}

// One thread per (outer o, block b, inner i): the block's E4M3 scale code, then
// its codes packed two a byte (element 2j low nibble, 2j + 1 high nibble; an odd
// n leaves the last high nibble 0). Blocks start at even k, so a byte never
// straddles two blocks.
__global__ void nvfp4_quantize_kernel(const float* __restrict__ x, int64_t outer, int64_t n, int64_t inner,
                                      uint8_t* __restrict__ data, uint8_t* __restrict__ scale) {
  const int64_t nb = div_up(n, kNvfp4Block), np = div_up(n, 2);
  const int64_t total = outer * nb * inner;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t % inner, ob = t / inner, b = ob % nb, o = ob / nb;
    const int64_t k0 = b * kNvfp4Block;
    const int len = static_cast<int>(n - k0 < kNvfp4Block ? n - k0 : kNvfp4Block);
    const float* xb = x + (o * n + k0) * inner + i;
    const Nvfp4Scale sc = nvfp4_block_scale(xb, inner, len);
    uint8_t* db = data + (o * np + k0 / 2) * inner + i;
    for (int j = 0; j < len; j += 2) {
      const uint32_t lo = nvfp4_code(fbits(xb[j * inner]), sc.value);
      const uint32_t hi = j + 1 < len ? nvfp4_code(fbits(xb[(j + 1) * inner]), sc.value) : 0u;
      db[(j / 2) * inner] = static_cast<uint8_t>((lo & 0xFu) | ((hi & 0xFu) << 4));
    }
    scale[t] = static_cast<uint8_t>(sc.code);
  }
}

// ------------------------------------------------------------------ blocks along rows (inner = 1)
//
// With inner = 1 and n a multiple of the block, x is a flat array of whole blocks:
// float4 t holds elements 4t..4t + 3, all in block t / G (G = block / 4 lanes, 8 for
// mxfp8, 4 for nvfp4), which is also that block's scale index; no index needs a
// division. A block's G lanes are G-aligned in their warp.

constexpr int kMxGroup = static_cast<int>(kMxfp8Block) / 4;
constexpr int kNvGroup = static_cast<int>(kNvfp4Block) / 4;

// Loads float4 t of x for the lane that has one; zeros otherwise.
__device__ __forceinline__ void load4(const float4* __restrict__ x, int64_t t, int64_t total4, float (&v)[4]) {
  v[0] = v[1] = v[2] = v[3] = 0.0f;
  if (t < total4) {
    const float4 q = x[t];
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  }
}

// Float4 loads a lane issues before encoding any: the encode is long enough that one
// load a lane leaves too few bytes in flight to keep the memory busy.
constexpr int kEncUnroll = 4;

// A warp takes kEncUnroll * 32 float4 a trip: lane l holds float4 base + 32 u + l
// (coalesced), the lanes of each block (8, kGroup-aligned) agree on its amax, each
// stores its 4 codes as one word, the group's first lane the scale code. Trips are
// per warp, so every shuffle sees all 32 lanes.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    mxfp8_quantize_vec4_kernel(const float4* __restrict__ x, int64_t total4, uint32_t* __restrict__ data,
                               uint8_t* __restrict__ scale) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t first = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x - lane) * kUnroll;
  const int64_t step = int64_t{gridDim.x} * blockDim.x * kUnroll;
  for (int64_t base = first; base < total4; base += step) {
    float v[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load4(x, base + 32 * u + lane, total4, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + 32 * u + lane;
      const BlockMax bm = group_block_max<kMxGroup>(v[u]);
      if (t >= total4) continue;
      const uint32_t sc = mxfp8_scale_code(bm);
      data[t] = mxfp8_codes4(v[u], sc);
      if ((lane & (kMxGroup - 1)) == 0) scale[t / kMxGroup] = static_cast<uint8_t>(sc);
    }
  }
}

// As mxfp8_quantize_vec4_kernel with 4 lanes a block and 2 packed bytes a lane.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    nvfp4_quantize_vec4_kernel(const float4* __restrict__ x, int64_t total4, uint16_t* __restrict__ data,
                               uint8_t* __restrict__ scale) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t first = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x - lane) * kUnroll;
  const int64_t step = int64_t{gridDim.x} * blockDim.x * kUnroll;
  for (int64_t base = first; base < total4; base += step) {
    float v[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load4(x, base + 32 * u + lane, total4, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + 32 * u + lane;
      const BlockMax bm = group_block_max<kNvGroup>(v[u]);
      if (t >= total4) continue;
      const Nvfp4Scale sc = nvfp4_scale_of(bm);
      data[t] = static_cast<uint16_t>(nvfp4_codes4(v[u], sc.value));
      if ((lane & (kNvGroup - 1)) == 0) scale[t / kNvGroup] = static_cast<uint8_t>(sc.code);
    }
  }
}

// One thread per 4 codes t (one word): the float4 of their values, scale t / 8.
__global__ void mxfp8_dequantize_vec4_kernel(const uint32_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                             int64_t total4, float4* __restrict__ out) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total4; t += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t w = data[t], sc = scale[t / kMxGroup];
    out[t] = make_float4(mxfp8_decode(w & 0xFFu, sc), mxfp8_decode((w >> 8) & 0xFFu, sc),
                         mxfp8_decode((w >> 16) & 0xFFu, sc), mxfp8_decode(w >> 24, sc));
  }
}

// One thread per 4 codes t (2 packed bytes, low nibble first): their float4, scale t / 4.
__global__ void nvfp4_dequantize_vec4_kernel(const uint16_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                             int64_t total4, float4* __restrict__ out) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total4; t += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t h = data[t], sc = scale[t / kNvGroup];
    out[t] = make_float4(nvfp4_decode(h & 0xFu, sc), nvfp4_decode((h >> 4) & 0xFu, sc),
                         nvfp4_decode((h >> 8) & 0xFu, sc), nvfp4_decode(h >> 12, sc));
  }
}

// One thread per element (o, k, i): E4M3(data) * 2^(scale - 127) of its block.
__global__ void mxfp8_dequantize_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                        int64_t outer, int64_t n, int64_t inner, float* __restrict__ out) {
  const int64_t nb = div_up(n, kMxfp8Block);
  const int64_t total = outer * n * inner;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t % inner, ok = t / inner, k = ok % n, o = ok / n;
    out[t] = mxfp8_decode(data[t], scale[(o * nb + k / kMxfp8Block) * inner + i]);
  }
}

// One thread per element (o, k, i): E2M1(nibble k of the packed bytes) * E4M3(scale).
__global__ void nvfp4_dequantize_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                        int64_t outer, int64_t n, int64_t inner, float* __restrict__ out) {
  const int64_t nb = div_up(n, kNvfp4Block), np = div_up(n, 2);
  const int64_t total = outer * n * inner;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t % inner, ok = t / inner, k = ok % n, o = ok / n;
    const uint32_t byte = data[(o * np + k / 2) * inner + i];
    const uint32_t nibble = (k & 1) ? (byte >> 4) : (byte & 0xFu);
    out[t] = nvfp4_decode(nibble, scale[(o * nb + k / kNvfp4Block) * inner + i]);
  }
}

// ------------------------------------------------------------------ decode to bf16 (moe_ep_dequantize_bf16)
//
// Memory-bound: one byte (mxfp8) or half a byte (nvfp4) in, two bytes out per
// element. The fast kernels store 16 bytes at a time:
// - rows (inner = 1, no transpose; also rows at a stride): a thread decodes a piece of
//   8 elements (8 or 4 bytes of codes, inside one row since n is a multiple of 16 or
//   32) into one 16-byte store, a warp's pieces contiguous;
// - blocked along the middle axis (jax's weights): 16 neighbours along inner a thread (mxfp8:
//   a bf16 multiply a pair where the scales allow);
// - transposed (the expert weights [E, N, K] -> [E, K, N]): a block decodes a tile of
//   64 rows x 4 chunks through shared memory and writes it transposed, 8 bf16 a store.
// Anything else (inner > 1, ragged or misaligned) takes the element-by-element kernel.
// Every kernel ORs 1 into *inexact (when given) if some value is not a bf16 value
// (those decode to NaN, see bf16_exact_bits): one vote per warp, one atomic per warp
// that saw one, no host synchronisation.

constexpr int kTileRows = 64;  // rows of the transposed kernel's tile

// Every thread of the block calls this (no early return), so whole warps vote.
__device__ __forceinline__ void report_inexact(bool inexact, int32_t* flag) {
  const bool any = __any_sync(0xFFFFFFFFu, inexact);
  if (any && flag != nullptr && (threadIdx.x & 31u) == 0u) atomicOr(flag, 1);
}

// The scale of one 16-byte chunk's block(s), decoded once per chunk.
struct ChunkScale {
  float v0, v1;    // mxfp8: 2^(code - 127) (v1 unused); nvfp4: elements 0..15, 16..31 of the chunk
  bool nan0, nan1;
};

__device__ __forceinline__ ChunkScale mxfp8_chunk_scale(uint32_t sc) {
  const float v = exp2_exact(static_cast<int>(sc) - 127);
  return ChunkScale{v, v, sc == 0xFFu, sc == 0xFFu};
}

__device__ __forceinline__ ChunkScale nvfp4_chunk_scale(uint32_t sc0, uint32_t sc1) {
  ChunkScale s;
  s.v0 = nvfp4_scale_value(sc0, s.nan0);
  s.v1 = nvfp4_scale_value(sc1, s.nan1);
  return s;
}

// Elements 8q .. 8q + 7 of a 16-byte chunk of codes as 8 packed bf16 (element 8q + 2j
// in the low half of word j), decoded one group at a time so that few values are live.
// mxfp8: 16 codes, byte j = element j, one block. nvfp4: 32 elements, byte j holds
// 2j (low nibble) and 2j + 1 (high); elements 0..15 in one block, 16..31 in the next.
// 8 mxfp8 codes of one block (the bytes of w0, then w1) as 8 packed bf16, element 2j in
// the low half of word j.
__device__ __forceinline__ uint4 mxfp8_bf16x8(uint32_t w0, uint32_t w1, const ChunkScale& s, bool& inexact) {
  const uint32_t w[2] = {w0, w1};
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = mxfp8_values2((w[j / 2] >> ((j & 1) * 16)) & 0xFFFFu, s.v0, s.nan0, s.v0, s.nan0);
    out[j] = bf16_pair(bf16_exact_bits(v.x, inexact), bf16_exact_bits(v.y, inexact));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

template <bool kMx>
__device__ __forceinline__ uint4 chunk_bf16x8(const uint4 raw, int q, const ChunkScale& s, bool& inexact) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (kMx) {
    return mxfp8_bf16x8(w[2 * q], w[2 * q + 1], s, inexact);
  } else {
    const float sv = q < 2 ? s.v0 : s.v1;
    const bool nan = q < 2 ? s.nan0 : s.nan1;
    uint32_t out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t byte = (w[q] >> (8 * j)) & 0xFFu;
      out[j] = bf16_exact_bits(nvfp4_value(byte & 0xFu, sv, nan), inexact) |
               (uint32_t{bf16_exact_bits(nvfp4_value(byte >> 4, sv, nan), inexact)} << 16);
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// nvfp4's decode of 4 elements (the 4 nibbles of `half`, element k in nibble k) into two
// words of 2 bf16 each, element 2j in the low half of word j: the bf16 bits of the E2M1
// magnitudes looked up 4 at a time with byte permutes (their high and low bytes, indexed
// by the 3 magnitude bits), the sign bit of each nibble moved onto its bf16, then the
// exact bf16 product with the scale (E2M1 times E4M3 has at most 6 significant bits and
// lies in [2^-10, 2688]: bf16 holds it, and the hardware's bf16 multiply rounds nothing).
// sc2: the block's scale value as two bf16 (negative for a negative scale code).
__device__ __forceinline__ uint2 nvfp4_bf16x4(uint32_t half, __nv_bfloat162 sc2) {
  const uint32_t sel = half & 0x7777u;
  // E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as bf16: 0x0000, 0x3F00, 0x3F80, 0x3FC0,
  // 0x4000, 0x4040, 0x4080, 0x40C0 (bytes 0..3 of the first operand, 4..7 of the second).
  const uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, sel);
  const uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, sel);
  // Sign bit 3 of nibble k onto bit 7 of byte k: bytes (b0, b0, b1, b1) of the half hold
  // nibbles 0 and 2 low (bit 3, shifted up by 4) and 1 and 3 high (bit 7 already).
  const uint32_t b = __byte_perm(half, 0u, 0x1100u);
  const uint32_t h = hi | ((b << 4) & 0x00800080u) | (b & 0x80008000u);
  const uint32_t w0 = __byte_perm(lo, h, 0x5140u), w1 = __byte_perm(lo, h, 0x7362u);
  const __nv_bfloat162 p0 = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&w0), sc2);
  const __nv_bfloat162 p1 = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&w1), sc2);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&p0), *reinterpret_cast<const uint32_t*>(&p1));
}

// The bf16 pair of an nvfp4 scale code's value, or NaN (0x7FC0) for 0x7F / 0xFF.
__device__ __forceinline__ uint32_t nvfp4_scale_bf16x2(uint32_t sc, bool& nan) {
  const float v = nvfp4_scale_value(sc, nan);
  const uint32_t b = nan ? 0x7FC0u : fbits(v) >> 16;  // exact: E4M3 has 4 significant bits
  return b | (b << 16);
}

// 8 nvfp4 elements (the 4 bytes of `word`, element 2j in the low nibble of byte j) of one
// block whose scale code is sc, as one 16-byte vector of 8 bf16. Every value is exact (see
// bf16_exact_bits); a NaN scale's elements are 0x7FC0, as nvfp4_value gives.
__device__ __forceinline__ uint4 nvfp4_bf16x8(uint32_t word, uint32_t sc) {
  bool nan;
  const uint32_t sv = nvfp4_scale_bf16x2(sc, nan);
  if (nan) return make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
  const __nv_bfloat162 s2 = *reinterpret_cast<const __nv_bfloat162*>(&sv);
  const uint2 a = nvfp4_bf16x4(word & 0xFFFFu, s2), c = nvfp4_bf16x4(word >> 16, s2);
  return make_uint4(a.x, a.y, c.x, c.y);
}

// Whether any of the 4 codes of a word is a NaN code (0x7F or 0xFF).
__device__ __forceinline__ uint32_t mxfp8_nan_codes4(uint32_t w) { return __vcmpeq4(w & 0x7F7F7F7Fu, 0x7F7F7F7Fu); }

// Whether any of 16 codes is a NaN code.
__device__ __forceinline__ bool mxfp8_any_nan_code(const uint4 c4) {
  return (mxfp8_nan_codes4(c4.x) | mxfp8_nan_codes4(c4.y) | mxfp8_nan_codes4(c4.z) | mxfp8_nan_codes4(c4.w)) != 0;
}

// Two mxfp8 codes (the low 16 bits of `two`, element 0 in the low byte) times their scales
// as packed bf16, for scale codes in 10..254 (mxfp8_fast_scales) and codes that are not NaN:
// one E4M3 -> f16 convert, a pack to bf16 (exact: E4M3 lies in bf16's range and grid) and
// one bf16 multiply by sc2, the scales' bf16 pair (the bf16 bits of 2^(c - 127) are c << 7
// for 1 <= c <= 254), exact there (mxfp8_fast_scales).
__device__ __forceinline__ uint32_t mxfp8_pair_bf16_fast(uint32_t two, uint32_t sc2) {
  const float2 v = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3)));
  const __nv_bfloat162 p = __hmul2(__floats2bfloat162_rn(v.x, v.y), *reinterpret_cast<const __nv_bfloat162*>(&sc2));
  return *reinterpret_cast<const uint32_t*>(&p);
}

// Rows: row o's codes at data + o * data_row_bytes (n a multiple of the chunk, 16 or 32;
// the stride a multiple of 16) and its scales at scale + o * scale_row_bytes, out
// [outer, n] bf16. A thread decodes one piece of 8 elements, 8 codes (mxfp8, 8 bytes) or
// 8 nibbles (nvfp4, 4 bytes), into one 16-byte store, so that a warp's loads and stores
// both cover contiguous bytes; it loads kUnroll pieces (a block's stride apart) before
// decoding any, to keep enough bytes in flight. Piece p of a row starts at element 8 p:
// mxfp8 block p / 4, nvfp4 block p / 2.
// An mxfp8 piece whose scale code is in 10..254 and whose codes are not NaN decodes a pair
// at a time in bf16 (mxfp8_pair_bf16_fast); others element by element (mxfp8_bf16x8).
// With a route (RowGather::route not NULL) out row o is source row route[o] / num_topk, all
// zero bits where route[o] is outside [0, num_sources * num_topk) (-1: no route): the
// dispatch's gather at one rank and the decode in one pass.
constexpr int kUnroll = 8;

struct RowGather {
  const int32_t* route;  // NULL: the identity
  int64_t num_topk, num_sources;
};

// Out row o's source row, or -1 for a zero row.
__device__ __forceinline__ int64_t gather_source(const RowGather& g, int64_t o) {
  if (g.route == nullptr) return o;
  const int64_t r = __ldg(g.route + o);
  return r >= 0 && r < g.num_sources * g.num_topk ? div_nonneg(r, g.num_topk) : -1;
}

// Loads the pieces t = base + u * blockDim.x (u < kU, t < total) of a row-wise decode with
// per_row pieces a row: raw[u], the piece's codes (piece p of source row gather_source(g, row)),
// and sc[u], the scale code of its block (two pieces a block); zero[u] where the out row has
// no source.
template <int kU, typename Word>
__device__ __forceinline__ void load_row_pieces(const uint8_t* __restrict__ data, int64_t data_row_bytes,
                                                const uint8_t* __restrict__ scale, int64_t scale_row_bytes,
                                                int64_t base, int64_t total, int64_t per_row, const RowGather& g,
                                                Word (&raw)[kU], uint32_t (&sc)[kU], bool (&zero)[kU]) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int64_t t = base + int64_t{u} * blockDim.x;
    if (t >= total) break;
    const int64_t row = div_nonneg(t, per_row), p = t - row * per_row;
    const int64_t src = gather_source(g, row);
    zero[u] = src < 0;
    if (zero[u]) continue;
    raw[u] = __ldg(reinterpret_cast<const Word*>(data + src * data_row_bytes) + p);
    sc[u] = __ldg(scale + src * scale_row_bytes + p / 2);
  }
}

// nvfp4 rows (n a multiple of 32, 16-byte aligned): 8 codes a thread (one uint32, one
// scale), kUnroll pieces a block's width apart loaded before any is decoded.
__global__ void __launch_bounds__(kThreads)
    bf16_rows_nv_kernel(const uint8_t* __restrict__ data, int64_t data_row_bytes, const uint8_t* __restrict__ scale,
                        int64_t scale_row_bytes, int64_t outer, int64_t n, uint4* __restrict__ out, RowGather g) {
  const int64_t per_row = n / 8, total = outer * per_row;
  const int64_t step = int64_t{gridDim.x} * blockDim.x * kUnroll;
  for (int64_t base = blockIdx.x * int64_t{blockDim.x} * kUnroll + threadIdx.x; base < total; base += step) {
    uint32_t raw[kUnroll];
    uint32_t sc[kUnroll];
    bool zero[kUnroll];
    load_row_pieces(data, data_row_bytes, scale, scale_row_bytes, base, total, per_row, g, raw, sc, zero);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + int64_t{u} * blockDim.x;
      if (t >= total) break;
      out[t] = zero[u] ? make_uint4(0u, 0u, 0u, 0u) : nvfp4_bf16x8(raw[u], sc[u]);
    }
  }
}

// mxfp8 rows (n a multiple of 16, 16-byte aligned): 16 codes a thread (half a block: one
// scale), one 16-byte load into two 16-byte stores, kRows16Unroll pieces a block's width
// apart loaded before any is decoded. A piece whose scale code is in 10..254 and that holds
// no NaN code is decoded a bf16 pair at a time (mxfp8_pair_bf16_fast); others value by
// value. (Run 25: 0.17 ms where 8 codes a thread took 0.20, the one-rank prefill's rows.)
constexpr int kRows16Unroll = 4;

__global__ void __launch_bounds__(kThreads)
    bf16_rows_mx_kernel(const uint8_t* __restrict__ data, int64_t data_row_bytes, const uint8_t* __restrict__ scale,
                        int64_t scale_row_bytes, int64_t outer, int64_t n, uint4* __restrict__ out,
                        int32_t* __restrict__ flag, RowGather g) {
  const int64_t per_row = n / 16, total = outer * per_row;
  bool inexact = false;
  const int64_t step = int64_t{gridDim.x} * blockDim.x * kRows16Unroll;
  for (int64_t base = blockIdx.x * int64_t{blockDim.x} * kRows16Unroll + threadIdx.x; base < total; base += step) {
    uint4 raw[kRows16Unroll];
    uint32_t sc[kRows16Unroll];
    bool zero[kRows16Unroll];
    load_row_pieces(data, data_row_bytes, scale, scale_row_bytes, base, total, per_row, g, raw, sc, zero);
#pragma unroll
    for (int u = 0; u < kRows16Unroll; ++u) {
      const int64_t t = base + int64_t{u} * blockDim.x;
      if (t >= total) break;
      uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
      if (!zero[u]) {
        const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
        if (sc[u] >= 10u && sc[u] <= 254u &&
            (mxfp8_nan_codes4(w[0]) | mxfp8_nan_codes4(w[1]) | mxfp8_nan_codes4(w[2]) | mxfp8_nan_codes4(w[3])) == 0u) {
          const uint32_t sc2 = (sc[u] << 7) | (sc[u] << 23);  // (mxfp8_pair_bf16_fast)
          lo = make_uint4(mxfp8_pair_bf16_fast(w[0], sc2), mxfp8_pair_bf16_fast(w[0] >> 16, sc2),
                          mxfp8_pair_bf16_fast(w[1], sc2), mxfp8_pair_bf16_fast(w[1] >> 16, sc2));
          hi = make_uint4(mxfp8_pair_bf16_fast(w[2], sc2), mxfp8_pair_bf16_fast(w[2] >> 16, sc2),
                          mxfp8_pair_bf16_fast(w[3], sc2), mxfp8_pair_bf16_fast(w[3] >> 16, sc2));
        } else {
          const ChunkScale cs = mxfp8_chunk_scale(sc[u]);
          lo = mxfp8_bf16x8(w[0], w[1], cs, inexact);
          hi = mxfp8_bf16x8(w[2], w[3], cs, inexact);
        }
      }
      out[2 * t] = lo;
      out[2 * t + 1] = hi;
    }
  }
  report_inexact(inexact, flag);
}

// nvfp4 blocked along the middle axis of [outer, n, inner] (inner a multiple of 16; data,
// scale and out 16-byte aligned: e.g. jax's weights [E, H, 2I] blocked along H). A thread
// takes 16 neighbours along inner of one byte row j, which holds rows 2j (low nibbles) and
// 2j + 1 (high nibbles, when 2j + 1 < n) of one block of 16: their codes and their scales
// are 16 contiguous bytes each (every element has its own block along n), decoded element
// by element into two 16-byte stores a row. (mxfp8: bf16_inner_mx_kernel.)
__global__ void __launch_bounds__(kThreads)
    bf16_inner_nv_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale, int64_t outer,
                         int64_t n, int64_t inner, uint16_t* __restrict__ out, int32_t* __restrict__ flag) {
  const int64_t rows = div_up(n, 2);  // byte rows of one outer index
  const int64_t nb = div_up(n, kNvfp4Block);
  const int64_t per_row = inner / 16, total = outer * rows * per_row;
  bool inexact = false;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t ok = div_nonneg(t, per_row), i0 = (t - ok * per_row) * 16, o = div_nonneg(ok, rows), j = ok - o * rows;
    const uint4 c4 = __ldg(reinterpret_cast<const uint4*>(data + (o * rows + j) * inner + i0));
    const int64_t k = 2 * j;  // the first row of the view
    const uint4 s4 = __ldg(reinterpret_cast<const uint4*>(scale + (o * nb + k / kNvfp4Block) * inner + i0));
    const uint32_t cw[4] = {c4.x, c4.y, c4.z, c4.w}, sw[4] = {s4.x, s4.y, s4.z, s4.w};
    uint32_t lo[8], hi[8];  // bf16 pairs of rows k and k + 1
#pragma unroll
    for (int e = 0; e < 16; e += 2) {
      uint16_t a[2], b[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const uint32_t code = (cw[(e + u) / 4] >> (8 * ((e + u) % 4))) & 0xFFu;
        const uint32_t sc = (sw[(e + u) / 4] >> (8 * ((e + u) % 4))) & 0xFFu;
        a[u] = bf16_exact_bits(nvfp4_decode(code & 0xFu, sc), inexact);
        b[u] = bf16_exact_bits(nvfp4_decode(code >> 4, sc), inexact);
      }
      lo[e / 2] = bf16_pair(a[0], a[1]);
      hi[e / 2] = bf16_pair(b[0], b[1]);
    }
    uint4* o0 = reinterpret_cast<uint4*>(out + (o * n + k) * inner + i0);
    o0[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    o0[1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
    if (k + 1 < n) {
      uint4* o1 = reinterpret_cast<uint4*>(out + (o * n + k + 1) * inner + i0);
      o1[0] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      o1[1] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
    }
  }
  report_inexact(inexact, flag);
}

// One mxfp8 element pair (elements e and e + 1 of a 16-code chunk along inner, each with
// its own scale code), element by element: any scale, NaN codes, the inexact values.
__device__ __forceinline__ uint32_t mxfp8_inner_pair(const uint32_t cw[4], const uint32_t sw[4], int e,
                                                     bool& inexact) {
  const uint32_t sh = 8 * (e % 4);
  const uint32_t sa = (sw[e / 4] >> sh) & 0xFFu, sb = (sw[e / 4] >> (sh + 8)) & 0xFFu;
  const float2 v = mxfp8_values2((cw[e / 4] >> sh) & 0xFFFFu, exp2_exact(static_cast<int>(sa) - 127), sa == 0xFFu,
                                 exp2_exact(static_cast<int>(sb) - 127), sb == 0xFFu);
  return bf16_pair(bf16_exact_bits(v.x, inexact), bf16_exact_bits(v.y, inexact));
}

// Scale codes whose every mxfp8 value is exact in bf16 with room: for 10 <= c <= 254 the
// smallest non-zero magnitude, 2^-9 * 2^(c - 127), is at least 2^-126 (bf16's smallest
// normal) and 2^(c - 127) is a normal bf16, so the bf16 product of a code's value (4
// significant bits, exact in bf16) and the scale is the exact product, or +-Inf where that
// reaches 2^128 (as the float32 product: values below 2^128 have at most 1.875 * 2^127).
__device__ __forceinline__ bool mxfp8_fast_scales(const uint4 s4) {
  const uint32_t w[4] = {s4.x, s4.y, s4.z, s4.w};
  uint32_t bad = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) bad |= __vcmpltu4(w[j], 0x0A0A0A0Au) | __vcmpeq4(w[j], 0xFFFFFFFFu);
  return bad == 0;
}

// mxfp8 blocked along the middle axis of [outer, n, inner] (inner a multiple of 16; data,
// scale and out 16-byte aligned: jax's weights [E, H, 2I] blocked along H). A thread takes
// 16 neighbours along inner of one row: their codes and their scale codes are 16
// contiguous bytes each (every element has its own block along n; the scales are read
// again by the block's 32 rows, from cache), a warp's loads 512 contiguous bytes, two
// 16-byte stores. Where all 16 scales are in mxfp8_fast_scales' range and no code is NaN,
// a pair of codes is one E4M3 -> f16 convert, a pack to bf16 (exact) and one bf16 multiply
// by the scales' bf16 pair; otherwise the 16 decode element by element (mxfp8_inner_pair).
// 8 blocks an SM (32 registers): measured in run 20 against 16-byte pieces a thread for
// the rows of one block (run 18: 3x slower than the element-by-element kernel it replaced),
// 8-byte pieces, and 2 or 4 pieces a thread (all slower or within the noise).
__global__ void __launch_bounds__(kThreads, 8)
    bf16_inner_mx_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale, int64_t outer,
                         int64_t n, int64_t inner, uint16_t* __restrict__ out, int32_t* __restrict__ flag) {
  const int64_t nb = div_up(n, kMxfp8Block), per_row = inner / 16, total = outer * n * per_row;
  bool inexact = false;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t ok = div_nonneg(t, per_row), i0 = (t - ok * per_row) * 16, o = div_nonneg(ok, n), k = ok - o * n;
    const uint4 c4 = __ldg(reinterpret_cast<const uint4*>(data + ok * inner + i0));
    const uint4 s4 = __ldg(reinterpret_cast<const uint4*>(scale + (o * nb + k / kMxfp8Block) * inner + i0));
    const uint32_t cw[4] = {c4.x, c4.y, c4.z, c4.w}, sw[4] = {s4.x, s4.y, s4.z, s4.w};
    uint32_t w[8];
    if (mxfp8_fast_scales(s4) && !mxfp8_any_nan_code(c4)) {
#pragma unroll
      for (int e = 0; e < 16; e += 2) {  // the pair (e, e + 1) and its two scales
        const uint32_t sh = 8 * (e % 4);
        const uint32_t sc2 = (((sw[e / 4] >> sh) & 0xFFu) << 7) | (((sw[e / 4] >> (sh + 8)) & 0xFFu) << 23);
        w[e / 2] = mxfp8_pair_bf16_fast(cw[e / 4] >> sh, sc2);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 16; e += 2) w[e / 2] = mxfp8_inner_pair(cw, sw, e, inexact);
    }
    uint4* d = reinterpret_cast<uint4*>(out + ok * inner + i0);
    d[0] = make_uint4(w[0], w[1], w[2], w[3]);
    d[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
  report_inexact(inexact, flag);
}

// Element by element over rows with strides (any alignment): thread t writes out[t] of [outer, n].
template <bool kMx>
__global__ void bf16_strided_rows_kernel(const uint8_t* __restrict__ data, int64_t data_row_bytes,
                                         const uint8_t* __restrict__ scale, int64_t scale_row_bytes, int64_t outer,
                                         int64_t n, uint16_t* __restrict__ out, int32_t* __restrict__ flag,
                                         RowGather g) {
  const int64_t total = outer * n;
  bool inexact = false;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t o = t / n, k = t - o * n;
    const int64_t src = gather_source(g, o);
    if (src < 0) {
      out[t] = 0;
      continue;
    }
    const uint8_t* d = data + src * data_row_bytes;
    const uint8_t* sc = scale + src * scale_row_bytes;
    float f;
    if constexpr (kMx) {
      f = mxfp8_decode(d[k], sc[k / kMxfp8Block]);
    } else {
      const uint32_t byte = d[k / 2];
      f = nvfp4_decode((k & 1) ? (byte >> 4) : (byte & 0xFu), sc[k / kNvfp4Block]);
    }
    out[t] = bf16_exact_bits(f, inexact);
  }
  report_inexact(inexact, flag);
}

// Transposed: data [B, R, n] (blocked along n), out [B, n, R] bf16; R a multiple of 8,
// n of the chunk V. A block takes tiles of kTileRows rows x TK = 4 V columns: thread
// (r = tid / 4, c = tid % 4) loads chunk c of row r (each row's 4 chunks are 64
// contiguous bytes: whole sectors) and writes its V values down column r of the
// shared tile; then 8 threads store each of the TK output rows' 64 bf16 as 8
// 16-byte vectors (128 contiguous bytes). The tile's column of row r in chunk c is
// r ^ (8 c): a warp's 2-byte writes (rows 8w..8w+7, chunks 0..3) then fall in 16
// distinct banks, and the 8-column segment s of a chunk-c row is physical segment s ^ c.
template <bool kMx>
__global__ void __launch_bounds__(kThreads)
    bf16_transpose_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale, int64_t batches,
                          int64_t R, int64_t n, uint16_t* __restrict__ out, int32_t* __restrict__ flag) {
  constexpr int V = kMx ? 16 : 32;
  constexpr int TK = 4 * V;
  static_assert(kThreads == 4 * kTileRows, "one chunk per thread");
  static_assert((TK * 8) % kThreads == 0, "whole store rounds");
  __shared__ __align__(16) uint16_t tile[TK][kTileRows];
  const int64_t row_bytes = kMx ? n : n / 2;
  const int64_t nb = div_up(n, kMx ? kMxfp8Block : kNvfp4Block);
  const int64_t rt = div_up(R, kTileRows), kt = div_up(n, TK), per_batch = rt * kt, tiles = batches * per_batch;
  const int lr = static_cast<int>(threadIdx.x) >> 2, lc = static_cast<int>(threadIdx.x) & 3;
  bool inexact = false;
  for (int64_t tid = blockIdx.x; tid < tiles; tid += gridDim.x) {
    const int64_t b = tid / per_batch, rk = tid - b * per_batch;
    const int64_t r0 = (rk / kt) * kTileRows, k0 = (rk % kt) * TK;
    const int64_t row = r0 + lr, k = k0 + int64_t{lc} * V;
    const int pc = lr ^ (lc << 3);
    if (row < R && k < n) {
      const int64_t o = b * R + row;
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(data + o * row_bytes + (kMx ? k : k / 2)));
      const ChunkScale s = kMx ? mxfp8_chunk_scale(scale[o * nb + k / kMxfp8Block])
                               : nvfp4_chunk_scale(scale[o * nb + k / kNvfp4Block], scale[o * nb + k / kNvfp4Block + 1]);
#pragma unroll
      for (int q = 0; q < V / 8; ++q) {
        const uint4 p = chunk_bf16x8<kMx>(raw, q, s, inexact);
        const uint32_t w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) tile[lc * V + 8 * q + j][pc] = static_cast<uint16_t>(w[j / 2] >> ((j & 1) * 16));
      }
    }  // rows past R and columns past n stay unwritten: they are never stored
    __syncthreads();
#pragma unroll
    for (int it = 0; it < TK * 8 / kThreads; ++it) {
      const int idx = it * kThreads + static_cast<int>(threadIdx.x);
      const int kk = idx >> 3, seg = idx & 7, c = kk / V;
      const int64_t kg = k0 + kk, rg = r0 + seg * 8;
      if (kg < n && rg < R)
        *reinterpret_cast<uint4*>(out + (b * n + kg) * R + rg) =
            *reinterpret_cast<const uint4*>(&tile[kk][(seg ^ c) << 3]);
    }
    __syncthreads();
  }
  report_inexact(inexact, flag);
}

// Element by element (any inner, any alignment): thread t writes out[t]. R = 0: out
// is the view [outer, n, inner]; R >= 1 (inner = 1): out is [outer / R, n, R].
template <bool kMx>
__global__ void bf16_elements_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                     int64_t outer, int64_t n, int64_t inner, int64_t R, uint16_t* __restrict__ out,
                                     int32_t* __restrict__ flag) {
  const int64_t total = outer * n * inner;
  const int64_t nb = div_up(n, kMx ? kMxfp8Block : kNvfp4Block), np = div_up(n, 2);
  bool inexact = false;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    int64_t o, k, i;
    if (R == 0) {
      i = t % inner;
      const int64_t ok = t / inner;
      k = ok % n;
      o = ok / n;
    } else {
      const int64_t r = t % R, bk = t / R;
      k = bk % n;
      o = (bk / n) * R + r;
      i = 0;
    }
    float f;
    if constexpr (kMx) {
      f = mxfp8_decode(data[(o * n + k) * inner + i], scale[(o * nb + k / kMxfp8Block) * inner + i]);
    } else {
      const uint32_t byte = data[(o * np + k / 2) * inner + i];
      f = nvfp4_decode((k & 1) ? (byte >> 4) : (byte & 0xFu), scale[(o * nb + k / kNvfp4Block) * inner + i]);
    }
    out[t] = bf16_exact_bits(f, inexact);
  }
  report_inexact(inexact, flag);
}

template <bool kMx>
moe_ep_status launch_dequantize_bf16_rows(cudaStream_t s, const uint8_t* data, int64_t data_row_bytes,
                                          const uint8_t* scale, int64_t scale_row_bytes, int64_t outer, int64_t n,
                                          uint16_t* out, int32_t* flag, RowGather g = RowGather{nullptr, 1, 0}) {
  constexpr int64_t V = kMx ? 16 : 32;
  if (n % V == 0 && data_row_bytes % 16 == 0 && aligned16(data) && aligned16(out)) {
    if constexpr (kMx) {
      bf16_rows_mx_kernel<<<blocks_for(div_up(outer * (n / 16), int64_t{kRows16Unroll})), kThreads, 0, s>>>(
          data, data_row_bytes, scale, scale_row_bytes, outer, n, reinterpret_cast<uint4*>(out), flag, g);
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_rows_mx_kernel");
    } else {
      bf16_rows_nv_kernel<<<blocks_for(div_up(outer * (n / 8), kUnroll)), kThreads, 0, s>>>(
          data, data_row_bytes, scale, scale_row_bytes, outer, n, reinterpret_cast<uint4*>(out), g);
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_rows_nv_kernel");
    }
    return MOE_EP_OK;
  }
  bf16_strided_rows_kernel<kMx><<<blocks_for(outer * n), kThreads, 0, s>>>(data, data_row_bytes, scale,
                                                                           scale_row_bytes, outer, n, out, flag, g);
  MOE_EP_CUDA_CHECK_LAUNCH("bf16_strided_rows_kernel");
  return MOE_EP_OK;
}

template <bool kMx>
moe_ep_status launch_dequantize_bf16(cudaStream_t s, const uint8_t* data, const uint8_t* scale, int64_t outer,
                                     int64_t n, int64_t inner, int64_t R, uint16_t* out, int32_t* flag) {
  constexpr int64_t V = kMx ? 16 : 32;
  if (inner == 1 && R == 0)  // contiguous rows: the rows' decode with the rows' own strides
    return launch_dequantize_bf16_rows<kMx>(s, data, kMx ? n : div_up(n, 2), scale,
                                            div_up(n, kMx ? kMxfp8Block : kNvfp4Block), outer, n, out, flag);
  const bool aligned = aligned16(data) && aligned16(out);
  if (inner == 1 && n % V == 0 && aligned) {
    if (R % 8 == 0) {
      const int64_t tiles = (outer / R) * div_up(R, kTileRows) * div_up(n, 4 * V);
      const unsigned grid = static_cast<unsigned>(tiles < kMaxBlocks ? tiles : kMaxBlocks);
      bf16_transpose_kernel<kMx><<<grid, kThreads, 0, s>>>(data, scale, outer / R, R, n, out, flag);
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_transpose_kernel");
      return MOE_EP_OK;
    }
  }
  if (R == 0 && inner > 1 && inner % 16 == 0 && aligned && aligned16(scale)) {
    if constexpr (kMx) {
      bf16_inner_mx_kernel<<<blocks_for(outer * n * (inner / 16)), kThreads, 0, s>>>(data, scale, outer, n, inner,
                                                                                    out, flag);
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_inner_mx_kernel");
    } else {
      const int64_t units = outer * div_up(n, 2) * (inner / 16);
      bf16_inner_nv_kernel<<<blocks_for(units), kThreads, 0, s>>>(data, scale, outer, n, inner, out, flag);
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_inner_nv_kernel");
    }
    return MOE_EP_OK;
  }
  bf16_elements_kernel<kMx><<<blocks_for(outer * n * inner), kThreads, 0, s>>>(data, scale, outer, n, inner, R, out,
                                                                              flag);
  MOE_EP_CUDA_CHECK_LAUNCH("bf16_elements_kernel");
  return MOE_EP_OK;
}


}  // namespace

moe_ep_status quantize(void* stream, moe_ep_format fmt, const float* x, int64_t outer, int64_t n, int64_t inner,
                       void* data, void* scale) {
  const cudaStream_t s = as_stream(stream);
  switch (fmt) {
    case MOE_EP_FORMAT_BF16: {
      const int64_t total = outer * n * inner;
      if (total == 0) return MOE_EP_OK;
      if (total % 4 == 0 && aligned16(x) && aligned_to(data, 8)) {
        bf16_quantize_vec4_kernel<<<blocks_for(total / 4), kThreads, 0, s>>>(reinterpret_cast<const float4*>(x),
                                                                            total / 4, static_cast<uint2*>(data));
        MOE_EP_CUDA_CHECK_LAUNCH("bf16_quantize_vec4_kernel");
        return MOE_EP_OK;
      }
      bf16_quantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(x, total, static_cast<uint16_t*>(data));
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_quantize_kernel");
      return MOE_EP_OK;
    }
    case MOE_EP_FORMAT_MXFP8: {
      const int64_t total = outer * div_up(n, kMxfp8Block) * inner;
      if (total == 0) return MOE_EP_OK;
      // Blocks along contiguous rows (the layer's case): the lane-per-float4 kernel.
      if (inner == 1 && n % kMxfp8Block == 0 && aligned16(x) && aligned_to(data, 4)) {
        const int64_t total4 = outer * n / 4;
        mxfp8_quantize_vec4_kernel<kEncUnroll><<<blocks_for(div_up(total4, kEncUnroll)), kThreads, 0, s>>>(
            reinterpret_cast<const float4*>(x), total4, static_cast<uint32_t*>(data), static_cast<uint8_t*>(scale));
        MOE_EP_CUDA_CHECK_LAUNCH("mxfp8_quantize_vec4_kernel");
        return MOE_EP_OK;
      }
      mxfp8_quantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(x, outer, n, inner, static_cast<uint8_t*>(data),
                                                                    static_cast<uint8_t*>(scale));
      MOE_EP_CUDA_CHECK_LAUNCH("mxfp8_quantize_kernel");
      return MOE_EP_OK;
    }
    case MOE_EP_FORMAT_NVFP4: {
      const int64_t total = outer * div_up(n, kNvfp4Block) * inner;
      if (total == 0) return MOE_EP_OK;
      if (inner == 1 && n % kNvfp4Block == 0 && aligned16(x) && aligned_to(data, 2)) {
        const int64_t total4 = outer * n / 4;
        nvfp4_quantize_vec4_kernel<kEncUnroll><<<blocks_for(div_up(total4, kEncUnroll)), kThreads, 0, s>>>(
            reinterpret_cast<const float4*>(x), total4, static_cast<uint16_t*>(data), static_cast<uint8_t*>(scale));
        MOE_EP_CUDA_CHECK_LAUNCH("nvfp4_quantize_vec4_kernel");
        return MOE_EP_OK;
      }
      nvfp4_quantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(x, outer, n, inner, static_cast<uint8_t*>(data),
                                                                    static_cast<uint8_t*>(scale));
      MOE_EP_CUDA_CHECK_LAUNCH("nvfp4_quantize_kernel");
      return MOE_EP_OK;
    }
    default:
      return fail(MOE_EP_ERR_INTERNAL, "cuda::quantize: unexpected format " + std::to_string(static_cast<int>(fmt)));
  }
}

moe_ep_status dequantize(void* stream, moe_ep_format fmt, const void* data, const void* scale, int64_t outer,
                         int64_t n, int64_t inner, float* out) {
  const cudaStream_t s = as_stream(stream);
  const int64_t total = outer * n * inner;
  if (total == 0) return MOE_EP_OK;
  // Four elements a thread where out takes float4 stores and the codes whole-word loads
  // (mxfp8 / nvfp4: blocks along contiguous rows, so no per-element division).
  const int64_t total4 = total / 4;
  const bool out16 = aligned16(out);
  switch (fmt) {
    case MOE_EP_FORMAT_BF16:
      if (total % 4 == 0 && out16 && aligned_to(data, 8)) {
        bf16_dequantize_vec4_kernel<<<blocks_for(total4), kThreads, 0, s>>>(static_cast<const uint2*>(data), total4,
                                                                           reinterpret_cast<float4*>(out));
        MOE_EP_CUDA_CHECK_LAUNCH("bf16_dequantize_vec4_kernel");
        return MOE_EP_OK;
      }
      bf16_dequantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(static_cast<const uint16_t*>(data), total, out);
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_dequantize_kernel");
      return MOE_EP_OK;
    case MOE_EP_FORMAT_MXFP8:
      if (inner == 1 && n % kMxfp8Block == 0 && out16 && aligned_to(data, 4)) {
        mxfp8_dequantize_vec4_kernel<<<blocks_for(total4), kThreads, 0, s>>>(static_cast<const uint32_t*>(data),
                                                                            static_cast<const uint8_t*>(scale), total4,
                                                                            reinterpret_cast<float4*>(out));
        MOE_EP_CUDA_CHECK_LAUNCH("mxfp8_dequantize_vec4_kernel");
        return MOE_EP_OK;
      }
      mxfp8_dequantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(
          static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(scale), outer, n, inner, out);
      MOE_EP_CUDA_CHECK_LAUNCH("mxfp8_dequantize_kernel");
      return MOE_EP_OK;
    case MOE_EP_FORMAT_NVFP4:
      if (inner == 1 && n % kNvfp4Block == 0 && out16 && aligned_to(data, 2)) {
        nvfp4_dequantize_vec4_kernel<<<blocks_for(total4), kThreads, 0, s>>>(static_cast<const uint16_t*>(data),
                                                                            static_cast<const uint8_t*>(scale), total4,
                                                                            reinterpret_cast<float4*>(out));
        MOE_EP_CUDA_CHECK_LAUNCH("nvfp4_dequantize_vec4_kernel");
        return MOE_EP_OK;
      }
      nvfp4_dequantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(
          static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(scale), outer, n, inner, out);
      MOE_EP_CUDA_CHECK_LAUNCH("nvfp4_dequantize_kernel");
      return MOE_EP_OK;
    default:
      return fail(MOE_EP_ERR_INTERNAL, "cuda::dequantize: unexpected format " + std::to_string(static_cast<int>(fmt)));
  }
}

moe_ep_status dequantize_bf16(void* stream, moe_ep_format fmt, const void* data, const void* scale, int64_t outer,
                              int64_t n, int64_t inner, int64_t transpose_rows, uint16_t* out, int32_t* inexact) {
  const cudaStream_t s = as_stream(stream);
  const auto* d = static_cast<const uint8_t*>(data);
  const auto* sc = static_cast<const uint8_t*>(scale);
  switch (fmt) {
    case MOE_EP_FORMAT_MXFP8:
      return launch_dequantize_bf16<true>(s, d, sc, outer, n, inner, transpose_rows, out, inexact);
    case MOE_EP_FORMAT_NVFP4:
      return launch_dequantize_bf16<false>(s, d, sc, outer, n, inner, transpose_rows, out, inexact);
    default:
      return fail(MOE_EP_ERR_INTERNAL,
                  "cuda::dequantize_bf16: unexpected format " + std::to_string(static_cast<int>(fmt)));
  }
}

moe_ep_status dequantize_bf16_rows(void* stream, moe_ep_format fmt, const void* data, int64_t data_row_bytes,
                                   const void* scale, int64_t scale_row_bytes, int64_t rows, int64_t n, uint16_t* out,
                                   int32_t* inexact, const int32_t* route, int64_t num_topk, int64_t num_sources) {
  const cudaStream_t s = as_stream(stream);
  const auto* d = static_cast<const uint8_t*>(data);
  const auto* sc = static_cast<const uint8_t*>(scale);
  const RowGather g{route, num_topk, num_sources};
  switch (fmt) {
    case MOE_EP_FORMAT_MXFP8:
      return launch_dequantize_bf16_rows<true>(s, d, data_row_bytes, sc, scale_row_bytes, rows, n, out, inexact, g);
    case MOE_EP_FORMAT_NVFP4:
      return launch_dequantize_bf16_rows<false>(s, d, data_row_bytes, sc, scale_row_bytes, rows, n, out, inexact, g);
    default:
      return fail(MOE_EP_ERR_INTERNAL,
                  "cuda::dequantize_bf16_rows: unexpected format " + std::to_string(static_cast<int>(fmt)));
  }
}

}  // namespace cuda
}  // namespace moe_ep
