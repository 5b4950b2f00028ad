// CUDA grouped SwiGLU expert MLP, forward and backward (docs/spec.md 5 and 9.2),
// the math of moe_ep_jax.kernels.XlaKernels and of src/cpu/experts.cc.
//
// Rows of the [C, ...] buffers are expert-major: local expert e owns rows
// [off[e], off[e + 1]), off the exclusive prefix sum of group_sizes (a negative
// size counts as 0, slabs end at C), computed on the device into the workspace.
// Rows from off[E] on belong to no expert: their y, c, dx and dw are zero.
//
// GEMMs are plain float32 shared-memory tiled products (no tensor cores, no
// TF32); every output is one float32 accumulator summed in ascending order of
// the contracted index from +0, each product rounded before it is added (no
// fused multiply-add), i.e. the same order as the CPU loops.
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/format_math.cuh"
#include "cuda/swiglu.cuh"
#include "internal.h"

namespace moe_ep {
namespace cuda {
namespace {

using namespace detail;

// ------------------------------------------------------------------ GEMM tiles

constexpr int kBM = 64;   // tile rows
constexpr int kBN = 64;   // tile columns
constexpr int kBK = 16;   // contracted slice per shared-memory stage
constexpr int kGemmThreads = 256;  // 16 x 16 threads, each a 4 x 4 register tile
constexpr int kMaxGridY = 65535;

// One shared-memory stage of a tile: acc[i][j] += As[kk][ty + 16 i] * Bs[kk][tx + 16 j]
// for kk = 0 .. kBK - 1 in that order, each product rounded before it is added.
__device__ __forceinline__ void accumulate_stage(const float (&As)[kBK][kBM + 1], const float (&Bs)[kBK][kBN + 1],
                                                 int tx, int ty, float (&acc)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < kBK; ++kk) {
    float a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fadd(acc[i][j], fmul(a[i], b[j]));
  }
}

// Grouped GEMM over the row slabs:
//   out[r, n] = scale(r) * sum_k A[r, k] * B_e[k, n]   for r in slab e,
//   out[r, n] = 0                                       for r >= off[E],
// with B_e[k, n] = B[e * b_stride + k * ldb + n], or B[e * b_stride + n * ldb + k]
// when kTransB (dY W2^T, dc W1^T); scale(r) = row_scale[r] when row_scale is not
// NULL (y = w * z), else 1.
// Block (x = row tile, y = column tile, strided): the rows of the tile can span
// several slabs; the block visits each intersecting slab in turn and computes
// its rows with that expert's weights. Thread (ty, tx) owns rows ty + 16 i and
// columns tx + 16 j (i, j < 4) of the tile.
template <bool kTransB>
__global__ void __launch_bounds__(kGemmThreads)
    grouped_gemm_kernel(const float* __restrict__ A, int64_t lda, const float* __restrict__ B, int64_t ldb,
                        int64_t b_stride, const float* __restrict__ row_scale, const int64_t* __restrict__ off,
                        int num_experts, int64_t M, int64_t N, int64_t K, float* __restrict__ out, int64_t ldc) {
  __shared__ float As[kBK][kBM + 1];
  __shared__ float Bs[kBK][kBN + 1];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kBM;
  const int64_t r1 = r0 + kBM < M ? r0 + kBM : M;
  const int64_t end = off[num_experts];
  // First expert whose slab ends after r0 (off is non-decreasing).
  int first = 0;
  {
    int hi = num_experts;
    while (first < hi) {
      const int mid = (first + hi) >> 1;
      if (off[mid + 1] > r0) hi = mid;
      else first = mid + 1;
    }
  }
  const int64_t n_tiles = div_up(N, kBN);
  for (int64_t ct = blockIdx.y; ct < n_tiles; ct += gridDim.y) {
    const int64_t n0 = ct * kBN;
    // Rows of no expert: zero.
    if (end < r1) {
      for (int idx = tid; idx < kBM * kBN; idx += kGemmThreads) {
        const int64_t r = r0 + idx / kBN, n = n0 + idx % kBN;
        if (r >= end && r < r1 && n < N) out[r * ldc + n] = 0.0f;
      }
    }
    for (int e = first; e < num_experts; ++e) {
      const int64_t slab_lo = off[e], slab_hi = off[e + 1];
      if (slab_lo >= r1) break;
      const int64_t s_lo = slab_lo > r0 ? slab_lo : r0;
      const int64_t s_hi = slab_hi < r1 ? slab_hi : r1;
      if (s_lo >= s_hi) continue;  // (block-uniform)
      const float* Be = B + static_cast<int64_t>(e) * b_stride;
      float acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

      for (int64_t k0 = 0; k0 < K; k0 += kBK) {
        // A tile [kBM rows][kBK]: consecutive threads read consecutive k of one row.
#pragma unroll
        for (int l = 0; l < (kBM * kBK) / kGemmThreads; ++l) {
          const int idx = tid + l * kGemmThreads;
          const int kk = idx % kBK, mm = idx / kBK;
          const int64_t r = r0 + mm, k = k0 + kk;
          As[kk][mm] = (r >= s_lo && r < s_hi && k < K) ? A[r * lda + k] : 0.0f;
        }
        // B tile [kBK][kBN]: consecutive threads read consecutive memory.
#pragma unroll
        for (int l = 0; l < (kBK * kBN) / kGemmThreads; ++l) {
          const int idx = tid + l * kGemmThreads;
          int kk, nn;
          if (kTransB) {
            kk = idx % kBK;
            nn = idx / kBK;
          } else {
            nn = idx % kBN;
            kk = idx / kBN;
          }
          const int64_t k = k0 + kk, n = n0 + nn;
          float v = 0.0f;
          if (k < K && n < N) v = kTransB ? Be[n * ldb + k] : Be[k * ldb + n];
          Bs[kk][nn] = v;
        }
        __syncthreads();
        accumulate_stage(As, Bs, tx, ty, acc);
        __syncthreads();
      }
      // (Padding past K added +0 products: acc never is -0, so nothing changed.)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t r = r0 + ty + 16 * i;
        if (r < s_lo || r >= s_hi) continue;
        const float sc = row_scale != nullptr ? row_scale[r] : 1.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t n = n0 + tx + 16 * j;
          if (n < N) out[r * ldc + n] = row_scale != nullptr ? fmul(sc, acc[i][j]) : acc[i][j];
        }
      }
    }
  }
}

// Grouped weight gradient, a reduction over each slab's rows:
//   out[e, m, n] = sum_{r in slab e} A'[r, m] * B'[r, n]   (rows ascending),
// A'[r, m] = a_scale[r] * A[r * lda + m] when a_scale is set (w * h), else A, then
// rounded to bf16 when kRoundA (R_bf16(w h) of the bf16-operand backward);
// B' likewise (w * dY), never rounded. Zero for an expert with no rows; with
// accumulate, out += that sum instead (one float32 addition an element).
// Block (x = column tile, y = row tile, z = expert; y and z strided).
template <bool kRoundA>
__global__ void __launch_bounds__(kGemmThreads)
    grouped_wgrad_kernel(const float* __restrict__ A, int64_t lda, const float* __restrict__ a_scale,
                         const float* __restrict__ B, int64_t ldb, const float* __restrict__ b_scale,
                         const int64_t* __restrict__ off, int num_experts, int64_t M, int64_t N,
                         float* __restrict__ out, bool accumulate) {
  __shared__ float As[kBK][kBM + 1];
  __shared__ float Bs[kBK][kBN + 1];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBN;
  const int64_t m_tiles = div_up(M, kBM);
  for (int e = blockIdx.z; e < num_experts; e += gridDim.z) {
    const int64_t s_lo = off[e], s_hi = off[e + 1];
    float* oe = out + static_cast<int64_t>(e) * M * N;
    for (int64_t mt = blockIdx.y; mt < m_tiles; mt += gridDim.y) {
      const int64_t m0 = mt * kBM;
      float acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

      for (int64_t k0 = s_lo; k0 < s_hi; k0 += kBK) {
        // Both tiles [kBK rows][64 columns]: consecutive threads read consecutive columns.
#pragma unroll
        for (int l = 0; l < (kBK * kBM) / kGemmThreads; ++l) {
          const int idx = tid + l * kGemmThreads;
          const int mm = idx % kBM, kk = idx / kBM;
          const int64_t r = k0 + kk, m = m0 + mm;
          float v = 0.0f;
          if (r < s_hi && m < M) {
            v = A[r * lda + m];
            if (a_scale != nullptr) v = fmul(a_scale[r], v);
            if (kRoundA) v = bf16_round_trip(v);
          }
          As[kk][mm] = v;
        }
#pragma unroll
        for (int l = 0; l < (kBK * kBN) / kGemmThreads; ++l) {
          const int idx = tid + l * kGemmThreads;
          const int nn = idx % kBN, kk = idx / kBN;
          const int64_t r = k0 + kk, n = n0 + nn;
          float v = 0.0f;
          if (r < s_hi && n < N) {
            v = B[r * ldb + n];
            if (b_scale != nullptr) v = fmul(b_scale[r], v);
          }
          Bs[kk][nn] = v;
        }
        __syncthreads();
        // Rows past the slab are zero in both tiles and add +0 products, which
        // change nothing (an accumulator that starts at +0 is never -0).
        accumulate_stage(As, Bs, tx, ty, acc);
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t m = m0 + ty + 16 * i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t n = n0 + tx + 16 * j;
          if (n < N) oe[m * N + n] = accumulate ? fadd(oe[m * N + n], acc[i][j]) : acc[i][j];
        }
      }
    }
  }
}

// ------------------------------------------------------------------ SwiGLU

// Forward operand op = R_int(w * h or h), [C, I]. kFmt NONE / BF16: one thread
// per element (identity / bf16 round trip). MXFP8 / NVFP4: one thread per
// (row, block of 32 / 16 along I): writes the block's unrounded operand, then
// rounds it in place (quantize + dequantize, partial last block included).
template <int kFmt>
__global__ void swiglu_operand_kernel(const float* __restrict__ c, const float* __restrict__ w, float* __restrict__ op,
                                      SwigluParams p) {
  constexpr int kBlock = kFmt == MOE_EP_FORMAT_MXFP8 ? 32 : (kFmt == MOE_EP_FORMAT_NVFP4 ? 16 : 1);
  const int64_t I = p.I;
  const int64_t nb = div_up(I, kBlock);
  const int64_t total = p.C * nb;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = t / nb, b = t - r * nb;
    const int64_t k0 = b * kBlock;
    const int len = static_cast<int>(I - k0 < kBlock ? I - k0 : kBlock);
    const float* cr = c + r * 2 * I;
    float* o = op + r * I + k0;
    const float wr = w[r];
    for (int j = 0; j < len; ++j) o[j] = swiglu_operand(cr[k0 + j], cr[I + k0 + j], wr, p);
    if constexpr (kFmt == MOE_EP_FORMAT_BF16) {
      o[0] = bf16_round_trip(o[0]);
    } else if constexpr (kFmt == MOE_EP_FORMAT_MXFP8) {
      mxfp8_round_trip_block(o, len);
    } else if constexpr (kFmt == MOE_EP_FORMAT_NVFP4) {
      nvfp4_round_trip_block(o, len);
    }
  }
}

// Backward, one thread per element (r, i): from the bf16 stash c~ = fc1_c,
//   m_g = [g~ <= L], m_u = [-L <= u~ <= L] (1 without a clamp), g, u clamped,
//   sig = sigmoid(g), s = g sig, h = s u            -> h[r, i]
//   dh = a w, dg = dh u sig (1 + g (1 - sig)) m_g, du = dh s m_u -> dc[r, i], dc[r, I + i]
// evaluated left to right as in the reference (masks multiply: NaN stays NaN).
// round_dc (the bf16-operand backward): dc is stored as R_bf16(dc).
__global__ void swiglu_backward_kernel(const uint16_t* __restrict__ fc1_c, const float* __restrict__ a,
                                       const float* __restrict__ w, float* __restrict__ h, float* __restrict__ dc,
                                       SwigluParams p, bool round_dc) {
  const int64_t I = p.I;
  const int64_t total = p.C * I;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = t / I, i = t - r * I;
    const float g_raw = bf16_to_float(fc1_c[r * 2 * I + i]);
    const float u_raw = bf16_to_float(fc1_c[r * 2 * I + I + i]);
    const SwigluGrad gr = swiglu_grad(g_raw, u_raw, fmul(a[t], w[r]), p);
    h[t] = gr.h;
    dc[r * 2 * I + i] = round_dc ? bf16_round_trip(gr.dg) : gr.dg;
    dc[r * 2 * I + I + i] = round_dc ? bf16_round_trip(gr.du) : gr.du;
  }
}

// out[t] = R_bf16(in[t]) (the bf16-operand backward's cotangent).
__global__ void round_bf16_kernel(const float* __restrict__ in, int64_t n, float* __restrict__ out) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < n; t += int64_t{gridDim.x} * blockDim.x)
    out[t] = bf16_round_trip(in[t]);
}

// dw[r] = sum_j P[r, j] * Q[r, j] (j ascending, from +0) for r < off[E]; 0 for
// the rows of no expert. A block owns 32 rows: its 256 threads stage the
// products of a 32 x 32 tile in shared memory (coalesced loads), then thread
// r (< 32) adds its row's 32 products in order.
constexpr int kDotRows = 32;
__global__ void __launch_bounds__(kThreads)
    row_dot_kernel(const float* __restrict__ P, const float* __restrict__ Q, int64_t C, int64_t L,
                   const int64_t* __restrict__ off, int num_experts, float* __restrict__ dw) {
  __shared__ float tile[kDotRows][kDotRows + 1];
  const int tid = threadIdx.x;
  const int64_t end = off[num_experts];
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kDotRows; r0 < C; r0 += static_cast<int64_t>(gridDim.x) * kDotRows) {
    float acc = 0.0f;
    for (int64_t c0 = 0; c0 < L; c0 += kDotRows) {
      for (int idx = tid; idx < kDotRows * kDotRows; idx += blockDim.x) {
        const int rr = idx / kDotRows, cc = idx % kDotRows;
        const int64_t r = r0 + rr, col = c0 + cc;
        tile[rr][cc] = (r < C && col < L) ? fmul(P[r * L + col], Q[r * L + col]) : 0.0f;
      }
      __syncthreads();
      if (tid < kDotRows) {
        const int n = L - c0 < kDotRows ? static_cast<int>(L - c0) : kDotRows;
        for (int cc = 0; cc < n; ++cc) acc = fadd(acc, tile[tid][cc]);
      }
      __syncthreads();
    }
    const int64_t r = r0 + tid;
    if (tid < kDotRows && r < C) dw[r] = r < end ? acc : 0.0f;
  }
}

// ------------------------------------------------------------------ launchers

moe_ep_status launch_offsets(cudaStream_t s, const int32_t* group_sizes, int E, int64_t C, int64_t* off) {
  slab_offsets_kernel<<<1, 1, 0, s>>>(group_sizes, E, C, off);
  MOE_EP_CUDA_CHECK_LAUNCH("slab_offsets_kernel");
  return MOE_EP_OK;
}

// out [M, N] (ldc) = grouped A [M, K] (lda) x B_e; see grouped_gemm_kernel.
moe_ep_status launch_gemm(cudaStream_t s, bool trans_b, const float* A, int64_t lda, const float* B, int64_t ldb,
                          int64_t b_stride, const float* row_scale, const int64_t* off, int E, int64_t M, int64_t N,
                          int64_t K, float* out, int64_t ldc, const char* what) {
  if (M == 0 || N == 0) return MOE_EP_OK;
  const dim3 grid(static_cast<unsigned>(div_up(M, kBM)),
                  static_cast<unsigned>(std::min<int64_t>(div_up(N, kBN), kMaxGridY)));
  if (trans_b)
    grouped_gemm_kernel<true><<<grid, kGemmThreads, 0, s>>>(A, lda, B, ldb, b_stride, row_scale, off, E, M, N, K, out,
                                                             ldc);
  else
    grouped_gemm_kernel<false><<<grid, kGemmThreads, 0, s>>>(A, lda, B, ldb, b_stride, row_scale, off, E, M, N, K, out,
                                                              ldc);
  MOE_EP_CUDA_CHECK_LAUNCH(what);
  return MOE_EP_OK;
}

// out [E, M, N] = per-slab A^T B; see grouped_wgrad_kernel.
moe_ep_status launch_wgrad(cudaStream_t s, const float* A, int64_t lda, const float* a_scale, const float* B,
                           int64_t ldb, const float* b_scale, const int64_t* off, int E, int64_t M, int64_t N,
                           float* out, const char* what, bool round_a = false, bool accumulate = false) {
  if (M == 0 || N == 0 || E == 0) return MOE_EP_OK;
  const dim3 grid(static_cast<unsigned>(div_up(N, kBN)), static_cast<unsigned>(std::min<int64_t>(div_up(M, kBM), kMaxGridY)),
                  static_cast<unsigned>(std::min<int64_t>(E, kMaxGridY)));
  if (round_a)
    grouped_wgrad_kernel<true><<<grid, kGemmThreads, 0, s>>>(A, lda, a_scale, B, ldb, b_scale, off, E, M, N, out,
                                                              accumulate);
  else
    grouped_wgrad_kernel<false><<<grid, kGemmThreads, 0, s>>>(A, lda, a_scale, B, ldb, b_scale, off, E, M, N, out,
                                                               accumulate);
  MOE_EP_CUDA_CHECK_LAUNCH(what);
  return MOE_EP_OK;
}

#define MOE_EP_TRY_CUDA(expr)              \
  do {                                     \
    const moe_ep_status _s = (expr);       \
    if (_s != MOE_EP_OK) return _s;        \
  } while (0)

SwigluParams swiglu_params(const moe_ep_expert_desc& d) {
  SwigluParams p;
  p.C = d.num_rows;
  p.I = d.intermediate;
  p.apply_topk_in_fc1 = d.apply_topk_in_fc1 ? 1 : 0;
  p.has_clamp = d.has_clamp ? 1 : 0;
  p.limit = d.gate_up_clamp;
  return p;
}

moe_ep_status check_desc_ranges(const moe_ep_expert_desc& d, const char* op) {
  if (d.num_local_experts < 1 || d.num_local_experts > INT32_MAX - 1 || d.num_rows < 0 || d.hidden < 1 ||
      d.intermediate < 1 || div_up(d.num_rows, kBM) > INT32_MAX || div_up(d.hidden, kBN) > INT32_MAX ||
      div_up(2 * d.intermediate, kBN) > INT32_MAX)
    return fail(MOE_EP_ERR_INTERNAL, std::string(op) + ": sizes out of the range the CUDA kernels index");
  return MOE_EP_OK;
}

}  // namespace

moe_ep_status expert_forward(void* stream, const moe_ep_expert_desc& d, const float* x, const float* w,
                             const float* fc1, const float* fc2, const int32_t* group_sizes, float* y, float* c,
                             void* workspace) {
  MOE_EP_TRY_CUDA(check_desc_ranges(d, "cuda::expert_forward"));
  const cudaStream_t s = as_stream(stream);
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate;
  const int E = static_cast<int>(d.num_local_experts);
  if (C == 0) return MOE_EP_OK;  // no rows: nothing to write
  const ForwardWorkspace ws = forward_workspace(d, workspace);
  MOE_EP_TRY_CUDA(launch_offsets(s, group_sizes, E, C, ws.offsets));

  // FC1: c = x W1[e]   [C, 2I]
  MOE_EP_TRY_CUDA(launch_gemm(s, false, x, H, fc1, 2 * I, H * 2 * I, nullptr, ws.offsets, E, C, 2 * I, H, c, 2 * I,
                              "grouped_gemm_kernel (FC1)"));

  // op = R_int(w h or h)   [C, I]
  const SwigluParams p = swiglu_params(d);
  switch (d.intermediate_format) {
    case MOE_EP_FORMAT_NONE:
      swiglu_operand_kernel<MOE_EP_FORMAT_NONE><<<blocks_for(C * I), kThreads, 0, s>>>(c, w, ws.op, p);
      break;
    case MOE_EP_FORMAT_BF16:
      swiglu_operand_kernel<MOE_EP_FORMAT_BF16><<<blocks_for(C * I), kThreads, 0, s>>>(c, w, ws.op, p);
      break;
    case MOE_EP_FORMAT_MXFP8:
      swiglu_operand_kernel<MOE_EP_FORMAT_MXFP8><<<blocks_for(C * div_up(I, kMxfp8Block)), kThreads, 0, s>>>(c, w,
                                                                                                            ws.op, p);
      break;
    case MOE_EP_FORMAT_NVFP4:
      swiglu_operand_kernel<MOE_EP_FORMAT_NVFP4><<<blocks_for(C * div_up(I, kNvfp4Block)), kThreads, 0, s>>>(c, w,
                                                                                                            ws.op, p);
      break;
    default:
      return fail(MOE_EP_ERR_INTERNAL,
                  "cuda::expert_forward: unexpected intermediate_format " + std::to_string(d.intermediate_format));
  }
  MOE_EP_CUDA_CHECK_LAUNCH("swiglu_operand_kernel");

  // FC2: y = op W2[e], times w per row when the router weight is applied after FC2.
  MOE_EP_TRY_CUDA(launch_gemm(s, false, ws.op, I, fc2, H, I * H, d.apply_topk_in_fc1 ? nullptr : w, ws.offsets, E, C,
                              H, I, y, H, "grouped_gemm_kernel (FC2)"));
  return MOE_EP_OK;
}

moe_ep_status expert_backward(void* stream, const moe_ep_expert_desc& d, const float* x, const float* w,
                              const float* fc1, const float* fc2, const uint16_t* fc1_c, const float* dy,
                              const int32_t* group_sizes, float* dx, float* dw, float* dfc1, float* dfc2,
                              void* workspace, const BackwardOptions& opt) {
  MOE_EP_TRY_CUDA(check_desc_ranges(d, "cuda::expert_backward"));
  const cudaStream_t s = as_stream(stream);
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate;
  const int E = static_cast<int>(d.num_local_experts);
  const bool apply = d.apply_topk_in_fc1 != 0;
  const BackwardWorkspace ws = backward_workspace(d, workspace);
  MOE_EP_TRY_CUDA(launch_offsets(s, group_sizes, E, C, ws.offsets));

  // The bf16-operand backward: dY enters as R_bf16(dY) (into z, which it does not use: dw = <a, h>).
  const bool b16 = opt.bf16_operands;
  if (b16 && C > 0) {
    round_bf16_kernel<<<blocks_for(C * H), kThreads, 0, s>>>(dy, C * H, ws.z);
    MOE_EP_CUDA_CHECK_LAUNCH("round_bf16_kernel (R_bf16(dY))");
    dy = ws.z;
  }
  if (C > 0) {
    // a = dY W2[e]^T   [C, I]   (B_e[k = h, n = i] = W2[e][i, h])
    MOE_EP_TRY_CUDA(launch_gemm(s, true, dy, H, fc2, H, I * H, nullptr, ws.offsets, E, C, I, H, ws.a, I,
                                "grouped_gemm_kernel (a = dY W2^T)"));
    // h and dc from the stash
    const SwigluParams p = swiglu_params(d);
    swiglu_backward_kernel<<<blocks_for(C * I), kThreads, 0, s>>>(fc1_c, ws.a, w, ws.h, ws.dc, p, b16);
    MOE_EP_CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
    if (apply || b16) {
      // dw = sum_i a * h
      row_dot_kernel<<<blocks_for(C, kDotRows), kThreads, 0, s>>>(ws.a, ws.h, C, I, ws.offsets, E, dw);
      MOE_EP_CUDA_CHECK_LAUNCH("row_dot_kernel (dw = <a, h>)");
    } else {
      // z = h W2[e]   [C, H];  dw = sum_h dY * z
      MOE_EP_TRY_CUDA(launch_gemm(s, false, ws.h, I, fc2, H, I * H, nullptr, ws.offsets, E, C, H, I, ws.z, H,
                                  "grouped_gemm_kernel (z = h W2)"));
      row_dot_kernel<<<blocks_for(C, kDotRows), kThreads, 0, s>>>(dy, ws.z, C, H, ws.offsets, E, dw);
      MOE_EP_CUDA_CHECK_LAUNCH("row_dot_kernel (dw = <dY, z>)");
    }
    // dx = dc W1[e]^T   [C, H]   (B_e[k = j, n = h] = W1[e][h, j])
    MOE_EP_TRY_CUDA(launch_gemm(s, true, ws.dc, 2 * I, fc1, 2 * I, H * 2 * I, nullptr, ws.offsets, E, C, H, 2 * I, dx,
                                H, "grouped_gemm_kernel (dx = dc W1^T)"));
  }
  // Weight gradients (zero for an expert with no rows, C = 0 included), after the last read of
  // fc1 and fc2 (dfc1 / dfc2 may be them: layer.cc's bf16 weight gradients use the staged weights):
  // dfc1[e] = x^T dc;  dfc2[e] = (w h)^T dY  or  h^T (w dY);  bf16 operands: R_bf16(w h)^T R_bf16(dY).
  MOE_EP_TRY_CUDA(launch_wgrad(s, x, H, nullptr, ws.dc, 2 * I, nullptr, ws.offsets, E, H, 2 * I, dfc1,
                               "grouped_wgrad_kernel (dfc1)", false, opt.accumulate));
  const bool w_left = apply || b16;
  MOE_EP_TRY_CUDA(launch_wgrad(s, ws.h, I, w_left ? w : nullptr, dy, H, w_left ? nullptr : w, ws.offsets, E, I, H,
                               dfc2, "grouped_wgrad_kernel (dfc2)", b16, opt.accumulate));
  return MOE_EP_OK;
}

}  // namespace cuda
}  // namespace moe_ep
