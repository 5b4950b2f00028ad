// A grouped GEMM for few rows per expert that reads mxfp8 weights as they are stored:
// y[r, n] = sum_k x[r, k] * W_e[n, k] for the rows r of expert e (off[e] <= r < off[e + 1]),
// with W_e[n, k] = E4M3(codes[e, n, k]) * 2^(scales[e, n, k / 32] - 127) decoded to bf16 in
// registers and multiplied on the tensor cores (mma.sync m16n8k16, bf16 in, float32
// accumulation). The weights are read once per pass of up to 48 or 64 rows of an expert
// (the variant mxfp8_weights_gemm picks), at one byte an element plus a scale byte per 32,
// instead of the two bytes of a kept bf16 decode: the decode forward's weight read
// (docs/cuda-nccl.md, "The block-scaled-weights forward"). The layer's mxfp8-weights
// forward (moe_ep_layer_experts_forward_mxfp8) runs its FC1 and FC2 through it.
//
// Layouts: x [C, K] bf16 row-major (the expert-major rows), or three such planes summed
// (x_planes: FC2's exact bf16 pieces of a float32 operand); codes [E, N, K] and scales
// [E, N, K / 32] (the transposed block-scaled weight, blocked along K: K-major, what the
// A operand of mma .row.col wants); y [C, N] float32 or y_bf16 [C, N] bf16 row-major
// (rows past off[E] untouched). Needs K % 128 == 0 and N % 128 == 0
// (mxfp8_weights_gemm_fits).
//
// Exact decode. Fast (scale codes 10..254, kFastScaleMin): E4M3 -> f16 (cvt, exact, NaN
// kept) -> float32 -> bf16 (exact: every E4M3 value is a bf16 value), then one bf16x2
// multiply by 2^(c - 127), exact because every nonzero result is a normal bf16 (or overflows
// to +-Inf, as the float32 product does). Slow (codes 0..9 and 0xFF, per lane and 16
// codes, run only in a stage where a lane of the warp has such a code: the stage's other
// copy, see pass): E4M3 -> f16 -> float32, times 2^(c - 127) in float32 (exact), then the bf16
// convert, which rounds nothing for scale codes c >= 3 (docs/cuda-nccl.md, "bf16 holds the
// decoded values"). A scale code 0xFF (NaN) or a NaN code gives NaN. Where a scale code is
// below 3, the lane checks its 16 values: if one is not a bf16 value, its 16 values of that
// weight row decode to NaN (every output of that weight row and expert is NaN either way,
// as with moe_ep_dequantize_bf16's NaN for that one value) and 1 is ORed into *inexact: the
// result is exact or visibly not, never silently rounded.
//
// The pipeline: a block (4 warps, 128 weight rows of one expert) streams K in stages of
// 128 through shared memory with cp.async, Config::kStages deep: the stage's codes (128 rows x
// 128 bytes, 16-byte chunks swizzled by the row's parity), scales (4 bytes a row) and x
// rows (up to 8 kMaxNt, rows past the expert's last zero-filled; rows padded to 272
// bytes). So the loads of later stages are in flight while a stage is multiplied. The
// decoded weights are the MMA's m16 A operand (a warp's 32 weight rows: two A tiles) and
// the x rows its n8 B operand: a pass takes the n8 tiles the expert's remaining rows need
// (1 to kMaxNt: 6 or 8, or 4 with passes_of_32), so a 20-row expert multiplies 24 rows.
//
// The sum over k is permuted alike for both operands: in each 64-slice, lane quad q holds
// the 16 codes [16 q, 16 q + 16) of its weight row (one 16-byte shared load), and the
// k16 step j of the slice takes codes 4 j .. 4 j + 3 of every quad as the logical
// columns {2 q, 2 q + 1, 2 q + 8, 2 q + 9} of the MMA; the x fragments are read at the
// same physical columns (16 bytes a row for two steps).
#ifndef MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_GEMM_CUH_
#define MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_GEMM_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/format_math.cuh"
#include "cuda/pdl.cuh"

namespace moe_ep {
namespace cuda {

struct Mxfp8WeightsGemm {
  const uint16_t* x;      // [C, K] bf16
  const int32_t* off;     // [E + 1] row offsets of the experts (device)
  const uint8_t* codes;   // [E, N, K] E4M3
  const uint8_t* scales;  // [E, N, K / 32] E8M0
  int num_experts;
  int64_t n, k;
  float* y;             // [C, N] float32 out (when y_bf16 is NULL)
  uint16_t* y_bf16;     // [C, N] bf16 out (the bf16 rounding of the sums), or NULL
  bool accumulate;      // y += instead of y = (float32 output only)
  int32_t* inexact;     // [1]: 1 ORed in where a weight value is not a bf16 value (NULL: not reported)
  bool passes_of_32;    // every pass 32 rows (the weights read once per 32 rows), instead of up to 64
  // Rows of x (an upper bound on off[E], read on the host, never from the offsets): picks
  // the kernel variant by the rows an expert on average (mxfp8_weights_gemm). 0: unknown.
  int64_t total_rows;
  // x as x_planes bf16 planes (0 or 1: one; 3: the exact bf16 pieces of a float32 operand,
  // plane p at x + p * x_plane_stride elements), summed: y = sum_p x_p W (float32 y only).
  // At few rows one pass multiplies every plane with the weights decoded once.
  int x_planes;
  int64_t x_plane_stride;
  // Or the offsets made on the device from group_sizes [E] int32 (device): off[0] = 0,
  // off[e + 1] = min(off[e] + max(group_sizes[e], 0), total_rows) (total_rows > 0 then, E at
  // most 1024), each block summing the sizes before its expert's; the blocks of column 0
  // write them to off_out [E + 1] int32 (device) for the kernels after this launch. off is
  // then not read. One launch fewer than a separate offsets kernel.
  const int32_t* group_sizes;
  int32_t* off_out;
};

namespace mxw {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 32;               // weight rows a warp: four n8 tiles
constexpr int kTileN = kWarps * kRowsPerWarp;  // weight rows a block
constexpr int kStageK = 128;                   // k a stage: two 64-slices
constexpr int kXStride = kStageK + 8;          // bf16 a shared x row: 272 bytes (conflict-free 16-byte reads)
// Scale codes the fast decode takes: from 10 (every product v 2^(c - 127) of a nonzero E4M3
// value v >= 2^-9 is then a normal bf16, so no subnormal arithmetic is involved) to 254.
constexpr uint32_t kFastScaleMin = 10;

template <int kMaxRows, int kPlanes>
struct Stage {
  uint4 w[kTileN][kStageK / 16];            // codes, 16-byte chunk c of row r at c ^ (4 * (r & 1))
  uint32_t s[kTileN];                       // 4 scale codes a row
  uint16_t x[kPlanes][kMaxRows][kXStride];  // x rows, each plane's
};
// A kernel variant: kMaxNt, the n8 tiles of x rows a pass holds at most (a pass: up to
// 8 kMaxNt rows of one expert, the weights read once); kStages, the cp.async pipeline's
// depth; kMinBlocks, the blocks an SM should hold (__launch_bounds__'s register budget);
// kPlanes, the x planes a pass multiplies (Mxfp8WeightsGemm::x_planes: 1 or 3).
template <int kMaxNt_, int kStages_, int kMinBlocks_, int kPlanes_ = 1>
struct Config {
  static constexpr int kMaxNt = kMaxNt_;
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kPlanes = kPlanes_;
  static constexpr int kMaxRows = 8 * kMaxNt_;
};
// The rows an expert on average (Mxfp8WeightsGemm::total_rows / num_experts) up to which
// mxfp8_weights_gemm picks FewRowsConfig (and Planes3Config). cuda-nccl's front-end takes the
// kernel up to the same bound (prims.MXFP8_WEIGHTS_MAX_ROWS_PER_EXPERT; a CPU test reads this
// line and compares).
constexpr int64_t kFewRowsPerExpert = 48;
// The variants mxfp8_weights_gemm picks (2026-12-02, runs 39 to 45 on an H200, the
// routing's spread of 20..42 rows an expert at 128 tokens, against a device copy of the
// codes in the same run; docs/cuda-nccl.md, "The block-scaled-weights forward"):
// - at most 48 rows an expert on average: passes of up to 48 rows, 2 stages, 3 blocks an SM
//   (168 registers, 60 KB of shared memory a block);
using FewRowsConfig = Config<6, 2, 3>;
// - the same rows and a long K (at least kLongK: FC1's hidden): 3 stages, 2 blocks an SM. At
//   the decode's spread FC1 (K 7168) takes 0.379 ms against FewRowsConfig's 0.398 on an H100
//   (2026-12-06) and 0.327 against 0.332 on an H200 (2026-12-02); FC2 (K 2048) keeps
//   FewRowsConfig (0.170 against 0.175 ms on the H200, 0.215 against 0.211 on the H100).
using FewRowsLongKConfig = Config<6, 3, 2>;
constexpr int64_t kLongK = 4096;
// - more rows: passes of up to 64 rows, 3 stages, 2 blocks an SM (103 KB).
using DefaultConfig = Config<8, 3, 2>;
// - passes_of_32: passes of up to 32 rows.
using Passes32Config = Config<4, 3, 2>;
// - three x planes at few rows: passes of up to 48 rows, 2 stages, 2 blocks an SM (110 KB of
//   shared memory a block: the three planes' x rows). More rows: a plane a launch.
using Planes3Config = Config<6, 2, 2, 3>;
template <class Cfg>
using StageOf = Stage<Cfg::kMaxRows, Cfg::kPlanes>;
static_assert(kThreads == kTileN, "one thread loads the scales of one weight row");

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool fill) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ uint32_t bf16x2_bits(const __nv_bfloat162& b) {
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Two E4M3 codes (low byte: the lower k) of one block whose scale value is s (NaN scale:
// nan), as two bf16 (the lower k in the low half): mxfp8_values2's exact values (NaN for a
// NaN code or scale), then the bf16 convert, exact for scale codes >= 3. The slow decode.
__device__ __forceinline__ uint32_t bf16x2_of(uint32_t two, float s, bool nan) {
  const float2 f = detail::mxfp8_values2(two, s, nan, s, nan);
  return bf16x2_bits(__floats2bfloat162_rn(f.x, f.y));
}

// The fast decode of two E4M3 codes (the low 16 bits of two) times the bf16x2 multiplier
// 2^(c - 127) (both halves; kFastScaleMin <= c <= 254): cvt to f16 (exact, NaN kept), to
// float32 and to bf16 (exact: every E4M3 value is a bf16 value), then one bf16x2 multiply,
// exact: the product of a value of at most 4 significant bits and a power of two whose
// result is a normal bf16 or +-Inf (as the float32 product overflows alike) or +-0.
__device__ __forceinline__ uint32_t fast_bf16x2(uint32_t two, uint32_t mult) {
  const float2 f = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3)));
  const __nv_bfloat162 v = __floats2bfloat162_rn(f.x, f.y);
  return bf16x2_bits(__hmul2(v, *reinterpret_cast<const __nv_bfloat162*>(&mult)));
}

// Whether one of the 16 codes of v, with scale value s, is not a bf16 value (the check of
// moe_ep_dequantize_bf16: the low 16 bits of the float32 value).
__device__ __forceinline__ bool any_inexact(const uint4& v, float s) {
  bool inexact = false;
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = detail::mxfp8_values2(words[i] & 0xFFFFu, s, false, s, false);
    const float2 b = detail::mxfp8_values2(words[i] >> 16, s, false, s, false);
    (void)detail::bf16_exact_bits(a.x, inexact);
    (void)detail::bf16_exact_bits(a.y, inexact);
    (void)detail::bf16_exact_bits(b.x, inexact);
    (void)detail::bf16_exact_bits(b.y, inexact);
  }
  return inexact;
}

// Whether every scale code of a thread's stage (the 8 of its weight rows and k quads, scw)
// takes the fast decode (kFastScaleMin..254). When it holds for every lane of the warp, the
// stage runs stage_slice<kNt, true>, which has no slow decode in its code.
__device__ __forceinline__ bool stage_all_fast(const uint32_t (&scw)[4], int q) {
  bool fast = true;
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t sc = (scw[t] >> (8 * (2 * h + (q >> 1)))) & 0xFFu;
      fast &= sc - kFastScaleMin <= 254u - kFastScaleMin;
    }
  return fast;
}

// The 16 codes of v (one lane's share of a weight row in a 64-slice) with scale code sc as
// 8 bf16x2 MMA operands, b[2 j], b[2 j + 1] those of k16 step j (codes 4 j .. 4 j + 3).
// kFast: sc is known to be in kFastScaleMin..254. Otherwise scale codes below kFastScaleMin
// or 0xFF (NaN) take the slow decode; below 3, a value bf16 cannot hold turns the 16 values
// into NaN and sets bad.
template <bool kFast>
__device__ __forceinline__ void decode16(const uint4& v, uint32_t sc, uint32_t (&b)[8], bool& bad) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  if (kFast || sc - kFastScaleMin <= 254u - kFastScaleMin) {
    const uint32_t mult = (sc << 7) * 0x10001u;  // bf16 2^(sc - 127) in both halves
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      b[2 * j] = fast_bf16x2(words[j], mult);
      b[2 * j + 1] = fast_bf16x2(words[j] >> 16, mult);
    }
    return;
  }
  const float s = detail::exp2_exact(static_cast<int>(sc) - 127);
  bool nan = sc == 0xFFu;
  if (sc < 3u && any_inexact(v, s)) {  // values below bf16's subnormal grid
    nan = true;
    bad = true;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    b[2 * j] = bf16x2_of(words[j] & 0xFFFFu, s, nan);
    b[2 * j + 1] = bf16x2_of(words[j] >> 16, s, nan);
  }
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A pass's sums into y (float32, += with accumulate) or y_bf16 (their bf16 rounding): the
// rows [m0, min(m0 + 8 kNt, r1)) at the warp's 32 weight rows from nw. acc[u][nt] holds
// y[x row 8 nt + 2 q (+1)] at weight rows 16 u + g (c0, c1) and 16 u + 8 + g (c2, c3).
// P: Mxfp8WeightsGemm or Nvfp4WeightsGemm (y, y_bf16, accumulate, n).
template <int kNt, class P>
__device__ __forceinline__ void store_pass(const P& p, const float (&acc)[2][kNt][4], int64_t m0, int64_t r1,
                                           int64_t nw, int g, int q) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t r = m0 + 8 * nt + 2 * q + (c & 1);
      if (r >= r1) continue;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int64_t at = r * p.n + nw + 16 * u + 8 * (c >> 1) + g;
        float v = acc[u][nt][c];
        if (p.y_bf16 != nullptr) {
          p.y_bf16[at] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
          continue;
        }
        if (p.accumulate) v += p.y[at];
        p.y[at] = v;
      }
    }
}

// The passes over an expert's rows [r0, r1): each takes as many n8 tiles as the remaining
// rows need, up to kMaxNt (4, 6 or 8): run(std::integral_constant<int, tiles>, m0).
template <int kMaxNt, class Run>
__device__ __forceinline__ void for_each_pass(int64_t r0, int64_t r1, Run&& run) {
  static_assert(kMaxNt == 4 || kMaxNt == 6 || kMaxNt == 8, "the passes below");
  for (int64_t m0 = r0; m0 < r1;) {
    const int64_t rem = r1 - m0;
    const int tiles = rem >= 8 * kMaxNt ? kMaxNt : static_cast<int>((rem + 7) / 8);
    if constexpr (kMaxNt >= 8) {
      if (tiles == 8) run(std::integral_constant<int, 8>{}, m0);
      if (tiles == 7) run(std::integral_constant<int, 7>{}, m0);
    }
    if constexpr (kMaxNt >= 6) {
      if (tiles == 6) run(std::integral_constant<int, 6>{}, m0);
      if (tiles == 5) run(std::integral_constant<int, 5>{}, m0);
    }
    if (tiles == 4) run(std::integral_constant<int, 4>{}, m0);
    if (tiles == 3) run(std::integral_constant<int, 3>{}, m0);
    if (tiles == 2) run(std::integral_constant<int, 2>{}, m0);
    if (tiles == 1) run(std::integral_constant<int, 1>{}, m0);
    m0 += 8 * tiles;
  }
}

// A pass's x rows, stage after stage (k from ks * kStageK, ks = 0, 1, ... in order): kRows
// rows from m0, those at or past r1 zero-filled, each of kPlanes planes. A thread's chunks
// are rows tid / 16 + 8 u at chunk tid % 16 (stored at chunk(tid % 16) of the shared row).
// It keeps its first chunk's source and steps it by a stage a load, so a stage's loads cost
// the cp.async and a few adds (the index arithmetic, recomputed a stage, was a fifth of the
// block-scaled-weights kernels' instructions). Shared by both formats' loaders.
template <int kRows>
struct XRowsLoader {
  static constexpr int kXChunks = kStageK / 8;  // 16-byte chunks an x row
  static constexpr int kRounds = kRows * kXChunks / kThreads;
  static_assert(kRows * kXChunks % kThreads == 0, "whole rounds of x chunks");
  const uint16_t* x;  // the first chunk of the next stage (plane 0; row m0 + tid / 16, or m0 past r1)
  int in_rounds;      // the rounds u whose row m0 + tid / 16 + 8 u is below r1: u < in_rounds

  __device__ __forceinline__ XRowsLoader(const uint16_t* x0, int64_t K, int64_t m0, int64_t r1) {
    const int tid = static_cast<int>(threadIdx.x);
    const int64_t xr = m0 + tid / kXChunks, rows_in = r1 - xr;  // rows xr, xr + 8, ... below r1
    x = x0 + (rows_in > 0 ? xr : m0) * K + 8 * (tid % kXChunks);
    in_rounds = rows_in <= 0 ? 0 : rows_in >= 8 * kRounds ? kRounds : static_cast<int>((rows_in + 7) / 8);
  }

  template <int kMaxRows, int kPlanes, class Chunk>
  __device__ __forceinline__ void load(uint16_t (&dst)[kPlanes][kMaxRows][kXStride], int64_t K,
                                       int64_t plane_stride, Chunk chunk) {
    const int tid = static_cast<int>(threadIdx.x);
    const int xr = tid / kXChunks, xc = 8 * chunk(tid % kXChunks);
#pragma unroll
    for (int pl = 0; pl < kPlanes; ++pl) {
      const uint16_t* xu = x + pl * plane_stride;
#pragma unroll
      for (int u = 0; u < kRounds; ++u, xu += (kThreads / kXChunks) * K) {
        const bool in = u < in_rounds;
        // Past r1: no byte read (src-size 0), the address x's row m0.
        cp_async16(&dst[pl][xr + u * (kThreads / kXChunks)][xc], in ? xu : x, in);
      }
    }
    x += kStageK;
  }
};

// A pass's loads, stage after stage: the block's weight rows (a thread's code chunks rows
// tid / 8 + 16 u at chunk tid % 8, its scale row tid) and the pass's kRows x rows from m0.
template <int kRows, int kMaxRows, int kPlanes>
struct Loader {
  static constexpr int kChunks = kStageK / 16;  // 16-byte code chunks a weight row
  const Mxfp8WeightsGemm& p;
  const uint8_t* w;  // the thread's first code chunk of the next stage
  const uint8_t* s;  // its scale row's 4 codes of the next stage
  XRowsLoader<kRows> xl;

  __device__ __forceinline__ Loader(const Mxfp8WeightsGemm& p_, int e, int64_t nb, int64_t m0, int64_t r1)
      : p(p_), xl(p_.x, p_.k, m0, r1) {
    const int tid = static_cast<int>(threadIdx.x);
    w = p.codes + (static_cast<int64_t>(e) * p.n + nb + tid / kChunks) * p.k + 16 * (tid % kChunks);
    s = p.scales + (static_cast<int64_t>(e) * p.n + nb + tid) * (p.k / 32);
  }

  __device__ __forceinline__ void load(Stage<kMaxRows, kPlanes>& st) {
    const int tid = static_cast<int>(threadIdx.x);
    const int r = tid / kChunks, c = tid % kChunks;
    const int cs = c ^ ((r & 1) << 2);  // the row parity is the same for rows r + 16 u
#pragma unroll
    for (int u = 0; u < kTileN * kChunks / kThreads; ++u)
      cp_async16(&st.w[r + u * (kThreads / kChunks)][cs], w + u * (kThreads / kChunks) * p.k, true);
    cp_async4(&st.s[tid], s);
    xl.load(st.x, p.k, p.x_plane_stride, [](int c) { return c; });
    w += kStageK;
    s += kStageK / 32;
  }
};

// One 64-slice h of a stage for one warp: its 32 weight rows' codes decoded (decode16<kFast>)
// into two m16 A tiles, multiplied with the pass's kNt n8 B tiles of x rows into acc. A
// tile u's rows g and g + 8 are the warp's weight rows 16 u + g and 16 u + 8 + g (b[2 u] and
// b[2 u + 1], decoded alike as rows 8 t + g).
// With kPlanes x planes each plane's tiles are multiplied in turn into the same acc.
template <int kNt, bool kFast, int kMaxRows, int kPlanes>
__device__ __forceinline__ void stage_slice(const Stage<kMaxRows, kPlanes>& st, const uint32_t (&scw)[4], int h,
                                            int warp, int g, int q, float (&acc)[2][kNt][4], bool& bad) {
  uint32_t b[4][8];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int r = warp * kRowsPerWarp + 8 * t + g;
    const uint4 w = st.w[r][(4 * h + q) ^ ((r & 1) << 2)];
    decode16<kFast>(w, (scw[t] >> (8 * (2 * h + (q >> 1)))) & 0xFFu, b[t], bad);
  }
#pragma unroll
  for (int jj = 0; jj < 2 * kPlanes; ++jj) {
    const int pl = jj / 2;
    uint4 xb[kNt];  // row g of each n8 tile: the columns of steps 2 (jj % 2) and 2 (jj % 2) + 1
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
      xb[nt] = *reinterpret_cast<const uint4*>(&st.x[pl][8 * nt + g][64 * h + 16 * q + 8 * (jj % 2)]);
#pragma unroll
    for (int j2 = 0; j2 < 2; ++j2) {
      const int j = 2 * (jj % 2) + j2;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          // A: a0 row g, logical k 2q, 2q + 1; a1 row g + 8; a2, a3 logical k 2q + 8, 2q + 9.
          // B: b0 x row g, logical k 2q, 2q + 1; b1 logical k 2q + 8, 2q + 9.
          const uint32_t b0 = j2 ? xb[nt].z : xb[nt].x, b1 = j2 ? xb[nt].w : xb[nt].y;
          mma_bf16(acc[u][nt], b[2 * u][2 * j], b[2 * u + 1][2 * j], b[2 * u][2 * j + 1], b[2 * u + 1][2 * j + 1], b0,
                   b1);
        }
      }
    }
  }
}

// The mxfp8 weights' side of the pipeline (run_pass, run_block): a stage's type, its loads
// and its MMAs, and the inexact report.
struct Mxfp8Format {
  using Params = Mxfp8WeightsGemm;
  static constexpr int kStageK = mxw::kStageK;
  static constexpr uintptr_t kScaleAlign = 4;  // the scales' cp.async of 4 bytes
  template <class Cfg>
  using StageT = StageOf<Cfg>;
  // A pass's loads, stage after stage (made once a pass, then load(stage) for ks = 0, 1, ...
  // in order).
  template <int kRows, class Cfg>
  using Loader = mxw::Loader<kRows, Cfg::kMaxRows, Cfg::kPlanes>;
  template <int kNt, class Cfg>
  static __device__ __forceinline__ void compute(const StageT<Cfg>& st, int warp, int g, int q,
                                                 float (&acc)[2][kNt][4], bool& bad) {
    uint32_t scw[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) scw[t] = st.s[warp * kRowsPerWarp + 8 * t + g];
    // The common case, every scale code of the stage on the fast decode, has its own copy of
    // the stage with no slow decode in it: compact code (instruction-cache misses were a
    // fifth of the stalls with the slow decode inlined at each decode, run 39).
    // Warp-uniform (the MMAs are .aligned: every lane of a warp runs the same one).
    if (__all_sync(0xFFFFFFFFu, stage_all_fast(scw, q))) {
#pragma unroll
      for (int h = 0; h < 2; ++h) stage_slice<kNt, true>(st, scw, h, warp, g, q, acc, bad);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) stage_slice<kNt, false>(st, scw, h, warp, g, q, acc, bad);
    }
  }
  static __device__ __forceinline__ void report(const Params& p, bool bad) {
    if (bad && p.inexact != nullptr) atomicOr(p.inexact, 1);
  }
};

// One pass over K for the rows [m0, min(m0 + 8 kNt, r1)) of expert e and the block's
// weight rows from nb (this warp's 32 of them from nb + 32 warp), Fmt's stages streamed
// through a cp.async pipeline Cfg::kStages deep. acc[u][nt] holds y[x row 8 nt + 2 q (+1)]
// at weight rows 16 u + g (c0, c1) and 16 u + 8 + g (c2, c3).
template <int kNt, class Cfg, class Fmt>
__device__ __forceinline__ void run_pass(const typename Fmt::Params& p, typename Fmt::template StageT<Cfg>* stages,
                                         int e, int64_t nb, int64_t m0, int64_t r1) {
  constexpr int kStages = Cfg::kStages;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int64_t nks = p.k / Fmt::kStageK;
  float acc[2][kNt][4];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[u][nt][c] = 0.0f;
  typename Fmt::template Loader<8 * kNt, Cfg> loader(p, e, nb, m0, r1);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nks) loader.load(stages[s]);
    cp_async_commit();
  }
  bool bad = false;
  for (int64_t ks = 0; ks < nks; ++ks) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage ks landed for every thread; stage ks - 1's buffer is free
    const int64_t next = ks + kStages - 1;
    if (next < nks) loader.load(stages[next % kStages]);
    cp_async_commit();
    Fmt::template compute<kNt, Cfg>(stages[ks % kStages], warp, g, q, acc, bad);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp done with the buffers before the next pass refills them
  Fmt::report(p, bad);
  store_pass<kNt>(p, acc, m0, r1, nb + warp * kRowsPerWarp, g, q);
}

// A block's work: weight rows [nb, nb + kTileN) of expert e = blockIdx.y, nb = blockIdx.x
// kTileN, over the expert's rows in passes of up to Cfg::kMaxNt n8 tiles.
template <class Cfg, class Fmt>
__device__ __forceinline__ void run_block(const typename Fmt::Params& p, unsigned char* smem) {
  using StageT = typename Fmt::template StageT<Cfg>;
  StageT* stages = reinterpret_cast<StageT*>(smem);
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  const int e = static_cast<int>(blockIdx.y);
  int64_t r0, r1;
  if (p.group_sizes != nullptr) {  // min(prefix sum, total_rows): the clamped running sum
    int64_t sum = 0;
    for (int i = 0; i < e; ++i) sum += max(p.group_sizes[i], 0);
    r0 = min(sum, p.total_rows);
    r1 = min(sum + max(p.group_sizes[e], 0), p.total_rows);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      if (e == 0) p.off_out[0] = 0;
      p.off_out[e + 1] = static_cast<int32_t>(r1);
    }
  } else {
    r0 = p.off[e];
    r1 = p.off[e + 1];
  }
  const int64_t nb = static_cast<int64_t>(blockIdx.x) * kTileN;
  for_each_pass<Cfg::kMaxNt>(
      r0, r1, [&](auto tiles, int64_t m0) { run_pass<decltype(tiles)::value, Cfg, Fmt>(p, stages, e, nb, m0, r1); });
}

// Grid (N / kTileN, E), kThreads threads, Cfg::kStages stages of dynamic shared memory
// (mxw::coded_gemm_launch).
// Lane = 4 g + q: g picks the row of an n8 tile (or of an m16 tile's halves), q the quad of
// k. Each pass takes as many n8 tiles as the expert's remaining rows need, up to
// Cfg::kMaxNt.
template <class Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) mxfp8_weights_gemm_kernel(Mxfp8WeightsGemm p) {
  extern __shared__ __align__(16) unsigned char smem[];
  run_block<Cfg, Mxfp8Format>(p, smem);
}

}  // namespace mxw

// Whether the block-scaled-weights kernels take an [E, n, k] weight: k a multiple of the
// stage's 128, n of the block's 128 rows.
inline bool mxfp8_weights_shape_fits(int64_t n, int64_t k) {
  return k > 0 && k % mxw::kStageK == 0 && n > 0 && n % mxw::kTileN == 0;
}

namespace mxw {

// Whether a kernel of format Fmt takes p: its shape (mxfp8_weights_shape_fits); codes and x
// 16-byte aligned, scales Fmt::kScaleAlign-byte aligned, y 8-byte (y_bf16 4-byte) aligned;
// no accumulation into bf16 output; three x planes only into float32 y.
template <class Fmt>
inline bool coded_gemm_fits(const typename Fmt::Params& p) {
  const uintptr_t a16 = reinterpret_cast<uintptr_t>(p.codes) | reinterpret_cast<uintptr_t>(p.x);
  const bool out_ok = p.y_bf16 != nullptr ? (reinterpret_cast<uintptr_t>(p.y_bf16) % 4 == 0 && !p.accumulate)
                                          : reinterpret_cast<uintptr_t>(p.y) % 8 == 0;
  const bool planes_ok = p.x_planes == 0 || p.x_planes == 1 ||
                         (p.x_planes == 3 && p.y_bf16 == nullptr && p.x_plane_stride % 8 == 0);
  const bool sizes_ok = p.group_sizes == nullptr ? p.off != nullptr
                                                  : p.off_out != nullptr && p.total_rows > 0 && p.num_experts <= 1024;
  return mxfp8_weights_shape_fits(p.n, p.k) && a16 % 16 == 0 && planes_ok && sizes_ok &&
         reinterpret_cast<uintptr_t>(p.scales) % Fmt::kScaleAlign == 0 && out_ok && p.num_experts > 0 &&
         p.num_experts <= 65535;
}

// One launch of kernel (Fmt's kernel for Cfg): grid (N / kTileN, E), kThreads threads, Cfg's
// stages of dynamic shared memory.
template <class Fmt, class Cfg>
inline cudaError_t coded_gemm_launch(const typename Fmt::Params& p, cudaStream_t stream,
                                     void (*kernel)(typename Fmt::Params)) {
  if (!coded_gemm_fits<Fmt>(p) || (p.x_planes == 3) != (Cfg::kPlanes == 3)) return cudaErrorInvalidValue;
  constexpr size_t smem = sizeof(typename Fmt::template StageT<Cfg>) * Cfg::kStages;
  // Per device and cheap; not a stream operation, so allowed inside a CUDA-graph capture.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.n / kTileN), static_cast<unsigned>(p.num_experts));
  const cudaError_t launched = launch_pdl(kernel, grid, kThreads, smem, stream, p);
  return launched != cudaSuccess ? launched : cudaGetLastError();
}

// Whether p's rows an expert on average (total_rows / num_experts, read on the host; unknown
// counts as many) are at most kFewRowsPerExpert: the launches' few-rows variants, and three x
// planes in one pass. P: Mxfp8WeightsGemm or Nvfp4WeightsGemm.
template <class P>
inline bool few_rows(const P& p) {
  return p.total_rows > 0 && p.total_rows <= kFewRowsPerExpert * static_cast<int64_t>(p.num_experts);
}

}  // namespace mxw

// Whether the kernel takes p (mxw::coded_gemm_fits: scales 4-byte aligned).
inline bool mxfp8_weights_gemm_fits(const Mxfp8WeightsGemm& p) { return mxw::coded_gemm_fits<mxw::Mxfp8Format>(p); }

// One variant's launch (mxfp8_weights_gemm picks one; moe_ep_gemm_check times them all).
template <class Cfg>
inline cudaError_t mxfp8_weights_gemm_launch(const Mxfp8WeightsGemm& p, cudaStream_t stream) {
  return mxw::coded_gemm_launch<mxw::Mxfp8Format, Cfg>(p, stream, mxw::mxfp8_weights_gemm_kernel<Cfg>);
}

inline cudaError_t mxfp8_weights_gemm(const Mxfp8WeightsGemm& p, cudaStream_t stream);

// p's x planes as a launch a plane (x_planes 1, the later ones accumulating): what
// mxfp8_weights_gemm runs for three planes at more rows (moe_ep_gemm_check times it against
// the one-pass kernel at few rows).
inline cudaError_t mxfp8_weights_gemm_plane_by_plane(const Mxfp8WeightsGemm& p, cudaStream_t stream) {
  Mxfp8WeightsGemm one = p;
  one.x_planes = 1;
  for (int pl = 0; pl < (p.x_planes > 1 ? p.x_planes : 1); ++pl) {
    one.x = p.x + pl * p.x_plane_stride;
    one.accumulate = p.accumulate || pl > 0;
    const cudaError_t err = mxfp8_weights_gemm(one, stream);
    if (err != cudaSuccess) return err;
    if (one.group_sizes != nullptr) {  // the first launch made the offsets
      one.off = one.off_out;
      one.group_sizes = nullptr;
    }
  }
  return cudaSuccess;
}

// The launch: the variant for p's rows an expert on average (total_rows / num_experts, on
// the host; unknown counts as many) and its K, or passes of 32 rows; three x planes in one
// pass at few rows, else a launch a plane.
inline cudaError_t mxfp8_weights_gemm(const Mxfp8WeightsGemm& p, cudaStream_t stream) {
  const bool few = mxw::few_rows(p);
  if (p.x_planes == 3) {
    if (!mxfp8_weights_gemm_fits(p)) return cudaErrorInvalidValue;
    if (few && !p.passes_of_32) return mxfp8_weights_gemm_launch<mxw::Planes3Config>(p, stream);
    return mxfp8_weights_gemm_plane_by_plane(p, stream);
  }
  if (p.passes_of_32) return mxfp8_weights_gemm_launch<mxw::Passes32Config>(p, stream);
  if (!few) return mxfp8_weights_gemm_launch<mxw::DefaultConfig>(p, stream);
  return p.k >= mxw::kLongK ? mxfp8_weights_gemm_launch<mxw::FewRowsLongKConfig>(p, stream)
                            : mxfp8_weights_gemm_launch<mxw::FewRowsConfig>(p, stream);
}

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_GEMM_CUH_
