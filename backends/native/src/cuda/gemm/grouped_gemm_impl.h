// Internal to src/cuda/gemm: the entry points of the per-instantiation TUs
// (grouped_gemm_{nn,nt,tn}.cu, each one CUTLASS kernel), called by the dispatcher
// grouped_gemm.cu. Plain C++: no CUTLASS header.
#ifndef MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_IMPL_H_
#define MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_IMPL_H_

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/gemm/grouped_gemm.h"

namespace moe_ep {
namespace cuda {
namespace gemm_detail {

// One instantiation: its workspace size and its launch. The dispatcher has checked
// grouped_gemm_supported(p) and resolved sm_count (> 0) before calling these.
#define MOE_EP_GROUPED_GEMM_DECLARE(name)                                                      \
  size_t name##_workspace_bytes(const GroupedGemmProblem& p, int sm_count);                   \
  cudaError_t name##_launch(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes, \
                            cudaStream_t stream, int sm_count);

MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_nn_coop)  // kNN, cooperative 128x256x64, cluster 2x1
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_nt_coop)  // kNT, cooperative 128x256x64, cluster 2x1
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_tn_coop)  // kTN, cooperative 128x256x64, cluster 2x1
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_tn_coop_bf16)  // kTN, cooperative 128x256x64, cluster 2x1, bf16 D
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_nn_pingpong)  // kNN, pingpong 64x128x128, cluster 2x1
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_nt_pingpong)  // kNT, pingpong 64x128x128, cluster 2x1
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_nn_coop_bf16)      // kNN, cooperative, bf16 D
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_nn_pingpong_bf16)  // kNN, pingpong, bf16 D
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_nn_coop_n2)       // kNN, cooperative 128x256x64, cluster 1x2
MOE_EP_GROUPED_GEMM_DECLARE(grouped_gemm_nn_coop_n2_bf16)  // kNN, cooperative 128x256x64, cluster 1x2, bf16 D

#undef MOE_EP_GROUPED_GEMM_DECLARE

}  // namespace gemm_detail
}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_IMPL_H_
