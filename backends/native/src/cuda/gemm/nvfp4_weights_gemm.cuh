// A grouped GEMM for few rows per expert that reads nvfp4 weights as they are stored:
// y[r, n] = sum_k x[r, k] * W_e[n, k] for the rows r of expert e (off[e] <= r < off[e + 1]),
// with W_e[n, k] = E2M1(codes[e, n, k]) * E4M3(scales[e, n, k / 16]) decoded to bf16 in
// registers and multiplied on the tensor cores (mma.sync m16n8k16, bf16 in, float32
// accumulation). The weights are read once per pass of up to 64 rows of an expert (48 with
// three x planes), at half a byte an element plus a scale byte per 16 (a quarter of a kept
// bf16 decode's bytes, 0.28 with the scales): the decode forward's weight read
// (docs/cuda-nccl.md, "The block-scaled-weights forward"). The layer's forward with nvfp4
// weights (moe_ep_layer_experts_forward_block_scaled) runs its FC1 and FC2 through it. The
// pipeline, the passes and the outputs are the mxfp8-weights GEMM's (mxfp8_weights_gemm.cuh:
// run_block with Nvfp4Format); this file is the nvfp4 side: the stage, its loads and its MMAs.
//
// Layouts: x [C, K] bf16 row-major, or three such planes summed (x_planes: FC2's exact bf16
// pieces of a float32 operand); codes [E, N, K / 2] (two codes a byte, element 2 j in the
// low nibble of byte j) and scales [E, N, K / 16] (the transposed block-scaled weight,
// blocked along K); y [C, N] float32 or y_bf16 [C, N] bf16 row-major (rows past off[E]
// untouched). Needs K % 128 == 0 and N % 128 == 0 (nvfp4_weights_gemm_fits).
//
// Exact decode, always (every E2M1 x E4M3 product has at most 6 significant bits and lies in
// [2^-10, 2688] or is zero: a bf16 value). A pair of codes becomes a bf16x2 by bit moves:
// the sign to bit 15, the 3 magnitude bits to bits 8..6, which reads as E2M1 * 2^-126 (the
// E2M1 subnormal 0.5 as the bf16 subnormal 2^-127); one bf16x2 multiply by s 2^126 makes
// E2M1 * s (exact: the products are bf16 values, the subnormal operand is kept). Fast (every
// scale of the warp's stage below 2 in magnitude: codes 0x00..0x3F, 0x80..0xBF, so s 2^126 is
// a bf16 value): that one multiply. Otherwise (a scale of 2 or more, or NaN: 0x7F / 0xFF,
// the whole stage of the warp, warp-uniform): times 2^126, then times s. A NaN scale gives
// NaN (NaN times anything), as moe_ep_dequantize_bf16 gives.
//
// The stage: 128 weight rows x 128 k (64 bytes of codes a row, unswizzled: a quarter warp's
// 16-byte reads cover 128 distinct bytes), 8 scale bytes a row, and the pass's x rows (136
// bf16 a row, 272 bytes; the 16-byte chunk c of a row stored at c ^ 2 for c >= 8, so a
// quarter warp's x reads fall in distinct banks). The sum over k is permuted alike for both
// operands: lane quad q holds the 32 codes [32 q, 32 q + 32) of its weight row (one 16-byte
// shared load: words w = 0..3 of 8 codes, half h of the stage its words 2 h and 2 h + 1, one
// scale block), and a word's byte j, codes (c_2j, c_2j+1), is one bf16x2 A register: bytes
// 0, 1 the MMA's logical columns {2 q, 2 q + 1} and {2 q + 8, 2 q + 9} of one k16 step,
// bytes 2, 3 those of the next. The x fragments are then the x words at the same physical
// columns as they lie in shared memory (no permute): word j of the row's 16-byte chunk.
// The bit moves of byte j (raw_pair): one byte permute (with prmt's sign replication), a
// shift and a mask, then the bf16x2 multiply.
//
// The loads: a pass's thread keeps its source pointers (its 4 code chunks' first row, its
// scale row, its x chunks' first row) and steps them by a stage's bytes a load, so a stage's
// loads cost the cp.async and a few adds (the index arithmetic was a fifth of the kernel's
// instructions when recomputed a stage).
#ifndef MOE_EP_NATIVE_CUDA_GEMM_NVFP4_WEIGHTS_GEMM_CUH_
#define MOE_EP_NATIVE_CUDA_GEMM_NVFP4_WEIGHTS_GEMM_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm/mxfp8_weights_gemm.cuh"

namespace moe_ep {
namespace cuda {

struct Nvfp4WeightsGemm {
  const uint16_t* x;      // [C, K] bf16
  const int32_t* off;     // [E + 1] row offsets of the experts (device)
  const uint8_t* codes;   // [E, N, K / 2] E2M1 pairs
  const uint8_t* scales;  // [E, N, K / 16] E4M3
  int num_experts;
  int64_t n, k;
  float* y;             // [C, N] float32 out (when y_bf16 is NULL)
  uint16_t* y_bf16;     // [C, N] bf16 out (the bf16 rounding of the sums), or NULL
  bool accumulate;      // y += instead of y = (float32 output only)
  // Rows of x (an upper bound on off[E], read on the host): picks the kernel variant by the
  // rows an expert on average (nvfp4_weights_gemm), as Mxfp8WeightsGemm::total_rows. 0: unknown.
  int64_t total_rows;
  // x as x_planes bf16 planes (0 or 1: one; 3: the exact bf16 pieces of a float32 operand,
  // plane p at x + p * x_plane_stride elements), summed: y = sum_p x_p W (float32 y only).
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

namespace nvw {

using mxw::kRowsPerWarp;
using mxw::kThreads;
using mxw::kTileN;
constexpr int kStageK = 128;           // k a stage: 64 bytes of codes a weight row
constexpr int kXStride = kStageK + 8;  // bf16 a shared x row: 272 bytes (see the header)
static_assert(kStageK == mxw::kStageK && kXStride == mxw::kXStride, "the x rows load as mxw::XRowsLoader's");

// Where the 16-byte chunk c (0..15) of an x row lies in the stage (see the header).
__device__ __forceinline__ int x_chunk(int c) { return c ^ (((c >> 3) & 1) << 1); }

template <int kMaxRows, int kPlanes>
struct Stage {
  uint4 w[kTileN][kStageK / 32];            // codes: 16 bytes (32 codes) a chunk, 4 a row
  uint2 s[kTileN];                          // 8 scale codes a row
  uint16_t x[kPlanes][kMaxRows][kXStride];  // x rows, each plane's
};
template <class Cfg>
using StageOf = Stage<Cfg::kMaxRows, Cfg::kPlanes>;

// The variants nvfp4_weights_gemm picks (moe_ep_gemm_check --nvfp4-weights and
// --nvfp4-weights-sweep on an H100, the decode's FC1 and FC2 at 32 rows an expert and with the
// routing's spread of 20..42, rounded up to 16 as the layer gets them or not;
// docs/results/h100/gemm-check-nvfp4-weights*.txt):
// - one x plane, at most mxw::kFewRowsPerExpert rows an expert on average and a short K (FC2,
//   below mxw::kLongK): passes of up to 48 rows, 2 stages, 3 blocks an SM (164 registers, no
//   spill). 2026-12-07 (e19e70c) at the spread rounded up to 16: FC2 0.162 ms, as <6,2,2>,
//   against 0.168 for DefaultConfig;
using FewRowsConfig = mxw::Config<6, 2, 3>;
// - more rows, or a long K (FC1) at few rows: passes of up to 64 rows, 3 stages, 2 blocks an
//   SM (195 registers). 2026-12-07 (e19e70c) at the spread rounded up to 16: FC1 0.310 ms
//   against 0.319 for <6,4,2> and 0.334 for FewRowsConfig (before its 3-instruction decode,
//   with 12 warps an SM FewRowsConfig was the fastest at FC1: the issue bound then hid the
//   pipeline's depth).
using DefaultConfig = mxw::Config<8, 3, 2>;
// - three x planes at few rows, passes of up to 48 rows. More rows: a plane a launch.
using Planes3Config = mxw::Config<6, 2, 2, 3>;

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(d), "l"(src));
}

// A pass's loads: stage after stage (k from ks * kStageK, ks = 0, 1, ... in order) of the
// block's weight rows and of the pass's kRows x rows from m0 (rows at or past r1
// zero-filled). A thread's code chunks are rows tid / 4 + 32 u at chunk tid % 4, its scale
// row tid, its x chunks rows tid / 16 + 8 u at chunk tid % 16, each plane's.
template <int kRows, int kMaxRows, int kPlanes>
struct Loader {
  static constexpr int kChunks = kStageK / 32;  // 16-byte code chunks a weight row
  const Nvfp4WeightsGemm& p;
  const uint8_t* w;  // the thread's first code chunk of the next stage
  const uint8_t* s;  // its scale row's 8 codes of the next stage
  mxw::XRowsLoader<kRows> xl;

  __device__ __forceinline__ Loader(const Nvfp4WeightsGemm& p_, int e, int64_t nb, int64_t m0, int64_t r1)
      : p(p_), xl(p_.x, p_.k, m0, r1) {
    const int tid = static_cast<int>(threadIdx.x);
    w = p.codes + (static_cast<int64_t>(e) * p.n + nb + tid / kChunks) * (p.k / 2) + 16 * (tid % kChunks);
    s = p.scales + (static_cast<int64_t>(e) * p.n + nb + tid) * (p.k / 16);
  }

  __device__ __forceinline__ void load(Stage<kMaxRows, kPlanes>& st) {
    const int tid = static_cast<int>(threadIdx.x);
    const int r = tid / kChunks, c = tid % kChunks;
#pragma unroll
    for (int u = 0; u < kTileN * kChunks / kThreads; ++u)
      mxw::cp_async16(&st.w[r + u * (kThreads / kChunks)][c], w + u * (kThreads / kChunks) * (p.k / 2), true);
    cp_async8(&st.s[tid], s);
    xl.load(st.x, p.k, p.x_plane_stride, [](int c) { return x_chunk(c); });
    w += kStageK / 2;
    s += kStageK / 16;
  }
};

// The bf16x2 multipliers of the two scale codes of sc2 (low byte: m[0]), each in both
// halves: fast, s 2^126 (|s| < 2: a bf16 value); otherwise s itself (the decode multiplies
// by 2^126, kTwo126, first).
constexpr uint32_t kTwo126 = 0x7E807E80u;  // bf16 2^126 in both halves
template <bool kFast>
__device__ __forceinline__ void scale_mults(uint32_t sc2, uint32_t (&m)[2]) {
  // E4M3 -> f16 (exact, NaN kept) -> float32, times 2^126 (exact: |s 2^126| < 2^127), -> bf16 (exact).
  float2 s = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(sc2 & 0xFFFFu), __NV_E4M3)));
  if (kFast) s.x *= 8.507059173023462e37f, s.y *= 8.507059173023462e37f;
  const uint32_t b = mxw::bf16x2_bits(__floats2bfloat162_rn(s.x, s.y));
  m[0] = __byte_perm(b, 0, 0x1010);
  m[1] = __byte_perm(b, 0, 0x3232);
}

// Whether every scale code of the lane's stage (the 2 of each of its 4 weight rows that its
// chunk covers) is below 2 in magnitude (0x00..0x3F, 0x80..0xBF).
__device__ __forceinline__ bool stage_all_fast(const uint32_t (&sc2)[4]) {
  uint32_t any = 0;
#pragma unroll
  for (int t = 0; t < 4; ++t) any |= sc2[t];
  return (any & 0x4040u) == 0;
}

// Byte j of the word w, codes (c_2j, c_2j+1), as bf16x2 E2M1 * 2^-126 (c_2j in the low
// half), three instructions. w4 = w << 4 holds c_2j in the top nibble of its byte j, w holds
// c_2j+1 in the top nibble of its byte j. One byte permute makes v: byte 0 w4's byte j,
// byte 1 its sign bit replicated (prmt's sign mode), bytes 2, 3 the same of w's byte j; then
// v << 2 has each code's sign at bits 15 / 31 (from the replicated bytes) and its magnitude
// at 8..6 / 24..22, and the mask keeps those bits alone.
template <int kJ>
__device__ __forceinline__ uint32_t raw_pair(uint32_t w, uint32_t w4) {
  constexpr uint32_t kSel = kJ | ((kJ | 8) << 4) | ((4 + kJ) << 8) | ((12 + kJ) << 12);
  uint32_t v;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v) : "r"(w4), "r"(w), "n"(kSel));
  return (v << 2) & 0x81C081C0u;
}

// The 8 codes of the word w with multiplier m (scale_mults<kFast>) as 4 bf16x2 MMA operands:
// a[j] = (c_2j, c_2j+1).
template <bool kFast>
__device__ __forceinline__ void decode8(uint32_t w, uint32_t m, uint32_t (&a)[4]) {
  const uint32_t w4 = w << 4;
  uint32_t raw[4] = {raw_pair<0>(w, w4), raw_pair<1>(w, w4), raw_pair<2>(w, w4), raw_pair<3>(w, w4)};
  const __nv_bfloat162 mult = *reinterpret_cast<const __nv_bfloat162*>(&m);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
    if (!kFast) {
      const uint32_t two126 = kTwo126;
      v = __hmul2(v, *reinterpret_cast<const __nv_bfloat162*>(&two126));
    }
    a[i] = mxw::bf16x2_bits(__hmul2(v, mult));
  }
}

// Half h (steps 4 h .. 4 h + 3: the lane's words 2 h, 2 h + 1, scale block 2 q + h) of a
// stage for one warp: its 32 weight rows decoded into two m16 A tiles a step, multiplied with
// the pass's kNt n8 B tiles of x rows into acc (tile u: weight rows 16 u + g, 16 u + 8 + g;
// row t of the lane is 8 t + g). wv[t]: row t's chunk; mult[t][h]: its multiplier for half h.
template <int kNt, bool kFast, int kMaxRows, int kPlanes>
__device__ __forceinline__ void stage_half(const Stage<kMaxRows, kPlanes>& st, const uint4 (&wv)[4],
                                           const uint32_t (&mult)[4][2], int h, int g, int q,
                                           float (&acc)[2][kNt][4]) {
#pragma unroll
  for (int jw = 0; jw < 2; ++jw) {
    const int w = 2 * h + jw;  // the word of the lane's chunk
    uint32_t a[4][4];          // row t's (c0, c1), (c2, c3), (c4, c5), (c6, c7)
#pragma unroll
    for (int t = 0; t < 4; ++t) decode8<kFast>(w == 0 ? wv[t].x : w == 1 ? wv[t].y : w == 2 ? wv[t].z : wv[t].w,
                                               mult[t][h], a[t]);
    const int xc = 8 * x_chunk(4 * q + w);
#pragma unroll
    for (int pl = 0; pl < kPlanes; ++pl) {
      uint4 xb[kNt];  // x row g of each n8 tile: the word's 8 columns
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) xb[nt] = *reinterpret_cast<const uint4*>(&st.x[pl][8 * nt + g][xc]);
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          // B: b0 (x c_4jp, x c_4jp+1), b1 (x c_4jp+2, x c_4jp+3): the chunk's words 2 jp, 2 jp + 1.
          const uint32_t b0 = jp ? xb[nt].z : xb[nt].x, b1 = jp ? xb[nt].w : xb[nt].y;
#pragma unroll
          for (int u = 0; u < 2; ++u)
            // A: a0 row g, logical k 2q, 2q + 1; a1 row g + 8; a2, a3 logical k 2q + 8, 2q + 9.
            mxw::mma_bf16(acc[u][nt], a[2 * u][2 * jp], a[2 * u + 1][2 * jp], a[2 * u][2 * jp + 1],
                          a[2 * u + 1][2 * jp + 1], b0, b1);
        }
      }
    }
  }
}

}  // namespace nvw

// The nvfp4 weights' side of the pipeline (mxw::run_pass, mxw::run_block).
struct Nvfp4Format {
  using Params = Nvfp4WeightsGemm;
  static constexpr int kStageK = nvw::kStageK;
  static constexpr uintptr_t kScaleAlign = 8;  // the scales' cp.async of 8 bytes
  template <class Cfg>
  using StageT = nvw::StageOf<Cfg>;
  template <int kRows, class Cfg>
  using Loader = nvw::Loader<kRows, Cfg::kMaxRows, Cfg::kPlanes>;
  template <int kNt, class Cfg>
  static __device__ __forceinline__ void compute(const StageT<Cfg>& st, int warp, int g, int q,
                                                 float (&acc)[2][kNt][4], bool&) {
    uint4 wv[4];
    uint32_t sc2[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int r = warp * mxw::kRowsPerWarp + 8 * t + g;
      wv[t] = st.w[r][q];
      // Scale codes 2 q, 2 q + 1 of the row: the lane's chunk.
      sc2[t] = reinterpret_cast<const uint16_t*>(&st.s[r])[q];
    }
    // Warp-uniform (the MMAs are .aligned): the stage's one-multiply copy when every lane may.
    uint32_t mult[4][2];
    if (__all_sync(0xFFFFFFFFu, nvw::stage_all_fast(sc2))) {
#pragma unroll
      for (int t = 0; t < 4; ++t) nvw::scale_mults<true>(sc2[t], mult[t]);
#pragma unroll
      for (int h = 0; h < 2; ++h) nvw::stage_half<kNt, true>(st, wv, mult, h, g, q, acc);
    } else {
#pragma unroll
      for (int t = 0; t < 4; ++t) nvw::scale_mults<false>(sc2[t], mult[t]);
#pragma unroll
      for (int h = 0; h < 2; ++h) nvw::stage_half<kNt, false>(st, wv, mult, h, g, q, acc);
    }
  }
  static __device__ __forceinline__ void report(const Params&, bool) {}
};

namespace nvw {

// Grid (N / kTileN, E), kThreads threads, Cfg::kStages stages of dynamic shared memory
// (mxw::coded_gemm_launch).
template <class Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) nvfp4_weights_gemm_kernel(Nvfp4WeightsGemm p) {
  extern __shared__ __align__(16) unsigned char smem[];
  mxw::run_block<Cfg, Nvfp4Format>(p, smem);
}

}  // namespace nvw

// Whether the kernel takes p (mxw::coded_gemm_fits: its shape, mxfp8_weights_shape_fits;
// scales 8-byte aligned).
inline bool nvfp4_weights_gemm_fits(const Nvfp4WeightsGemm& p) { return mxw::coded_gemm_fits<Nvfp4Format>(p); }

// One variant's launch (nvfp4_weights_gemm picks one; moe_ep_gemm_check times them all).
template <class Cfg>
inline cudaError_t nvfp4_weights_gemm_launch(const Nvfp4WeightsGemm& p, cudaStream_t stream) {
  return mxw::coded_gemm_launch<Nvfp4Format, Cfg>(p, stream, nvw::nvfp4_weights_gemm_kernel<Cfg>);
}

// The launch: one x plane, FewRowsConfig at few rows (total_rows / num_experts on the host at
// most mxw::kFewRowsPerExpert) and a K below mxw::kLongK, else DefaultConfig; three x planes
// in one pass at few rows, else a launch a plane (DefaultConfig, the later ones accumulating).
inline cudaError_t nvfp4_weights_gemm(const Nvfp4WeightsGemm& p, cudaStream_t stream) {
  const bool few = mxw::few_rows(p);
  if (p.x_planes == 3) {
    if (!nvfp4_weights_gemm_fits(p)) return cudaErrorInvalidValue;
    if (few) return nvfp4_weights_gemm_launch<nvw::Planes3Config>(p, stream);
    Nvfp4WeightsGemm one = p;
    one.x_planes = 1;
    for (int pl = 0; pl < 3; ++pl) {
      one.x = p.x + pl * p.x_plane_stride;
      one.accumulate = p.accumulate || pl > 0;
      const cudaError_t err = nvfp4_weights_gemm_launch<nvw::DefaultConfig>(one, stream);
      if (err != cudaSuccess) return err;
      if (one.group_sizes != nullptr) {  // the first launch made the offsets
        one.off = one.off_out;
        one.group_sizes = nullptr;
      }
    }
    return cudaSuccess;
  }
  if (few && p.k < mxw::kLongK) return nvfp4_weights_gemm_launch<nvw::FewRowsConfig>(p, stream);
  return nvfp4_weights_gemm_launch<nvw::DefaultConfig>(p, stream);
}

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_NVFP4_WEIGHTS_GEMM_CUH_
