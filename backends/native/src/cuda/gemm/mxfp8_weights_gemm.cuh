// A grouped GEMM for few rows per expert that reads mxfp8 weights as they are stored:
// y[r, n] = sum_k x[r, k] * W_e[n, k] for the rows r of expert e (off[e] <= r < off[e + 1]),
// with W_e[n, k] = E4M3(codes[e, n, k]) * 2^(scales[e, n, k / 32] - 127) decoded to bf16 in
// registers and multiplied on the tensor cores (mma.sync m16n8k16, bf16 in, float32
// accumulation). The weights are read once, at one byte an element plus a scale byte per
// 32, instead of the two bytes of a kept bf16 decode: the decode forward's weight read
// (docs/cuda-nccl.md, "What issue 15's decode target needs").
//
// Layouts: x [C, K] bf16 row-major (the expert-major rows); codes [E, N, K] and scales
// [E, N, K / 32] (the transposed block-scaled weight, blocked along K: K-major, what the
// B operand of mma .row.col wants); y [C, N] float32 row-major (rows past off[E] untouched).
// Needs K % 64 == 0 and N % kMxTileN == 0 (mxfp8_weights_gemm_fits).
//
// Exact decode: E4M3 -> f16 (cvt, exact) -> float32, times 2^(c - 127) (exact), then the
// bf16 convert, which rounds nothing for scale codes c >= 3 (docs/cuda-nccl.md, "bf16
// holds the decoded values"); a scale code 0xFF (NaN) or a NaN code gives NaN. A caller
// with scale codes below 3 uses the decode to bf16 instead.
//
// The sum over k is permuted alike for both operands: in each 64-slice, lane quad q holds
// the 16 codes [kb + 16 q, kb + 16 q + 16) of its weight row (one 16-byte load), and the
// k16 step j of the slice takes codes 4 j .. 4 j + 3 of every quad as the logical
// columns {2 q, 2 q + 1, 2 q + 8, 2 q + 9} of the MMA; the x fragments are read at the
// same physical columns (8 bytes a row).
//
// Not used by the layer yet: tools/gemm_check.cu checks and times it.
#ifndef MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_GEMM_CUH_
#define MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_GEMM_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/format_math.cuh"

namespace moe_ep {
namespace cuda {

struct Mxfp8WeightsGemm {
  const uint16_t* x;      // [C, K] bf16
  const int32_t* off;     // [E + 1] row offsets of the experts (device)
  const uint8_t* codes;   // [E, N, K] E4M3
  const uint8_t* scales;  // [E, N, K / 32] E8M0
  int num_experts;
  int64_t n, k;
  float* y;        // [C, N] float32
  bool accumulate;  // y += instead of y =
};

namespace mxw {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 32;               // weight rows a warp: four n8 tiles
constexpr int kTileN = kWarps * kRowsPerWarp;  // weight rows a block
constexpr int kTileM = 32;                     // expert rows a pass: two m16 tiles

// Two E4M3 codes (low byte: the lower k) of one block whose scale value is s (NaN scale:
// nan), as two bf16 (the lower k in the low half): mxfp8_values2's exact values (NaN for a
// NaN code or scale), then the bf16 convert, exact for scale codes >= 3.
__device__ __forceinline__ uint32_t bf16x2_of(uint32_t two, float s, bool nan) {
  const float2 f = detail::mxfp8_values2(two, s, nan, s, nan);
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Grid (N / kTileN, E), kWarps * 32 threads. Lane = 4 g + q: g picks the row of an n8
// (or m8) tile, q the quad of k.
__global__ void __launch_bounds__(kWarps * 32) mxfp8_weights_gemm_kernel(Mxfp8WeightsGemm p) {
  const int e = static_cast<int>(blockIdx.y);
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int64_t r0 = p.off[e], r1 = p.off[e + 1];
  if (r0 >= r1) return;
  const int64_t K = p.k, kb32 = K / 32;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileN + warp * kRowsPerWarp;  // this warp's rows
  const uint8_t* wrow[4];
  const uint8_t* srow[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int64_t n = n0 + 8 * t + g;
    wrow[t] = p.codes + (static_cast<int64_t>(e) * p.n + n) * K + 16 * q;
    srow[t] = p.scales + (static_cast<int64_t>(e) * p.n + n) * kb32 + q / 2;
  }
  for (int64_t m0 = r0; m0 < r1; m0 += kTileM) {
    // x rows of this lane: m0 + 16 mt + g and + 8 (zero past the expert's last row).
    const uint16_t* xrow[2][2];
    bool xin[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r = m0 + 16 * mt + 8 * h + g;
        xin[mt][h] = r < r1;
        xrow[mt][h] = p.x + (xin[mt][h] ? r : r0) * K + 16 * q;
      }
    float acc[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mt][t][c] = 0.0f;
    uint4 w[4];
    uint32_t sc[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      w[t] = __ldg(reinterpret_cast<const uint4*>(wrow[t]));
      sc[t] = __ldg(srow[t]);
    }
    for (int64_t kb = 0; kb < K; kb += 64) {
      // The next slice's codes and scales in flight while this one is multiplied.
      uint4 wn[4];
      uint32_t sn[4];
      const bool more = kb + 64 < K;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        wn[t] = more ? __ldg(reinterpret_cast<const uint4*>(wrow[t] + kb + 64)) : make_uint4(0u, 0u, 0u, 0u);
        sn[t] = more ? __ldg(srow[t] + (kb + 64) / 32) : 0u;
      }
      float sv[4];  // the slice's scale values, 2^(c - 127)
#pragma unroll
      for (int t = 0; t < 4; ++t) sv[t] = detail::exp2_exact(static_cast<int>(sc[t]) - 127);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const uint2 lo = xin[mt][0] ? __ldg(reinterpret_cast<const uint2*>(xrow[mt][0] + kb + 4 * j)) : make_uint2(0u, 0u);
          const uint2 hi = xin[mt][1] ? __ldg(reinterpret_cast<const uint2*>(xrow[mt][1] + kb + 4 * j)) : make_uint2(0u, 0u);
          a[mt][0] = lo.x;  // row g, logical k 2q, 2q + 1
          a[mt][1] = hi.x;  // row g + 8
          a[mt][2] = lo.y;  // row g, logical k 2q + 8, 2q + 9
          a[mt][3] = hi.y;  // row g + 8
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const uint32_t word = j == 0 ? w[t].x : (j == 1 ? w[t].y : (j == 2 ? w[t].z : w[t].w));
          const bool nan = sc[t] == 0xFFu;
          const uint32_t b0 = bf16x2_of(word & 0xFFFFu, sv[t], nan), b1 = bf16x2_of(word >> 16, sv[t], nan);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) mma_bf16(acc[mt][t], a[mt], b0, b1);
        }
      }
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        w[t] = wn[t];
        sc[t] = sn[t];
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!xin[mt][h]) continue;
        float* yr = p.y + (m0 + 16 * mt + 8 * h + g) * p.n + n0 + 2 * q;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          float2 v = make_float2(acc[mt][t][2 * h], acc[mt][t][2 * h + 1]);
          float2* dst = reinterpret_cast<float2*>(yr + 8 * t);
          if (p.accumulate) {
            const float2 old = *dst;
            v = make_float2(old.x + v.x, old.y + v.y);
          }
          *dst = v;
        }
      }
  }
}

}  // namespace mxw

// Whether the kernel takes these sizes: K a multiple of 64, N of the block's 128 rows,
// 16-byte aligned codes and x (scales, y: any alignment of their element type... y 8 bytes).
inline bool mxfp8_weights_gemm_fits(const Mxfp8WeightsGemm& p) {
  const uintptr_t a16 = reinterpret_cast<uintptr_t>(p.codes) | reinterpret_cast<uintptr_t>(p.x);
  return p.k > 0 && p.k % 64 == 0 && p.n > 0 && p.n % mxw::kTileN == 0 && a16 % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.y) % 8 == 0 && p.num_experts > 0 && p.num_experts <= 65535;
}

inline cudaError_t mxfp8_weights_gemm(const Mxfp8WeightsGemm& p, cudaStream_t stream) {
  if (!mxfp8_weights_gemm_fits(p)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.n / mxw::kTileN), static_cast<unsigned>(p.num_experts));
  mxw::mxfp8_weights_gemm_kernel<<<grid, mxw::kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_GEMM_CUH_
