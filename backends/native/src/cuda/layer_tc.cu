// The layer object's tensor-core path (docs/native.md, "The layer object"):
// the experts' forward and backward with bf16 operands on Hopper tensor cores
// (the CUTLASS grouped GEMMs of cuda/gemm/grouped_gemm.h, float32 accumulation)
// and the elementwise work around them in a few fused kernels.
//
// Forward:   FC1 (one grouped GEMM, float32 c) -> one kernel: the bf16 stash,
//            the clamp, SwiGLU, the router weight, R_int, the FC2 operand as bf16
//            planes -> FC2 (one grouped GEMM per plane, accumulating in float32 y)
//            -> one kernel: w * z (weight in FC2), R_comb, zero rows of no expert.
//            With bf16 weights, intermediate_format bf16 and many rows an expert, FC1 and
//            its kernel are one GEMM whose epilogue does that kernel's work from registers
//            (cuda/gemm/fc1_swiglu_gemm.h; MOE_EP_FC1_EPILOGUE, fc1_epilogue_fused).
// Backward:  the cotangent as bf16 planes -> a = (dY or w dY) W2^T -> one kernel:
//            recompute from the stash, dh, dc (as planes), the FC2 left operand
//            (w h or h) as planes -> dW2, dW1, dx grouped GEMMs -> dw row sums.
// Backward with bf16 operands (backward_operand_format bf16): R_bf16(dY) (the bf16
//            cotangent itself, or one encode pass) -> a = R_bf16(dY) W2^T -> one fused
//            kernel a row: recompute from the stash, the masks, dc and R_bf16(dc),
//            R_bf16(w h), dw = <a, h>, zero dx rows of no expert -> dW2, dW1, dx:
//            four bf16 grouped GEMMs in all.
//
// Splitting a float32 value into planes: hi = v with its low 16 bits cleared
// (bf16 truncation), mid = the same of v - hi, lo = bf16(v - hi - mid). Each
// difference is exact in float32, and what is left after two truncations has
// at most 8 significant bits, so hi + mid + lo == v exactly for every finite v
// whose pieces stay in bf16's normal range (below it, at magnitudes under about
// 2^-110, the pieces lose bits: absolute errors under 2^-133). A NaN or an
// infinity is carried by hi alone. So the GEMMs see the spec's float32 operand
// and only their float32 accumulation rounds: products of one row's planes are
// summed in one accumulator, and products of two split operands keep the eight
// largest of the nine plane pairs (the dropped lo x lo is below 2^-30 of the
// product).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/common.cuh"
#include "cuda/format_math.cuh"
#include "cuda/gemm/fc1_swiglu_gemm.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/mxfp8_weights_gemm.cuh"
#include "cuda/gemm/nvfp4_weights_gemm.cuh"
#include "cuda/swiglu.cuh"
#include "internal.h"

namespace moe_ep {
namespace cuda {
namespace {

using namespace detail;

constexpr int kPlanes = 3;

// ------------------------------------------------------------------ helpers

__device__ __forceinline__ uint16_t bf16_trunc(float v) { return static_cast<uint16_t>(__float_as_uint(v) >> 16); }

// v == hi + mid + lo (see the file comment); NaN and +-Inf in hi alone.
__device__ __forceinline__ void split3(float v, uint16_t& hi, uint16_t& mid, uint16_t& lo) {
  if (!isfinite(v)) {
    hi = isnan(v) ? uint16_t{0x7FC0} : bf16_trunc(v);
    mid = 0;
    lo = 0;
    return;
  }
  hi = bf16_trunc(v);
  const float r1 = fsub(v, bf16_to_float(hi));
  mid = bf16_trunc(r1);
  const float r2 = fsub(r1, bf16_to_float(mid));
  lo = bf16_from_float(r2);
}

// Writes v at element `at` of plane-major [planes, plane_stride] bf16 (planes 1 or 3).
__device__ __forceinline__ void put_planes(uint16_t* __restrict__ p, int64_t plane_stride, int64_t at, int planes,
                                           float v) {
  if (planes == 1) {
    p[at] = bf16_from_float(v);  // the caller guarantees v is a bf16 value
    return;
  }
  uint16_t hi, mid, lo;
  split3(v, hi, mid, lo);
  p[at] = hi;
  p[plane_stride + at] = mid;
  p[2 * plane_stride + at] = lo;
}

// In-place round trip of len values at p in format kFmt (one block, or one element for bf16).
template <int kFmt>
__device__ __forceinline__ void round_trip_block(float* p, int len) {
  if constexpr (kFmt == MOE_EP_FORMAT_BF16) {
    for (int j = 0; j < len; ++j) p[j] = bf16_round_trip(p[j]);
  } else if constexpr (kFmt == MOE_EP_FORMAT_MXFP8) {
    mxfp8_round_trip_block(p, len);
  } else if constexpr (kFmt == MOE_EP_FORMAT_NVFP4) {
    nvfp4_round_trip_block(p, len);
  }
}

template <int kFmt>
__host__ __device__ constexpr int block_of() {
  return kFmt == MOE_EP_FORMAT_MXFP8 ? 32 : (kFmt == MOE_EP_FORMAT_NVFP4 ? 16 : 1);
}

// ------------------------------------------------------------------ forward kernels

// FC1 epilogue, one thread per (row, block of the intermediate format along I):
// the stash fc1_c = bf16(c) (both halves of the block's columns), and the FC2
// operand R_int(w h or h) as bf16 planes. Rows of no expert (r >= off[E]): zero
// stash and zero operand.
template <int kFmt>
__global__ void fc1_epilogue_kernel(const float* __restrict__ c, const float* __restrict__ w,
                                    const int32_t* __restrict__ off, int num_experts, uint16_t* __restrict__ stash,
                                    uint16_t* __restrict__ op, int planes, SwigluParams p) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  constexpr int kBlock = block_of<kFmt>();
  const int64_t I = p.I;
  const int64_t nb = div_up(I, kBlock);
  const int64_t total = p.C * nb;
  const int64_t end = off[num_experts];
  const int64_t plane_stride = p.C * I;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = t / nb, b = t - r * nb;
    const int64_t k0 = b * kBlock;
    const int len = static_cast<int>(I - k0 < kBlock ? I - k0 : kBlock);
    const float* cr = c + r * 2 * I;
    float o[kBlock];
    if (r < end) {
      const float wr = w[r];
      for (int j = 0; j < len; ++j) {
        const float g = cr[k0 + j], u = cr[I + k0 + j];
        if (stash != nullptr) {
          stash[r * 2 * I + k0 + j] = bf16_from_float(g);
          stash[r * 2 * I + I + k0 + j] = bf16_from_float(u);
        }
        o[j] = swiglu_operand(g, u, wr, p);
      }
      round_trip_block<kFmt>(o, len);
    } else {
      for (int j = 0; j < len; ++j) {
        if (stash != nullptr) {
          stash[r * 2 * I + k0 + j] = 0;
          stash[r * 2 * I + I + k0 + j] = 0;
        }
        o[j] = 0.0f;
      }
    }
    for (int j = 0; j < len; ++j) put_planes(op, plane_stride, r * I + k0 + j, planes, o[j]);
  }
}

// FC2 epilogue, one thread per (row, block of the combine format along H):
// y = w * z when the weight goes into FC2, then R_comb in place; rows of no
// expert zero. kWeight: multiply by w.
template <int kFmt, bool kWeight>
__global__ void fc2_epilogue_kernel(float* __restrict__ y, const float* __restrict__ w,
                                    const int32_t* __restrict__ off, int num_experts, int64_t C, int64_t H) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  constexpr int kBlock = block_of<kFmt>();
  const int64_t nb = div_up(H, kBlock);
  const int64_t total = C * nb;
  const int64_t end = off == nullptr ? C : off[num_experts];
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = t / nb, b = t - r * nb;
    const int64_t k0 = b * kBlock;
    const int len = static_cast<int>(H - k0 < kBlock ? H - k0 : kBlock);
    float* yr = y + r * H + k0;
    if (r >= end) {
      for (int j = 0; j < len; ++j) yr[j] = 0.0f;
      continue;
    }
    float o[kBlock];
    for (int j = 0; j < len; ++j) o[j] = kWeight ? fmul(w[r], yr[j]) : yr[j];
    round_trip_block<kFmt>(o, len);
    for (int j = 0; j < len; ++j) yr[j] = o[j];
  }
}

// Where fc2_epilogue_vec4_kernel puts its values: back into y as they are (kF32) or
// rounded through bf16 (kRoundBf16), or their bf16 bits into bf16_out (kBf16Rows: the
// expert output as bf16 rows, combine_format bf16, whose encoding is the round trip; y is
// only read).
enum class Vec4Store { kF32, kRoundBf16, kBf16Rows };

// The same for the element-wise formats (none, bf16) four values at a time (H a
// multiple of 4, so a float4 never crosses a row): w * y or y, stored as kStore says;
// rows of no expert zero.
template <Vec4Store kStore, bool kWeight>
__global__ void fc2_epilogue_vec4_kernel(float4* __restrict__ y, const float* __restrict__ w,
                                         const int32_t* __restrict__ off, int num_experts, int64_t C, int64_t H,
                                         uint2* __restrict__ bf16_out = nullptr) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  const int64_t q = H / 4;  // float4 per row
  const int64_t total = C * q;
  const int64_t end = off == nullptr ? C : off[num_experts];
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = div_nonneg(t, q);
    if (r >= end) {
      if constexpr (kStore == Vec4Store::kBf16Rows) bf16_out[t] = make_uint2(0u, 0u);
      else y[t] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      continue;
    }
    float4 v = y[t];
    if (kWeight) {
      const float wr = w[r];
      v = make_float4(fmul(wr, v.x), fmul(wr, v.y), fmul(wr, v.z), fmul(wr, v.w));
    }
    if constexpr (kStore == Vec4Store::kBf16Rows) {
      bf16_out[t] = bf16x4_from_float(v.x, v.y, v.z, v.w);
    } else {
      if constexpr (kStore == Vec4Store::kRoundBf16)
        v = make_float4(bf16_round_trip(v.x), bf16_round_trip(v.y), bf16_round_trip(v.z), bf16_round_trip(v.w));
      y[t] = v;
    }
  }
}

// The same for the block formats (mxfp8: 32 values a block, nvfp4: 16), four values a
// lane: the kBlock / 4 lanes of a block load a float4 each, agree on the block's largest
// magnitude with shuffles and round trip their values with the block's scale through
// mxfp8_round_trip_cvt4 or nvfp4_round_trip_with, the values of round_trip_block (H a
// multiple of kBlock, y 16-byte aligned). Every lane of a warp runs every iteration
// (the shuffles need them); lanes past the end only look.
// kBf16Out (nvfp4 only: its values are bf16 values): the round-tripped values go to
// bf16_out as their bf16 bits (exact) instead of back into y.
template <int kFmt, bool kWeight, bool kBf16Out = false>
__global__ void fc2_epilogue_block_vec4_kernel(float4* __restrict__ y, const float* __restrict__ w,
                                               const int32_t* __restrict__ off, int num_experts, int64_t C,
                                               int64_t H, uint2* __restrict__ bf16_out = nullptr) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  static_assert(!kBf16Out || kFmt == MOE_EP_FORMAT_NVFP4, "bf16 rows hold nvfp4's values, not always mxfp8's");
  constexpr int kGroup = block_of<kFmt>() / 4;  // lanes of one block
  static_assert(kGroup == 8 || kGroup == 4, "fc2_epilogue_block_vec4_kernel: mxfp8 or nvfp4");
  const int64_t q = H / 4;  // float4 per row (a multiple of kGroup: a block never crosses a row)
  const int64_t total = C * q;
  const int64_t end = off == nullptr ? C : off[num_experts];
  const int lane = threadIdx.x & 31;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t base = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) - lane; base < total; base += stride) {
    const int64_t t = base + lane;
    const bool here = t < total;
    const int64_t r = here ? div_nonneg(t, q) : 0;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (here && r < end) {
      const float4 x = y[t];
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
      if (kWeight) {
        const float wr = w[r];
        for (int j = 0; j < 4; ++j) v[j] = fmul(wr, v[j]);
      }
    }
    const BlockMax bm = group_block_max<kGroup>(v);  // the block's lanes are kGroup-aligned within the warp
    if (!here) continue;
    if (r >= end) {
      if constexpr (kBf16Out) bf16_out[t] = make_uint2(0u, 0u);
      else y[t] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      continue;
    }
    if constexpr (kFmt == MOE_EP_FORMAT_MXFP8) mxfp8_round_trip_cvt4(bm, v);  // the hardware's E4M3 converts
    else nvfp4_round_trip_with(bm, v, 4);
    if constexpr (kBf16Out) {  // exact: the upper halves (NaN stays NaN)
      bf16_out[t] = bf16x4_from_float(v[0], v[1], v[2], v[3]);
    } else {
      y[t] = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
}

// FC1 epilogue for the element-wise intermediate formats (none, bf16), four columns
// per thread (I a multiple of 4): the same values as fc1_epilogue_kernel, with 16-byte
// loads of c and 8-byte stores of the stash and of a one-plane operand.
template <bool kRoundBf16>
__global__ void fc1_epilogue_vec4_kernel(const float* __restrict__ c, const float* __restrict__ w,
                                         const int32_t* __restrict__ off, int num_experts, uint16_t* __restrict__ stash,
                                         uint16_t* __restrict__ op, int planes, SwigluParams p) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  const int64_t I = p.I;
  const int64_t q = I / 4;
  const int64_t total = p.C * q;
  const int64_t end = off[num_experts];
  const int64_t plane_stride = p.C * I;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = div_nonneg(t, q), k0 = (t - r * q) * 4;
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint2 sg = make_uint2(0u, 0u), su = make_uint2(0u, 0u);
    if (r < end) {
      const float4 g4 = *reinterpret_cast<const float4*>(c + r * 2 * I + k0);
      const float4 u4 = *reinterpret_cast<const float4*>(c + r * 2 * I + I + k0);
      const float g[4] = {g4.x, g4.y, g4.z, g4.w}, u[4] = {u4.x, u4.y, u4.z, u4.w};
      const float wr = w[r];
      uint16_t bg[4], bu[4];
      for (int j = 0; j < 4; ++j) {
        bg[j] = bf16_from_float(g[j]);
        bu[j] = bf16_from_float(u[j]);
        o[j] = swiglu_operand(g[j], u[j], wr, p);
        if (kRoundBf16) o[j] = bf16_round_trip(o[j]);
      }
      sg = bf16x4(bg[0], bg[1], bg[2], bg[3]);
      su = bf16x4(bu[0], bu[1], bu[2], bu[3]);
    }
    if (stash != nullptr) {
      *reinterpret_cast<uint2*>(stash + r * 2 * I + k0) = sg;
      *reinterpret_cast<uint2*>(stash + r * 2 * I + I + k0) = su;
    }
    if (planes == 1) {
      // o is a bf16 value (one plane)
      *reinterpret_cast<uint2*>(op + r * I + k0) = bf16x4_from_float(o[0], o[1], o[2], o[3]);
    } else {
      for (int j = 0; j < 4; ++j) put_planes(op, plane_stride, r * I + k0 + j, planes, o[j]);
    }
  }
}

// ------------------------------------------------------------------ backward kernels

// src [C, n] float32 (times w[r] when w is set) as bf16 planes; rows of no expert zero.
__global__ void split_rows_kernel(const float* __restrict__ src, const float* __restrict__ w,
                                  const int32_t* __restrict__ off, int num_experts, int64_t C, int64_t n,
                                  uint16_t* __restrict__ planes) {
  const int64_t total = C * n;
  const int64_t end = off[num_experts];
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = t / n;
    float v = 0.0f;
    if (r < end) v = w != nullptr ? fmul(w[r], src[t]) : src[t];
    put_planes(planes, total, t, kPlanes, v);
  }
}

// One thread per (r, i), as swiglu_backward_kernel of experts.cu, from the stash:
//   h[r, i]; dh = a w (weight in FC1) or a (a already holds w dY W2^T);
//   dc = [dg, du] as planes; the dW2 left operand (w h or h) as planes.
__global__ void swiglu_backward_tc_kernel(const uint16_t* __restrict__ fc1_c, const float* __restrict__ a,
                                          const float* __restrict__ w, const int32_t* __restrict__ off,
                                          int num_experts, float* __restrict__ h_out, uint16_t* __restrict__ dc,
                                          uint16_t* __restrict__ left, SwigluParams p) {
  const int64_t I = p.I;
  const int64_t total = p.C * I;
  const int64_t end = off[num_experts];
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = t / I, i = t - r * I;
    float h = 0.0f, dg = 0.0f, du = 0.0f, lv = 0.0f;
    if (r < end) {
      const float g_raw = bf16_to_float(fc1_c[r * 2 * I + i]);
      const float u_raw = bf16_to_float(fc1_c[r * 2 * I + I + i]);
      const SwigluGrad gr = swiglu_grad(g_raw, u_raw, p.apply_topk_in_fc1 ? fmul(a[t], w[r]) : a[t], p);
      h = gr.h;
      dg = gr.dg;
      du = gr.du;
      lv = p.apply_topk_in_fc1 ? fmul(w[r], h) : h;
    }
    h_out[t] = h;
    put_planes(dc, p.C * 2 * I, r * 2 * I + i, kPlanes, dg);
    put_planes(dc, p.C * 2 * I, r * 2 * I + I + i, kPlanes, du);
    put_planes(left, total, t, kPlanes, lv);
  }
}

// out[r] = sum_j A[r, j] * B[r, j] (float32, a fixed tree order: deterministic);
// 0 for rows of no expert. One block per row (grid-stride over rows).
constexpr int kDotThreads = 256;
__global__ void __launch_bounds__(kDotThreads)
    row_dot_kernel(const float* __restrict__ A, const float* __restrict__ B, const int32_t* __restrict__ off,
                   int num_experts, int64_t C, int64_t n, float* __restrict__ out) {
  __shared__ float part[kDotThreads];
  const int64_t end = off[num_experts];
  for (int64_t r = blockIdx.x; r < C; r += gridDim.x) {
    float acc = 0.0f;
    if (r < end)
      for (int64_t j = threadIdx.x; j < n; j += kDotThreads) acc = fadd(acc, fmul(A[r * n + j], B[r * n + j]));
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = kDotThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) part[threadIdx.x] = fadd(part[threadIdx.x], part[threadIdx.x + s]);
      __syncthreads();
    }
    if (threadIdx.x == 0) out[r] = part[0];
    __syncthreads();
  }
}

// The bf16-operand backward's SwiGLU pass, one block a row (grid-stride over rows):
//   from the stash c~ and a = R_bf16(dY) W2^T: h, dh = a w, dg and du (swiglu_grad, the masks
//   included); dc = [R_bf16(dg), R_bf16(du)] -> dc [C, 2I] bf16 (the operand of dW1 and dx);
//   R_bf16(w h) -> left [C, I] bf16 (the operand of dW2); dw[r] = <a, h> in float32 (a fixed
//   tree over the block's threads: deterministic). Rows of no expert: dw 0 and their dx rows
//   zero (the dx GEMM writes only the experts' rows); their dc and left rows are never read.
// kVec: four columns a thread (I a multiple of 4, the stash 8-byte aligned, a, dc and left
// 16-byte aligned): 16-byte loads of a, 8-byte loads of the stash and stores of dc and left.
constexpr int kFusedThreads = 256;
template <bool kVec>
__global__ void __launch_bounds__(kFusedThreads)
    swiglu_backward_bf16_kernel(const uint16_t* __restrict__ fc1_c, const float* __restrict__ a,
                                const float* __restrict__ w, const int32_t* __restrict__ off, int num_experts,
                                uint16_t* __restrict__ dc, uint16_t* __restrict__ left, float* __restrict__ dw,
                                float* __restrict__ dx, int64_t H, bool dx_vec, SwigluParams p) {
  __shared__ float part[kFusedThreads / 32];
  const int64_t I = p.I;
  const int64_t end = off[num_experts];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int64_t r = blockIdx.x; r < p.C; r += gridDim.x) {
    if (r >= end) {  // a row of no expert (the same branch for the whole block)
      if (tid == 0) dw[r] = 0.0f;
      if (dx_vec) {
        float4* d4 = reinterpret_cast<float4*>(dx + r * H);
        for (int64_t j = tid; j < H / 4; j += kFusedThreads) d4[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      } else {
        for (int64_t j = tid; j < H; j += kFusedThreads) dx[r * H + j] = 0.0f;
      }
      continue;
    }
    const float wr = w[r];
    const uint16_t* cg = fc1_c + r * 2 * I;
    const uint16_t* cu = cg + I;
    const float* ar = a + r * I;
    uint16_t* dg_out = dc + r * 2 * I;
    uint16_t* du_out = dg_out + I;
    uint16_t* l_out = left + r * I;
    float acc = 0.0f;
    if constexpr (kVec) {
      for (int64_t q = tid; q < I / 4; q += kFusedThreads) {
        const int64_t i0 = q * 4;
        const uint2 g2 = *reinterpret_cast<const uint2*>(cg + i0);
        const uint2 u2 = *reinterpret_cast<const uint2*>(cu + i0);
        const float4 a4 = *reinterpret_cast<const float4*>(ar + i0);
        const uint16_t gb[4] = {static_cast<uint16_t>(g2.x), static_cast<uint16_t>(g2.x >> 16),
                                static_cast<uint16_t>(g2.y), static_cast<uint16_t>(g2.y >> 16)};
        const uint16_t ub[4] = {static_cast<uint16_t>(u2.x), static_cast<uint16_t>(u2.x >> 16),
                                static_cast<uint16_t>(u2.y), static_cast<uint16_t>(u2.y >> 16)};
        const float av[4] = {a4.x, a4.y, a4.z, a4.w};
        float dg[4], du[4], lv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const SwigluGrad gr = swiglu_grad(bf16_to_float(gb[j]), bf16_to_float(ub[j]), fmul(av[j], wr), p);
          acc = fadd(acc, fmul(av[j], gr.h));
          dg[j] = gr.dg;
          du[j] = gr.du;
          lv[j] = fmul(wr, gr.h);
        }
        *reinterpret_cast<uint2*>(dg_out + i0) = bf16x4_from_float(dg[0], dg[1], dg[2], dg[3]);
        *reinterpret_cast<uint2*>(du_out + i0) = bf16x4_from_float(du[0], du[1], du[2], du[3]);
        *reinterpret_cast<uint2*>(l_out + i0) = bf16x4_from_float(lv[0], lv[1], lv[2], lv[3]);
      }
    } else {
      for (int64_t i = tid; i < I; i += kFusedThreads) {
        const SwigluGrad gr = swiglu_grad(bf16_to_float(cg[i]), bf16_to_float(cu[i]), fmul(ar[i], wr), p);
        acc = fadd(acc, fmul(ar[i], gr.h));
        dg_out[i] = bf16_from_float(gr.dg);
        du_out[i] = bf16_from_float(gr.du);
        l_out[i] = bf16_from_float(fmul(wr, gr.h));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = fadd(acc, __shfl_down_sync(0xffffffffu, acc, o));
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (tid == 0) {
      float t = 0.0f;
#pragma unroll
      for (int k = 0; k < kFusedThreads / 32; ++k) t = fadd(t, part[k]);
      dw[r] = t;
    }
    __syncthreads();
  }
}

// out[i] = the float32 value of bf16 bits in[i].
__global__ void bf16_to_float_kernel(const uint16_t* __restrict__ in, int64_t n, float* __restrict__ out) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < n; t += int64_t{gridDim.x} * blockDim.x)
    out[t] = bf16_to_float(in[t]);
}

// Rows r >= off[E] of x [C, n]: zero (the grouped GEMMs write only the experts' rows).
__global__ void zero_tail_rows_kernel(float* __restrict__ x, const int32_t* __restrict__ off, int num_experts,
                                      int64_t C, int64_t n) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  const int64_t start = static_cast<int64_t>(off[num_experts]) * n;
  const int64_t total = C * n;
  for (int64_t t = start + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total;
       t += int64_t{gridDim.x} * blockDim.x)
    x[t] = 0.0f;
}

// ------------------------------------------------------------------ launches

// MOE_EP_FC1_EPILOGUE (read at every forward): unset, empty or "fused" (the default): FC1 with
// the SwiGLU in its epilogue where fc1_fused_problem says it applies; "pass": FC1's float32 c,
// then fc1_epilogue_vec4_kernel (the same bits, for timing one against the other). Any other
// value is an error naming the rule and the value.
moe_ep_status fc1_epilogue_fused(bool* fused) {
  const char* v = std::getenv("MOE_EP_FC1_EPILOGUE");
  *fused = v == nullptr || *v == '\0' || std::strcmp(v, "fused") == 0;
  if (*fused || std::strcmp(v, "pass") == 0) return MOE_EP_OK;
  return fail(MOE_EP_ERR_INVALID_ARGUMENT,
              std::string("forward: MOE_EP_FC1_EPILOGUE must be unset, 'fused' or 'pass'; got '") + v + "'");
}

// The fused FC1 of d (fc1_swiglu_gemm.h) with the layer's operands, and whether it applies:
// bf16 weights, intermediate_format bf16 (one bf16 plane: R_bf16), more than 128 rows an
// expert on average (fewer take the grouped GEMMs' few-rows kernel), and the kernel's shape
// rules (fc1_swiglu_gemm_supported). Pointers may be stand-ins (sizes only).
bool fc1_fused_problem(const moe_ep_expert_desc& d, const uint16_t* x, const float* w, const uint16_t* fc1,
                       const int32_t* offsets, const int32_t* group_sizes, uint16_t* h, uint16_t* stash,
                       Fc1SwigluProblem* out) {
  Fc1SwigluProblem q;
  q.num_groups = static_cast<int32_t>(d.num_local_experts);
  if (group_sizes != nullptr) {
    q.group_sizes = group_sizes;
    q.offsets_out = const_cast<int32_t*>(offsets);
  } else {
    q.offsets = offsets;
  }
  q.total_rows = d.num_rows;
  q.hidden = d.hidden;
  q.intermediate = d.intermediate;
  q.x = x;
  q.w1 = fc1;
  q.weight = w;
  q.h = h;
  q.stash = stash;
  q.apply_weight = d.apply_topk_in_fc1;
  q.has_clamp = d.has_clamp;
  q.limit = d.gate_up_clamp;
  *out = q;
  return d.intermediate_format == MOE_EP_FORMAT_BF16 && d.num_local_experts > 0 &&
         d.num_rows > 128 * d.num_local_experts && fc1_swiglu_gemm_supported(q);
}

// Blocks of a grid-stride kernel that only touches a tail of its `total` elements (the
// rows past the last expert's slab): a few per SM instead of one per 256 elements.
unsigned tail_blocks(int64_t total, const TcWorkspace& ws) {
  return std::min(blocks_for(total), static_cast<unsigned>(std::max(ws.sm_count, 1) * 8));
}

moe_ep_status gemm_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return MOE_EP_OK;
  return fail(MOE_EP_ERR_CUDA, std::string("grouped GEMM (") + what + ") failed: " + cudaGetErrorName(err) + ": " +
                                   cudaGetErrorString(err));
}

struct Gemm {
  const moe_ep_expert_desc& d;
  const TcWorkspace& ws;
  cudaStream_t stream;
  // first_group, num_groups: the experts [first_group, first_group + num_groups) only (-1: all).
  moe_ep_status run(GemmLayout layout, int64_t m, int64_t n, int64_t k, const uint16_t* a, const uint16_t* b, float* out,
                    bool accumulate, const char* what, uint16_t* out_bf16 = nullptr, int32_t first_group = 0,
                    int32_t num_groups = -1, const int32_t* group_sizes = nullptr) const {
    GroupedGemmProblem p;
    p.layout = layout;
    p.num_groups = num_groups < 0 ? static_cast<int32_t>(d.num_local_experts) : num_groups;
    p.offsets = ws.offsets + first_group;
    if (group_sizes != nullptr) {  // ws.offsets made from the sizes in the GEMM's own launches
      p.group_sizes = group_sizes;
      p.offsets_out = ws.offsets;
    }
    p.total_rows = d.num_rows;
    p.m = m;
    p.n = n;
    p.k = k;
    p.a = a;
    p.b = b;
    p.d = out;
    p.d_bf16 = out_bf16;
    p.accumulate = accumulate;
    return gemm_status(grouped_gemm_bf16(p, ws.gemm, ws.gemm_bytes, stream, ws.sm_count), what);
  }
  // out[r] (+)= a[r] W_e for the forward's NN GEMMs [C, k] x [E, k, n]: the bf16 weight b, or the
  // block-scaled codes and scales of wt.codes_format ([E, n, k] mxfp8, [E, n, k / 2] nvfp4;
  // scales [E, n, k / 32] or [E, n, k / 16]) through the block-scaled-weights GEMMs.
  // a_planes > 1 (codes only): a holds that many bf16 planes, a_plane_stride elements apart,
  // summed (the GEMM multiplies them with the weights decoded once).
  // group_sizes (bf16 weights only): ws.offsets are made from them by the GEMM's launch.
  moe_ep_status forward(int64_t n, int64_t k, const uint16_t* a, const uint16_t* b, const TcWeights& wt,
                        const uint8_t* codes, const uint8_t* scales, float* out, bool accumulate, const char* what,
                        uint16_t* out_bf16 = nullptr, int a_planes = 1, int64_t a_plane_stride = 0,
                        const int32_t* group_sizes = nullptr) const {
    if (codes == nullptr)
      return run(GemmLayout::kNN, 0, n, k, a, b, out, accumulate, what, out_bf16, 0, -1, group_sizes);
    // The fields both formats' parameters share.
    auto fill = [&](auto& p) {
      p.x = a;
      p.off = ws.offsets;
      if (group_sizes != nullptr && d.num_local_experts <= 1024) {  // made by the GEMM's blocks
        p.group_sizes = group_sizes;
        p.off_out = ws.offsets;
      }
      p.codes = codes;
      p.scales = scales;
      p.num_experts = static_cast<int>(d.num_local_experts);
      p.n = n;
      p.k = k;
      p.y = out;
      p.y_bf16 = out_bf16;
      p.accumulate = accumulate;
      p.total_rows = d.num_rows;
      p.x_planes = a_planes;
      p.x_plane_stride = a_plane_stride;
    };
    if (wt.codes_format == MOE_EP_FORMAT_NVFP4) {
      Nvfp4WeightsGemm p{};
      fill(p);
      return gemm_status(nvfp4_weights_gemm(p, stream), what);
    }
    Mxfp8WeightsGemm p{};
    fill(p);
    p.inexact = wt.inexact;
    return gemm_status(mxfp8_weights_gemm(p, stream), what);
  }
};

template <int kFmt>
void launch_fc1_epilogue_as(unsigned blocks, cudaStream_t s, const float* c, const float* w, const int32_t* off, int E,
                         uint16_t* stash, uint16_t* op, int planes, const SwigluParams& p) {
  if constexpr (kFmt == MOE_EP_FORMAT_NONE || kFmt == MOE_EP_FORMAT_BF16) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(c) | reinterpret_cast<uintptr_t>(stash) |
                        reinterpret_cast<uintptr_t>(op);
    if (p.I % 4 == 0 && a % 16 == 0) {
      const unsigned b = blocks_for(p.C * (p.I / 4));
      (void)launch_pdl(fc1_epilogue_vec4_kernel<kFmt == MOE_EP_FORMAT_BF16>, b, kThreads, 0, s, c, w, off, E, stash,
                       op, planes, p);
      return;
    }
  }
  (void)launch_pdl(fc1_epilogue_kernel<kFmt>, blocks, kThreads, 0, s, c, w, off, E, stash, op, planes, p);
}

template <int kFmt>
void launch_fc2_epilogue_as(unsigned blocks, cudaStream_t s, float* y, const float* w, const int32_t* off, int E,
                         int64_t C, int64_t H, bool weight) {
  if constexpr (kFmt == MOE_EP_FORMAT_NONE || kFmt == MOE_EP_FORMAT_BF16) {
    if (H % 4 == 0 && aligned16(y)) {
      constexpr Vec4Store kStore = kFmt == MOE_EP_FORMAT_BF16 ? Vec4Store::kRoundBf16 : Vec4Store::kF32;
      const unsigned b = blocks_for(C * (H / 4));
      float4* y4 = reinterpret_cast<float4*>(y);
      with_flag(weight, [&](auto kW) {
        (void)launch_pdl(fc2_epilogue_vec4_kernel<kStore, decltype(kW)::value>, b, kThreads, 0, s, y4, w, off, E, C, H,
                         static_cast<uint2*>(nullptr));
      });
      return;
    }
  }
  if constexpr (kFmt == MOE_EP_FORMAT_MXFP8 || kFmt == MOE_EP_FORMAT_NVFP4) {
    if (H % block_of<kFmt>() == 0 && aligned16(y)) {
      const unsigned b = blocks_for(C * (H / 4));
      float4* y4 = reinterpret_cast<float4*>(y);
      with_flag(weight, [&](auto kW) {
        (void)launch_pdl(fc2_epilogue_block_vec4_kernel<kFmt, decltype(kW)::value>, b, kThreads, 0, s, y4, w, off, E,
                         C, H, static_cast<uint2*>(nullptr));
      });
      return;
    }
  }
  with_flag(weight, [&](auto kW) {
    (void)launch_pdl(fc2_epilogue_kernel<kFmt, decltype(kW)::value>, blocks, kThreads, 0, s, y, w, off, E, C, H);
  });
}

// The epilogues for a format known at run time (MOE_EP_FORMAT_NONE: no rounding).
void launch_fc1_epilogue(int32_t fmt, unsigned blocks, cudaStream_t s, const float* c, const float* w,
                         const int32_t* off, int E, uint16_t* stash, uint16_t* op, int planes, const SwigluParams& p) {
  switch (fmt) {
    case MOE_EP_FORMAT_BF16: return launch_fc1_epilogue_as<MOE_EP_FORMAT_BF16>(blocks, s, c, w, off, E, stash, op, planes, p);
    case MOE_EP_FORMAT_MXFP8: return launch_fc1_epilogue_as<MOE_EP_FORMAT_MXFP8>(blocks, s, c, w, off, E, stash, op, planes, p);
    case MOE_EP_FORMAT_NVFP4: return launch_fc1_epilogue_as<MOE_EP_FORMAT_NVFP4>(blocks, s, c, w, off, E, stash, op, planes, p);
    default: return launch_fc1_epilogue_as<MOE_EP_FORMAT_NONE>(blocks, s, c, w, off, E, stash, op, planes, p);
  }
}

void launch_fc2_epilogue(int32_t fmt, unsigned blocks, cudaStream_t s, float* y, const float* w, const int32_t* off,
                         int E, int64_t C, int64_t H, bool weight) {
  switch (fmt) {
    case MOE_EP_FORMAT_BF16: return launch_fc2_epilogue_as<MOE_EP_FORMAT_BF16>(blocks, s, y, w, off, E, C, H, weight);
    case MOE_EP_FORMAT_MXFP8: return launch_fc2_epilogue_as<MOE_EP_FORMAT_MXFP8>(blocks, s, y, w, off, E, C, H, weight);
    case MOE_EP_FORMAT_NVFP4: return launch_fc2_epilogue_as<MOE_EP_FORMAT_NVFP4>(blocks, s, y, w, off, E, C, H, weight);
    default: return launch_fc2_epilogue_as<MOE_EP_FORMAT_NONE>(blocks, s, y, w, off, E, C, H, weight);
  }
}

// With bf16 expert-output rows: whether FC2 writes them itself (nothing but their bf16
// rounding follows: the router weight is in FC1 and the FC2 operand is one bf16 plane).
bool fc2_writes_bf16(const moe_ep_expert_desc& d, int32_t combine_format) {
  return combine_format == MOE_EP_FORMAT_BF16 && d.apply_topk_in_fc1 != 0 &&
         tc_operand_planes(d.intermediate_format) == 1;
}

int block_of_format(int32_t fmt) {
  return fmt == MOE_EP_FORMAT_MXFP8 ? 32 : (fmt == MOE_EP_FORMAT_NVFP4 ? 16 : 1);
}

// Every grouped GEMM the layer runs for d, for the workspace size and the support check.
template <typename Fn>
void for_each_problem(const moe_ep_expert_desc& d, bool backward, bool bf16_out, int32_t combine_format, Fn fn) {
  const int64_t H = d.hidden, I = d.intermediate;
  auto make = [&](GemmLayout l, int64_t m, int64_t n, int64_t k, bool d_bf16 = false) {
    GroupedGemmProblem p;
    p.layout = l;
    p.d_bf16 = d_bf16 ? reinterpret_cast<uint16_t*>(uintptr_t{256}) : nullptr;  // a stand-in: sizes only
    p.num_groups = static_cast<int32_t>(d.num_local_experts);
    p.total_rows = d.num_rows;
    p.m = m;
    p.n = n;
    p.k = k;
    fn(p);
  };
  make(GemmLayout::kNN, 0, 2 * I, H);  // FC1
  make(GemmLayout::kNN, 0, H, I);      // FC2 (and z = h W2)
  if (bf16_out && fc2_writes_bf16(d, combine_format)) make(GemmLayout::kNN, 0, H, I, true);  // FC2 straight into bf16 rows
  if (backward) {
    make(GemmLayout::kNT, 0, I, H);      // a = dY W2^T
    make(GemmLayout::kNT, 0, H, 2 * I);  // dx = dc W1^T
    make(GemmLayout::kTN, I, H, 0);      // dW2
    make(GemmLayout::kTN, H, 2 * I, 0);  // dW1
    make(GemmLayout::kTN, I, H, 0, true);      // dW2 as bf16 (MOE_EP_BACKWARD_WEIGHT_GRADS_BF16)
    make(GemmLayout::kTN, H, 2 * I, 0, true);  // dW1 as bf16
  }
}

}  // namespace

int tc_operand_planes(int32_t intermediate_format) {
  // bf16 values, and nvfp4 values (E2M1 x E4M3: at most 6 significant bits, exponents
  // from 2^-10 to 2^11), are bf16 values; float32 (no format) and mxfp8 (E4M3 x 2^k,
  // k down to -127: below bf16's range) are not always.
  return (intermediate_format == MOE_EP_FORMAT_BF16 || intermediate_format == MOE_EP_FORMAT_NVFP4) ? 1 : kPlanes;
}

size_t tc_workspace_layout(const moe_ep_expert_desc& d, int sm_count, bool backward, bool bf16_out,
                           int32_t combine_format, void* base, TcWorkspace* ws, bool bf16_backward) {
  if (!grouped_gemm_built()) return 0;
  bool ok = d.num_local_experts <= 1024;
  size_t gemm_bytes = 0;
  // The exact backward's bf16 weight gradients: groups of wgrad_experts experts (the last one
  // smaller), their float32 sums in TcWorkspace::wgrad32.
  const int64_t wgrad_experts =
      d.num_rows >= d.hidden ? std::max<int64_t>(1, std::min<int64_t>(d.num_local_experts, d.num_rows / d.hidden)) : 1;
  for_each_problem(d, backward, bf16_out, combine_format, [&](const GroupedGemmProblem& p) {
    GroupedGemmProblem q = p;
    // supported() also checks pointer alignment: give it aligned stand-ins.
    q.a = reinterpret_cast<const uint16_t*>(uintptr_t{256});
    q.b = q.a;
    q.d = q.d_bf16 != nullptr ? nullptr : reinterpret_cast<float*>(uintptr_t{256});
    q.offsets = reinterpret_cast<const int32_t*>(uintptr_t{256});
    if (!grouped_gemm_supported(q)) ok = false;
    gemm_bytes = std::max(gemm_bytes, grouped_gemm_workspace_bytes(q, sm_count));
    if (q.layout == GemmLayout::kTN && d.num_local_experts > 0) {  // in groups (exact backward, bf16 weight gradients)
      for (int64_t groups : {wgrad_experts, d.num_local_experts % wgrad_experts}) {
        if (groups == 0) continue;
        q.num_groups = static_cast<int32_t>(groups);
        gemm_bytes = std::max(gemm_bytes, grouped_gemm_workspace_bytes(q, sm_count));
      }
    }
  });
  {  // FC1 with the SwiGLU in its epilogue (stand-in pointers: sizes only)
    const auto* a = reinterpret_cast<const uint16_t*>(uintptr_t{256});
    auto* o = reinterpret_cast<uint16_t*>(uintptr_t{256});
    Fc1SwigluProblem f1;
    if (fc1_fused_problem(d, a, reinterpret_cast<const float*>(a), a, reinterpret_cast<const int32_t*>(a), nullptr, o,
                          o, &f1))
      gemm_bytes = std::max(gemm_bytes, fc1_swiglu_gemm_workspace_bytes(f1, sm_count));
  }
  if (!ok) return 0;
  const size_t C = static_cast<size_t>(d.num_rows), H = static_cast<size_t>(d.hidden),
               I = static_cast<size_t>(d.intermediate), E = static_cast<size_t>(d.num_local_experts);
  char* b = static_cast<char*>(base);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    char* p = b ? b + at : nullptr;
    at += align256(bytes);
    return p;
  };
  TcWorkspace w{};
  w.sm_count = sm_count;
  w.offsets = reinterpret_cast<int32_t*>(take((E + 1) * sizeof(int32_t)));
  w.gemm = take(gemm_bytes);
  w.gemm_bytes = gemm_bytes;
  w.c = reinterpret_cast<float*>(take(C * 2 * I * sizeof(float)));
  w.left = reinterpret_cast<uint16_t*>(take(kPlanes * C * I * sizeof(uint16_t)));
  if (bf16_out && !fc2_writes_bf16(d, combine_format)) w.y32 = reinterpret_cast<float*>(take(C * H * sizeof(float)));
  if (backward && bf16_backward) {  // one bf16 plane each; dw comes out of the fused pass (no h, z)
    w.right = reinterpret_cast<uint16_t*>(take(C * H * sizeof(uint16_t)));
    w.dc = reinterpret_cast<uint16_t*>(take(C * 2 * I * sizeof(uint16_t)));
    w.a = reinterpret_cast<float*>(take(C * I * sizeof(float)));
  } else if (backward) {
    w.right = reinterpret_cast<uint16_t*>(take(kPlanes * C * H * sizeof(uint16_t)));
    w.dc = reinterpret_cast<uint16_t*>(take(kPlanes * C * 2 * I * sizeof(uint16_t)));
    w.a = reinterpret_cast<float*>(take(C * I * sizeof(float)));
    w.h = reinterpret_cast<float*>(take(C * I * sizeof(float)));
    if (!d.apply_topk_in_fc1) {
      w.z = reinterpret_cast<float*>(take(C * H * sizeof(float)));
      w.dy32 = reinterpret_cast<float*>(take(C * H * sizeof(float)));
    }
    // Float32 weight gradients of wgrad_experts experts at a time (bf16 weight gradients): the
    // forward's c when it holds one expert's or more (the backward does not use it).
    w.wgrad32 = C >= H ? w.c : reinterpret_cast<float*>(take(H * 2 * I * sizeof(float)));
    w.wgrad32_experts = static_cast<int>(wgrad_experts);
  }
  if (ws != nullptr) *ws = w;
  return at;
}

bool tc_coded_weights_fit(const moe_ep_expert_desc& d) {
  static_assert(nvw::kStageK == mxw::kStageK && nvw::kTileN == mxw::kTileN, "one shape rule for both formats");
  return mxfp8_weights_shape_fits(2 * d.intermediate, d.hidden) && mxfp8_weights_shape_fits(d.hidden, d.intermediate) &&
         d.num_local_experts <= 65535;
}

moe_ep_status tc_forward(void* stream, const moe_ep_expert_desc& d, int32_t combine_format, bool bf16_out,
                         const uint16_t* x, const float* w, const TcWeights& wt, const int32_t* group_sizes,
                         void* y_out, uint16_t* fc1_c, const TcWorkspace& ws, bool* tail_deferred) {
  const cudaStream_t s = as_stream(stream);
  if (tail_deferred != nullptr) *tail_deferred = false;
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate;
  const int E = static_cast<int>(d.num_local_experts);
  if (C == 0) return MOE_EP_OK;
  const Gemm gemm{d, ws, s};
  // FC1's launch makes ws.offsets from the sizes (no offsets kernel: one launch fewer) where
  // it can: the CUTLASS GEMM's argument kernel, or the blocks of the block-scaled-weights GEMM
  // (at most 1024 experts).
  if (wt.coded() && E > 1024) {
    slab_offsets_kernel<<<1, 1, 0, s>>>(group_sizes, E, C, ws.offsets);
    MOE_EP_CUDA_CHECK_LAUNCH("slab_offsets_kernel");
  }
  const int planes = tc_operand_planes(d.intermediate_format);
  bool fused = false;
  MOE_EP_TRY(fc1_epilogue_fused(&fused));
  Fc1SwigluProblem f1;
  if (fused && !wt.coded() &&
      fc1_fused_problem(d, x, w, wt.fc1, ws.offsets, group_sizes, ws.left, fc1_c, &f1) &&
      fc1_swiglu_gemm_workspace_bytes(f1, ws.sm_count) <= ws.gemm_bytes) {
    // One GEMM: h (the FC2 operand, one bf16 plane) and the stash from FC1's accumulator; the
    // rows past the slabs are zeroed here, as the pass zeroes them.
    MOE_EP_TRY(gemm_status(fc1_swiglu_gemm(f1, ws.gemm, ws.gemm_bytes, s, ws.sm_count), "FC1 with SwiGLU"));
    (void)launch_pdl(zero_tail_rows_kernel, tail_blocks(C * I / 2, ws), kThreads, 0, s,
                     reinterpret_cast<float*>(ws.left), ws.offsets, E, C, I / 2);
    MOE_EP_CUDA_CHECK_LAUNCH("zero_tail_rows_kernel (FC2 operand)");
    if (fc1_c != nullptr) {
      (void)launch_pdl(zero_tail_rows_kernel, tail_blocks(C * I, ws), kThreads, 0, s, reinterpret_cast<float*>(fc1_c),
                       ws.offsets, E, C, I);
      MOE_EP_CUDA_CHECK_LAUNCH("zero_tail_rows_kernel (stash)");
    }
  } else {
    MOE_EP_TRY(gemm.forward(2 * I, H, x, wt.fc1, wt, wt.fc1_codes, wt.fc1_scales, ws.c, false, "FC1", nullptr, 1, 0,
                            group_sizes));
    const SwigluParams p{C, I, d.apply_topk_in_fc1, d.has_clamp, d.gate_up_clamp};
    const unsigned b1 = blocks_for(C * div_up(I, block_of_format(d.intermediate_format)));
    launch_fc1_epilogue(d.intermediate_format, b1, s, ws.c, w, ws.offsets, E, fc1_c, ws.left, planes, p);
    MOE_EP_CUDA_CHECK_LAUNCH("fc1_epilogue_kernel");
  }

  const bool weight = !d.apply_topk_in_fc1;
  if (bf16_out && fc2_writes_bf16(d, combine_format)) {
    // Nothing happens to the FC2 output but its bf16 rounding (the combine round trip):
    // the GEMM writes the bf16 rows itself; rows of no expert are zeroed (as float pairs).
    MOE_EP_TRY(gemm.forward(H, I, ws.left, wt.fc2, wt, wt.fc2_codes, wt.fc2_scales, nullptr, false, "FC2",
                            static_cast<uint16_t*>(y_out)));
    if (tail_deferred != nullptr) {
      *tail_deferred = true;
      return MOE_EP_OK;
    }
    (void)launch_pdl(zero_tail_rows_kernel, tail_blocks(C * H / 2, ws), kThreads, 0, s, static_cast<float*>(y_out),
                     ws.offsets, E, C, H / 2);
    MOE_EP_CUDA_CHECK_LAUNCH("zero_tail_rows_kernel");
    return MOE_EP_OK;
  }
  float* y = bf16_out ? ws.y32 : static_cast<float*>(y_out);
  if (wt.fc2_codes != nullptr) {  // every plane in one call: the weights decoded once at few rows
    MOE_EP_TRY(gemm.forward(H, I, ws.left, wt.fc2, wt, wt.fc2_codes, wt.fc2_scales, y, false, "FC2", nullptr,
                            planes, C * I));
  } else {
    for (int pl = 0; pl < planes; ++pl)
      MOE_EP_TRY(gemm.forward(H, I, ws.left + static_cast<int64_t>(pl) * C * I, wt.fc2, wt, wt.fc2_codes,
                              wt.fc2_scales, y, pl > 0, "FC2"));
  }

  if (bf16_out && combine_format == MOE_EP_FORMAT_NVFP4) {  // nvfp4's values are bf16 values (exact)
    // H is a multiple of 16 (the layer's configuration check): no block crosses a row.
    const unsigned b = blocks_for(C * (H / 4));
    float4* z4 = reinterpret_cast<float4*>(y);
    uint2* y2 = static_cast<uint2*>(y_out);
    with_flag(weight, [&](auto kW) {
      (void)launch_pdl(fc2_epilogue_block_vec4_kernel<MOE_EP_FORMAT_NVFP4, decltype(kW)::value, true>, b, kThreads, 0,
                       s, z4, w, ws.offsets, E, C, H, y2);
    });
    MOE_EP_CUDA_CHECK_LAUNCH("fc2_epilogue_block_vec4_kernel (bf16 rows)");
    return MOE_EP_OK;
  }
  if (bf16_out) {  // combine_format bf16 (the layer checked it); H is a multiple of 8 (the GEMMs need it)
    const unsigned b = blocks_for(C * (H / 4));
    float4* z4 = reinterpret_cast<float4*>(y);
    uint2* y2 = static_cast<uint2*>(y_out);
    with_flag(weight, [&](auto kW) {
      (void)launch_pdl(fc2_epilogue_vec4_kernel<Vec4Store::kBf16Rows, decltype(kW)::value>, b, kThreads, 0, s, z4, w,
                       ws.offsets, E, C, H, y2);
    });
    MOE_EP_CUDA_CHECK_LAUNCH("fc2_epilogue_vec4_kernel (bf16 rows)");
    return MOE_EP_OK;
  }
  if (!bf16_out && combine_format == MOE_EP_FORMAT_NONE && !weight) {
    // Nothing happens to the FC2 output (no router weight, no rounding): the GEMM's rows
    // are y; only the rows of no expert are zeroed (not a pass over all of y).
    if (tail_deferred != nullptr) {
      *tail_deferred = true;
      return MOE_EP_OK;
    }
    (void)launch_pdl(zero_tail_rows_kernel, tail_blocks(C * H, ws), kThreads, 0, s, y, ws.offsets, E, C, H);
    MOE_EP_CUDA_CHECK_LAUNCH("zero_tail_rows_kernel");
    return MOE_EP_OK;
  }
  const unsigned b2 = blocks_for(C * div_up(H, block_of_format(combine_format)));
  launch_fc2_epilogue(combine_format, b2, s, y, w, ws.offsets, E, C, H, weight);
  MOE_EP_CUDA_CHECK_LAUNCH("fc2_epilogue_kernel");
  return MOE_EP_OK;
}

namespace {

// The bf16-operand backward (backward_operand_format bf16): four bf16 grouped GEMMs and
// one fused SwiGLU pass (C > 0, the slab offsets computed).
moe_ep_status tc_backward_bf16(cudaStream_t s, const moe_ep_expert_desc& d, const uint16_t* x, const float* w,
                               const uint16_t* fc1, const uint16_t* fc2, const uint16_t* fc1_c, const void* dy,
                               int32_t dy_dtype, float* dx, float* dw, void* dfc1, void* dfc2,
                               const TcWorkspace& ws, const BackwardOptions& opt) {
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate;
  const int E = static_cast<int>(d.num_local_experts);
  const Gemm gemm{d, ws, s};
  // R_bf16(dY): a bf16 cotangent is its own rounding (copied only when the GEMMs' 16-byte
  // loads cannot read it where it lies); a float32 one is encoded once.
  const uint16_t* right = static_cast<const uint16_t*>(dy);
  if (dy_dtype != MOE_EP_DTYPE_BF16) {
    MOE_EP_TRY(quantize(s, MOE_EP_FORMAT_BF16, static_cast<const float*>(dy), C, H, 1, ws.right, nullptr));
    right = ws.right;
  } else if (!aligned16(dy)) {
    MOE_EP_TRY(gemm_status(cudaMemcpyAsync(ws.right, dy, static_cast<size_t>(C * H) * sizeof(uint16_t),
                                           cudaMemcpyDeviceToDevice, s),
                           "copy of the bf16 cotangent"));
    right = ws.right;
  }
  MOE_EP_TRY(gemm.run(GemmLayout::kNT, 0, I, H, right, fc2, ws.a, false, "R(dY) W2^T"));
  const SwigluParams p{C, I, d.apply_topk_in_fc1, d.has_clamp, d.gate_up_clamp};
  const bool vec = I % 4 == 0 && reinterpret_cast<uintptr_t>(fc1_c) % 8 == 0 && aligned16(ws.a) &&
                   aligned16(ws.dc) && aligned16(ws.left);
  const bool dx_vec = H % 4 == 0 && aligned16(dx);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(C, int64_t{std::max(ws.sm_count, 1)} * 16));
  if (vec)
    swiglu_backward_bf16_kernel<true><<<grid, kFusedThreads, 0, s>>>(fc1_c, ws.a, w, ws.offsets, E, ws.dc, ws.left,
                                                                      dw, dx, H, dx_vec, p);
  else
    swiglu_backward_bf16_kernel<false><<<grid, kFusedThreads, 0, s>>>(fc1_c, ws.a, w, ws.offsets, E, ws.dc, ws.left,
                                                                       dw, dx, H, dx_vec, p);
  MOE_EP_CUDA_CHECK_LAUNCH("swiglu_backward_bf16_kernel");
  // The weight gradients: float32 (added to dfc with accumulate), or bf16 rounded in the GEMMs' epilogue.
  const bool b = opt.bf16_weight_grads;
  MOE_EP_TRY(gemm.run(GemmLayout::kTN, I, H, 0, ws.left, right, b ? nullptr : static_cast<float*>(dfc2),
                      opt.accumulate, "R(w h)^T R(dY)", b ? static_cast<uint16_t*>(dfc2) : nullptr));
  MOE_EP_TRY(gemm.run(GemmLayout::kTN, H, 2 * I, 0, x, ws.dc, b ? nullptr : static_cast<float*>(dfc1), opt.accumulate,
                      "x^T R(dc)", b ? static_cast<uint16_t*>(dfc1) : nullptr));
  return gemm.run(GemmLayout::kNT, 0, H, 2 * I, ws.dc, fc1, dx, false, "R(dc) W1^T");
}

}  // namespace

moe_ep_status tc_backward(void* stream, const moe_ep_expert_desc& d, const uint16_t* x, const float* w,
                          const uint16_t* fc1, const uint16_t* fc2, const uint16_t* fc1_c, const void* dy,
                          int32_t dy_dtype, const int32_t* group_sizes, float* dx, float* dw, void* dfc1, void* dfc2,
                          const TcWorkspace& ws, const BackwardOptions& opt) {
  const cudaStream_t s = as_stream(stream);
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate, E64 = d.num_local_experts;
  const int E = static_cast<int>(E64);
  if (C == 0) {
    // No rows: the weight gradients are zero (nothing added when accumulating; bf16 zeros are zero bits).
    if (opt.accumulate) return MOE_EP_OK;
    const size_t elem = opt.bf16_weight_grads ? sizeof(uint16_t) : sizeof(float);
    cudaError_t err = cudaMemsetAsync(dfc1, 0, static_cast<size_t>(E64 * H * 2 * I) * elem, s);
    if (err == cudaSuccess) err = cudaMemsetAsync(dfc2, 0, static_cast<size_t>(E64 * I * H) * elem, s);
    return gemm_status(err, "zero weight gradients");
  }
  const Gemm gemm{d, ws, s};
  slab_offsets_kernel<<<1, 1, 0, s>>>(group_sizes, E, C, ws.offsets);
  MOE_EP_CUDA_CHECK_LAUNCH("slab_offsets_kernel");
  if (opt.bf16_operands)
    return tc_backward_bf16(s, d, x, w, fc1, fc2, fc1_c, dy, dy_dtype, dx, dw, dfc1, dfc2, ws, opt);
  const bool in_fc1 = d.apply_topk_in_fc1 != 0;
  // right = dY (weight in FC1) or w dY (weight in FC2), as planes: one plane when it is
  // a bf16 cotangent itself (weight in FC1), whose rows of no expert are never read.
  const bool bf16_dy = dy_dtype == MOE_EP_DTYPE_BF16;
  const int right_planes = (bf16_dy && in_fc1) ? 1 : kPlanes;
  const uint16_t* right = ws.right;
  float* dy32 = ws.z;  // a bf16 cotangent decoded (weight in FC2: dw needs dY in float32)
  if (bf16_dy && in_fc1) {
    right = static_cast<const uint16_t*>(dy);
  } else if (bf16_dy) {
    bf16_to_float_kernel<<<blocks_for(C * H), kThreads, 0, s>>>(static_cast<const uint16_t*>(dy), C * H, ws.dy32);
    MOE_EP_CUDA_CHECK_LAUNCH("bf16_to_float_kernel");
    dy32 = ws.dy32;
    split_rows_kernel<<<blocks_for(C * H), kThreads, 0, s>>>(dy32, w, ws.offsets, E, C, H, ws.right);
  } else {
    dy32 = const_cast<float*>(static_cast<const float*>(dy));
    split_rows_kernel<<<blocks_for(C * H), kThreads, 0, s>>>(dy32, in_fc1 ? nullptr : w, ws.offsets, E, C, H,
                                                              ws.right);
  }
  MOE_EP_CUDA_CHECK_LAUNCH("split_rows_kernel");
  const int64_t rp = C * H, lp = C * I, dp = C * 2 * I;  // plane strides
  for (int pl = 0; pl < right_planes; ++pl)
    MOE_EP_TRY(gemm.run(GemmLayout::kNT, 0, I, H, right + pl * rp, fc2, ws.a, pl > 0, "dY W2^T"));
  const SwigluParams p{C, I, d.apply_topk_in_fc1, d.has_clamp, d.gate_up_clamp};
  swiglu_backward_tc_kernel<<<blocks_for(C * I), kThreads, 0, s>>>(fc1_c, ws.a, w, ws.offsets, E, ws.h, ws.dc,
                                                                    ws.left, p);
  MOE_EP_CUDA_CHECK_LAUNCH("swiglu_backward_tc_kernel");
  // dW2 = left^T right over the eight largest plane pairs (all but lo x lo), largest first, of the
  // experts [g0, g0 + groups) into out2 ([groups, I, H] float32); dW1 = x^T dc into out1.
  auto weight_grads = [&](int32_t g0, int32_t groups, float* out2, float* out1, bool acc) -> moe_ep_status {
    static const int kPairs[8][2] = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {0, 2}, {2, 0}, {1, 2}, {2, 1}};
    int q_done = 0;
    for (int q = 0; q < 8; ++q) {
      if (kPairs[q][1] >= right_planes) continue;
      MOE_EP_TRY(gemm.run(GemmLayout::kTN, I, H, 0, ws.left + kPairs[q][0] * lp, right + kPairs[q][1] * rp, out2,
                          q_done++ > 0 || acc, "dW2", nullptr, g0, groups));
    }
    if (out1 == nullptr) return MOE_EP_OK;
    for (int pl = 0; pl < kPlanes; ++pl)
      MOE_EP_TRY(gemm.run(GemmLayout::kTN, H, 2 * I, 0, x, ws.dc + pl * dp, out1, pl > 0 || acc, "dW1", nullptr, g0,
                          groups));
    return MOE_EP_OK;
  };
  if (!opt.bf16_weight_grads) {
    MOE_EP_TRY(weight_grads(0, E, static_cast<float*>(dfc2), static_cast<float*>(dfc1), opt.accumulate));
  } else {
    // bf16 weight gradients: the plane sums need a float32 accumulator, so ws.wgrad32_experts
    // experts at a time into ws.wgrad32 (sized at creation), each group rounded once into
    // dfc2 / dfc1.
    uint16_t* o2 = static_cast<uint16_t*>(dfc2);
    uint16_t* o1 = static_cast<uint16_t*>(dfc1);
    const int32_t step = std::max(ws.wgrad32_experts, 1);
    for (int32_t e = 0; e < E; e += step) {
      const int32_t n = std::min(step, E - e);
      MOE_EP_TRY(weight_grads(e, n, ws.wgrad32, nullptr, false));
      MOE_EP_TRY(quantize(s, MOE_EP_FORMAT_BF16, ws.wgrad32, n * I, H, 1, o2 + e * I * H, nullptr));
      for (int pl = 0; pl < kPlanes; ++pl)
        MOE_EP_TRY(gemm.run(GemmLayout::kTN, H, 2 * I, 0, x, ws.dc + pl * dp, ws.wgrad32, pl > 0, "dW1", nullptr, e, n));
      MOE_EP_TRY(quantize(s, MOE_EP_FORMAT_BF16, ws.wgrad32, n * H, 2 * I, 1, o1 + e * H * 2 * I, nullptr));
    }
  }
  // dx = dc W1^T.
  for (int pl = 0; pl < kPlanes; ++pl)
    MOE_EP_TRY(gemm.run(GemmLayout::kNT, 0, H, 2 * I, ws.dc + pl * dp, fc1, dx, pl > 0, "dc W1^T"));
  zero_tail_rows_kernel<<<tail_blocks(C * H, ws), kThreads, 0, s>>>(dx, ws.offsets, E, C, H);
  MOE_EP_CUDA_CHECK_LAUNCH("zero_tail_rows_kernel");
  // dw: <a, h> (weight in FC1, a = dY W2^T) or <dY, h W2> (weight in FC2).
  const unsigned rows_grid = static_cast<unsigned>(std::min<int64_t>(C, 65535));
  if (in_fc1) {
    row_dot_kernel<<<rows_grid, kDotThreads, 0, s>>>(ws.a, ws.h, ws.offsets, E, C, I, dw);
  } else {
    // h as planes into `left` (it holds h already when the weight is in FC2), z = h W2.
    for (int pl = 0; pl < kPlanes; ++pl)
      MOE_EP_TRY(gemm.run(GemmLayout::kNN, 0, H, I, ws.left + pl * lp, fc2, ws.z, pl > 0, "h W2"));
    row_dot_kernel<<<rows_grid, kDotThreads, 0, s>>>(dy32, ws.z, ws.offsets, E, C, H, dw);
  }
  MOE_EP_CUDA_CHECK_LAUNCH("row_dot_kernel");
  return MOE_EP_OK;
}

moe_ep_status round_trip_rows(void* stream, int32_t fmt, float* y, int64_t rows, int64_t n) {
  if (fmt == MOE_EP_FORMAT_NONE || rows == 0 || n == 0) return MOE_EP_OK;
  const cudaStream_t s = as_stream(stream);
  const unsigned b = blocks_for(rows * div_up(n, block_of_format(fmt)));
  launch_fc2_epilogue(fmt, b, s, y, nullptr, nullptr, 0, rows, n, false);
  MOE_EP_CUDA_CHECK_LAUNCH("fc2_epilogue_kernel (round trip)");
  return MOE_EP_OK;
}

// p[0, n) NaN (bf16 or float32 quiet NaN), grid-stride.
__device__ __forceinline__ void fill_nan(void* __restrict__ p, int64_t n, bool bf16) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < n; t += int64_t{gridDim.x} * blockDim.x) {
    if (bf16) static_cast<uint16_t*>(p)[t] = 0x7FC0;
    else static_cast<float*>(p)[t] = __int_as_float(0x7fc00000);
  }
}

__global__ void nan_on_error_kernel(const int32_t* __restrict__ error, void* __restrict__ p, int64_t n, bool bf16) {
  if (*error == 0) return;
  fill_nan(p, n, bf16);
}

moe_ep_status nan_on_error(void* stream, const int32_t* error, void* p, int64_t n, int32_t dtype) {
  if (n == 0 || p == nullptr) return MOE_EP_OK;
  const unsigned blocks = std::min(blocks_for(n), 1024u);  // a no-op launch when there is no error
  nan_on_error_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(error, p, n, dtype == MOE_EP_DTYPE_BF16);
  MOE_EP_CUDA_CHECK_LAUNCH("nan_on_error_kernel");
  return MOE_EP_OK;
}

__global__ void finish_forward_kernel(const int32_t* __restrict__ error, const int32_t* __restrict__ off,
                                      const int32_t* __restrict__ valid, int64_t groups, uint16_t* __restrict__ stash,
                                      int64_t rows, int64_t cols, void* __restrict__ y, int64_t y_count, bool y_bf16,
                                      const int32_t* __restrict__ tail_off) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  if (*error != 0) {  // everything NaN, the stash's padding included
    fill_nan(y, y_count, y_bf16);
    fill_nan(stash, stash != nullptr ? rows * cols : 0, true);
    return;
  }
  if (tail_off != nullptr && rows > 0) {  // y's rows past the last slab: zero bytes [b0, b1)
    const int64_t elem = y_bf16 ? 2 : 4, row_bytes = y_count / rows * elem;
    const int64_t b0 = min(max(static_cast<int64_t>(*tail_off), int64_t{0}), rows) * row_bytes, b1 = rows * row_bytes;
    const int64_t stride = int64_t{gridDim.x} * blockDim.x, first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
    char* yb = static_cast<char*>(y);
    if (b0 % 16 == 0 && b1 % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0) {
      for (int64_t t = b0 / 16 + first; t < b1 / 16; t += stride)
        reinterpret_cast<uint4*>(yb)[t] = make_uint4(0u, 0u, 0u, 0u);
    } else {
      for (int64_t t = b0 + first; t < b1; t += stride) yb[t] = 0;
    }
  }
  if (stash == nullptr || groups == 0) return;
  // Each group's padding rows (only they are touched) by gridDim.x / groups blocks of their own
  // (at least one: then a block takes every gridDim.x-th group), 16-byte stores when rows are
  // whole vectors. (Every thread walking every group's bounds cost run 51 18.5 us.)
  const bool vec = cols % 8 == 0 && reinterpret_cast<uintptr_t>(stash) % 16 == 0;
  const int64_t per = vec ? cols / 8 : cols;  // stores a row
  const int64_t slices = gridDim.x >= groups ? gridDim.x / groups : 1;
  for (int64_t b = blockIdx.x; b < groups * slices; b += gridDim.x) {
    const int64_t g = b % groups, slice = b / groups;
    const int64_t end = min(static_cast<int64_t>(off[g + 1]), rows);
    const int64_t start = min(static_cast<int64_t>(off[g]) + valid[g], end);
    for (int64_t t = start * per + slice * blockDim.x + threadIdx.x; t < end * per; t += slices * blockDim.x) {
      if (vec) reinterpret_cast<uint4*>(stash)[t] = make_uint4(0u, 0u, 0u, 0u);
      else stash[t] = 0;
    }
  }
}

moe_ep_status finish_forward(void* stream, const int32_t* error, const int32_t* off, const int32_t* valid,
                             int64_t groups, uint16_t* stash, int64_t rows, int64_t stash_cols, void* y,
                             int64_t y_count, int32_t y_dtype, const int32_t* tail_off) {
  const int64_t s_count = stash != nullptr ? rows * stash_cols : 0;
  if (y_count + s_count == 0) return MOE_EP_OK;
  // Enough blocks for the NaN pass (a no-op when there is no error) and the padding's zeros.
  const unsigned blocks = std::min(blocks_for(y_count + s_count), 1024u);
  (void)launch_pdl(finish_forward_kernel, blocks, kThreads, 0, as_stream(stream), error, off, valid, groups, stash,
                   rows, stash_cols, y, y_count, y_dtype == MOE_EP_DTYPE_BF16, y != nullptr ? tail_off : nullptr);
  MOE_EP_CUDA_CHECK_LAUNCH("finish_forward_kernel");
  return MOE_EP_OK;
}

moe_ep_status device_alloc(int cuda_device, size_t bytes, void** out) {
  *out = nullptr;
  if (bytes == 0) return MOE_EP_OK;
  cudaError_t err = cudaSetDevice(cuda_device);
  if (err == cudaSuccess) err = cudaMalloc(out, bytes);
  // Zeroed once, at creation: no stage ever reads memory that nothing wrote (the grouped
  // GEMMs' own workspace included, which CUTLASS may read before it writes all of it).
  if (err == cudaSuccess) err = cudaMemset(*out, 0, bytes);
  if (err != cudaSuccess) {
    if (*out != nullptr) cudaFree(*out);
    *out = nullptr;
    return fail(MOE_EP_ERR_CUDA, "moe_ep_layer_create: allocating and zeroing " + std::to_string(bytes) + " bytes on device " +
                                     std::to_string(cuda_device) + " failed: " + cudaGetErrorName(err) + ": " +
                                     cudaGetErrorString(err));
  }
  return MOE_EP_OK;
}

moe_ep_status device_free(void* p) {
  if (p == nullptr) return MOE_EP_OK;
  const cudaError_t err = cudaFree(p);
  if (err != cudaSuccess)
    return fail(MOE_EP_ERR_CUDA, std::string("moe_ep_layer_destroy: cudaFree failed: ") + cudaGetErrorName(err) + ": " +
                                     cudaGetErrorString(err));
  return MOE_EP_OK;
}

moe_ep_status device_props(int cuda_device, int* sm_count, bool* is_sm90) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, cuda_device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, cuda_device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, cuda_device);
  if (err != cudaSuccess)
    return fail(MOE_EP_ERR_CUDA, "moe_ep_layer_create: cannot query CUDA device " + std::to_string(cuda_device) + ": " +
                                     cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  *is_sm90 = major == 9 && minor == 0;
  return MOE_EP_OK;
}

}  // namespace cuda
}  // namespace moe_ep
