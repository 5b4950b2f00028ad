// The grouped-GEMM dispatcher (grouped_gemm.h): checks the problem, picks the
// instantiation, resolves the SM count. No CUTLASS header here; the kernels are in
// grouped_gemm_{nn,nt,tn}{,_pingpong,_coop_n2}{,_bf16}.cu, built only with
// MOE_EP_NATIVE_WITH_CUTLASS.
#include "cuda/gemm/grouped_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "align.h"
#include "cuda/gemm/grouped_gemm_impl.h"

namespace moe_ep {
namespace cuda {
namespace {

constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();  // CUTLASS problem shapes are int

bool row_len_ok(int64_t len) { return len > 0 && len % 8 == 0 && len < kMaxDim; }

cudaError_t resolve_sm_count(int* sm_count) {
  if (*sm_count > 0) return cudaSuccess;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
}

// Few rows per group (decode) or a narrow n: the pingpong 64x128x128 kernel (kNT; kNN
// where n spans an odd number of 256-column tiles).
bool few_rows(const GroupedGemmProblem& p) {
  return p.total_rows / p.num_groups <= 128 || p.n <= 128;
}

// MOE_EP_GEMM_KNN: kAuto (unset), kCooperative, kPingpong or kCooperativeN2; read once.
GemmKernel knn_override() {
  static const GemmKernel k = [] {
    const char* e = std::getenv("MOE_EP_GEMM_KNN");
    if (e != nullptr && std::strcmp(e, "cooperative") == 0) return GemmKernel::kCooperative;
    if (e != nullptr && std::strcmp(e, "pingpong") == 0) return GemmKernel::kPingpong;
    if (e != nullptr && std::strcmp(e, "cooperative_1x2") == 0) return GemmKernel::kCooperativeN2;
    return GemmKernel::kAuto;
  }();
  return k;
}

bool kernel_fits_layout(GemmKernel k, GemmLayout l) {
  switch (k) {
    case GemmKernel::kAuto:
    case GemmKernel::kCooperative: return true;
    case GemmKernel::kPingpong: return l != GemmLayout::kTN;
    case GemmKernel::kCooperativeN2: return l == GemmLayout::kNN;
  }
  return false;
}

}  // namespace

GemmKernel grouped_gemm_kernel(const GroupedGemmProblem& p) {
  if (p.kernel != GemmKernel::kAuto) return p.kernel;
  if (p.layout == GemmLayout::kTN) return GemmKernel::kCooperative;
  if (p.layout == GemmLayout::kNN) {
    const GemmKernel forced = knn_override();
    if (forced != GemmKernel::kAuto) return forced;
    constexpr int64_t kTileN = 256;
    if ((p.n + kTileN - 1) / kTileN % 2 == 0) return GemmKernel::kCooperativeN2;
  }
  return few_rows(p) ? GemmKernel::kPingpong : GemmKernel::kCooperative;
}

const char* grouped_gemm_kernel_name(const GroupedGemmProblem& p) {
  switch (grouped_gemm_kernel(p)) {
    case GemmKernel::kCooperative: return "cooperative";
    case GemmKernel::kPingpong: return "pingpong";
    case GemmKernel::kCooperativeN2: return "cooperative_1x2";
    case GemmKernel::kAuto: break;
  }
  return "?";
}

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
  if (p.d_bf16 != nullptr && (p.layout == GemmLayout::kNT || p.accumulate)) return false;
  if (!kernel_fits_layout(p.kernel, p.layout)) return false;
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
  // The larger of the kernels the layout may pick: the size does not depend on the kernel.
  switch (p.layout) {
    case GemmLayout::kNN:
      if (p.d_bf16 != nullptr)
        return std::max({gemm_detail::grouped_gemm_nn_coop_bf16_workspace_bytes(p, sm_count),
                         gemm_detail::grouped_gemm_nn_pingpong_bf16_workspace_bytes(p, sm_count),
                         gemm_detail::grouped_gemm_nn_coop_n2_bf16_workspace_bytes(p, sm_count)});
      return std::max({gemm_detail::grouped_gemm_nn_coop_workspace_bytes(p, sm_count),
                       gemm_detail::grouped_gemm_nn_pingpong_workspace_bytes(p, sm_count),
                       gemm_detail::grouped_gemm_nn_coop_n2_workspace_bytes(p, sm_count)});
    case GemmLayout::kNT:
      return std::max(gemm_detail::grouped_gemm_nt_coop_workspace_bytes(p, sm_count),
                      gemm_detail::grouped_gemm_nt_pingpong_workspace_bytes(p, sm_count));
    case GemmLayout::kTN:
      return p.d_bf16 != nullptr ? gemm_detail::grouped_gemm_tn_coop_bf16_workspace_bytes(p, sm_count)
                                 : gemm_detail::grouped_gemm_tn_coop_workspace_bytes(p, sm_count);
  }
#endif
  return 0;
}

cudaError_t grouped_gemm_bf16(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream, int sm_count) {
  if (!grouped_gemm_supported(p)) return cudaErrorNotSupported;
  if (p.group_sizes != nullptr ? p.offsets_out == nullptr : p.offsets == nullptr) return cudaErrorInvalidValue;
  if (p.d == nullptr && p.d_bf16 == nullptr) return cudaErrorInvalidValue;
  if (p.total_rows > 0 && (p.a == nullptr || p.b == nullptr)) return cudaErrorInvalidValue;
  cudaError_t e = resolve_sm_count(&sm_count);
  if (e != cudaSuccess) return e;
#if defined(MOE_EP_NATIVE_WITH_CUTLASS)
  const GemmKernel kernel = grouped_gemm_kernel(p);
  switch (p.layout) {
    case GemmLayout::kNN:
      if (p.d_bf16 != nullptr) {
        if (kernel == GemmKernel::kPingpong)
          return gemm_detail::grouped_gemm_nn_pingpong_bf16_launch(p, workspace, workspace_bytes, stream, sm_count);
        if (kernel == GemmKernel::kCooperativeN2)
          return gemm_detail::grouped_gemm_nn_coop_n2_bf16_launch(p, workspace, workspace_bytes, stream, sm_count);
        return gemm_detail::grouped_gemm_nn_coop_bf16_launch(p, workspace, workspace_bytes, stream, sm_count);
      }
      if (kernel == GemmKernel::kPingpong)
        return gemm_detail::grouped_gemm_nn_pingpong_launch(p, workspace, workspace_bytes, stream, sm_count);
      if (kernel == GemmKernel::kCooperativeN2)
        return gemm_detail::grouped_gemm_nn_coop_n2_launch(p, workspace, workspace_bytes, stream, sm_count);
      return gemm_detail::grouped_gemm_nn_coop_launch(p, workspace, workspace_bytes, stream, sm_count);
    case GemmLayout::kNT:
      return kernel == GemmKernel::kPingpong
                 ? gemm_detail::grouped_gemm_nt_pingpong_launch(p, workspace, workspace_bytes, stream, sm_count)
                 : gemm_detail::grouped_gemm_nt_coop_launch(p, workspace, workspace_bytes, stream, sm_count);
    case GemmLayout::kTN:
      if (p.d_bf16 != nullptr)
        return gemm_detail::grouped_gemm_tn_coop_bf16_launch(p, workspace, workspace_bytes, stream, sm_count);
      return gemm_detail::grouped_gemm_tn_coop_launch(p, workspace, workspace_bytes, stream, sm_count);
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
