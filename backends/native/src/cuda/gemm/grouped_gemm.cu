// The grouped-GEMM dispatcher (grouped_gemm.h): checks the problem, picks the
// instantiation, resolves the SM count. No CUTLASS header here; the kernels are in
// grouped_gemm_{nn,nt,tn}{,_pingpong}.cu, built only with MOE_EP_NATIVE_WITH_CUTLASS.
#include "cuda/gemm/grouped_gemm.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cuda/gemm/grouped_gemm_impl.h"

namespace moe_ep {
namespace cuda {
namespace {

constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();  // CUTLASS problem shapes are int

bool row_len_ok(int64_t len) { return len > 0 && len % 8 == 0 && len < kMaxDim; }
bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

cudaError_t resolve_sm_count(int* sm_count) {
  if (*sm_count > 0) return cudaSuccess;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
}

// kNN/kNT: few rows per group (decode) or a narrow n take the pingpong 64x128x128 kernel.
bool few_rows(const GroupedGemmProblem& p) {
  const int64_t rows = p.rows_hint > 0 ? p.rows_hint : p.total_rows / p.num_groups;
  return rows <= 128 || p.n <= 128;
}

}  // namespace

bool grouped_gemm_built() {
#if defined(MOE_EP_NATIVE_WITH_CUTLASS)
  return true;
#else
  return false;
#endif
}

bool grouped_gemm_supported(const GroupedGemmProblem& p) {
  if (!grouped_gemm_built()) return false;
  if (p.num_groups < 1 || p.num_groups > 1024) return false;
  if (p.total_rows < 0 || p.total_rows >= kMaxDim) return false;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d) || !aligned16(p.d_bf16)) return false;
  if (p.d_bf16 != nullptr && (p.layout != GemmLayout::kNN || p.accumulate)) return false;
  switch (p.layout) {
    case GemmLayout::kNN:
    case GemmLayout::kNT:
      return row_len_ok(p.n) && row_len_ok(p.k);
    case GemmLayout::kTN:
      return row_len_ok(p.m) && row_len_ok(p.n);
  }
  return false;
}

size_t grouped_gemm_workspace_bytes(const GroupedGemmProblem& p, int sm_count) {
  if (!grouped_gemm_supported(p)) return 0;
  if (resolve_sm_count(&sm_count) != cudaSuccess) return 0;
#if defined(MOE_EP_NATIVE_WITH_CUTLASS)
  // The larger of the kernels the layout may pick: the size does not depend on rows_hint.
  switch (p.layout) {
    case GemmLayout::kNN:
      if (p.d_bf16 != nullptr)
        return std::max(gemm_detail::grouped_gemm_nn_coop_bf16_workspace_bytes(p, sm_count),
                        gemm_detail::grouped_gemm_nn_pingpong_bf16_workspace_bytes(p, sm_count));
      return std::max(gemm_detail::grouped_gemm_nn_coop_workspace_bytes(p, sm_count),
                      gemm_detail::grouped_gemm_nn_pingpong_workspace_bytes(p, sm_count));
    case GemmLayout::kNT:
      return std::max(gemm_detail::grouped_gemm_nt_coop_workspace_bytes(p, sm_count),
                      gemm_detail::grouped_gemm_nt_pingpong_workspace_bytes(p, sm_count));
    case GemmLayout::kTN: return gemm_detail::grouped_gemm_tn_coop_workspace_bytes(p, sm_count);
  }
#endif
  return 0;
}

cudaError_t grouped_gemm_bf16(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream, int sm_count) {
  if (!grouped_gemm_supported(p)) return cudaErrorNotSupported;
  if (p.offsets == nullptr || (p.d == nullptr && p.d_bf16 == nullptr)) return cudaErrorInvalidValue;
  if (p.total_rows > 0 && (p.a == nullptr || p.b == nullptr)) return cudaErrorInvalidValue;
  cudaError_t e = resolve_sm_count(&sm_count);
  if (e != cudaSuccess) return e;
#if defined(MOE_EP_NATIVE_WITH_CUTLASS)
  switch (p.layout) {
    case GemmLayout::kNN:
      if (p.d_bf16 != nullptr)
        return few_rows(p)
                   ? gemm_detail::grouped_gemm_nn_pingpong_bf16_launch(p, workspace, workspace_bytes, stream, sm_count)
                   : gemm_detail::grouped_gemm_nn_coop_bf16_launch(p, workspace, workspace_bytes, stream, sm_count);
      return few_rows(p) ? gemm_detail::grouped_gemm_nn_pingpong_launch(p, workspace, workspace_bytes, stream, sm_count)
                         : gemm_detail::grouped_gemm_nn_coop_launch(p, workspace, workspace_bytes, stream, sm_count);
    case GemmLayout::kNT:
      return few_rows(p) ? gemm_detail::grouped_gemm_nt_pingpong_launch(p, workspace, workspace_bytes, stream, sm_count)
                         : gemm_detail::grouped_gemm_nt_coop_launch(p, workspace, workspace_bytes, stream, sm_count);
    case GemmLayout::kTN: return gemm_detail::grouped_gemm_tn_coop_launch(p, workspace, workspace_bytes, stream, sm_count);
  }
#else
  (void)workspace;
  (void)workspace_bytes;
  (void)stream;
#endif
  return cudaErrorNotSupported;
}

}  // namespace cuda
}  // namespace moe_ep
