// Shared host/device helpers of the CUDA implementation: launch sizing, the
// launch check, the workspace layout (mirrors forward_workspace_bytes /
// backward_workspace_bytes of capi.cc) and float32 arithmetic that never
// contracts into a fused multiply-add.
#ifndef MOE_EP_NATIVE_CUDA_COMMON_CUH_
#define MOE_EP_NATIVE_CUDA_COMMON_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/pdl.cuh"
#include "internal.h"

namespace moe_ep {
namespace cuda {
namespace detail {

// ------------------------------------------------------------------ launches

// Elementwise kernels use grid-stride loops; the grid is capped so that any
// 64-bit element count is covered without overflowing gridDim.x.
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

inline unsigned blocks_for(int64_t total, int threads = kThreads) {
  const int64_t b = (total + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, kMaxBlocks)));
}

// a / b for a >= 0, b >= 1: a 32-bit division where both fit (a few instructions
// instead of the 64-bit division's subroutine: for index math in memory-bound kernels).
__device__ __forceinline__ int64_t div_nonneg(int64_t a, int64_t b) {
  return ((a | b) >> 32) == 0 ? int64_t{static_cast<uint32_t>(a) / static_cast<uint32_t>(b)} : a / b;
}

// ceil(a / b) for a >= 0, b >= 1, usable in kernels (internal.h's ceil_div is host-only).
__host__ __device__ __forceinline__ int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// f(std::true_type{}) or f(std::false_type{}) as `flag` says: a run-time flag as a kernel's
// template argument (decltype(k)::value), one launch site for both instances.
template <typename F>
void with_flag(bool flag, F&& f) {
  if (flag) f(std::true_type{});
  else f(std::false_type{});
}

// After each launch: a launch failure (bad configuration, no device, a sticky
// error of an earlier kernel) becomes MOE_EP_ERR_CUDA naming the kernel.
inline moe_ep_status check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return fail(MOE_EP_ERR_CUDA, std::string("CUDA kernel ") + kernel + " failed: " + cudaGetErrorName(err) + ": " +
                                     cudaGetErrorString(err));
  return MOE_EP_OK;
}

#define MOE_EP_CUDA_CHECK_LAUNCH(kernel_name)                         \
  do {                                                               \
    const moe_ep_status _st = ::moe_ep::cuda::detail::check_launch(kernel_name); \
    if (_st != MOE_EP_OK) return _st;                                \
  } while (0)

// ------------------------------------------------------------------ workspace

// The layouts are internal.h's (one definition for capi.cc, the CPU and CUDA).
inline ForwardWorkspace forward_workspace(const moe_ep_expert_desc& d, void* workspace) {
  ForwardWorkspace ws;
  forward_workspace_layout(d, workspace, &ws);
  return ws;
}

inline BackwardWorkspace backward_workspace(const moe_ep_expert_desc& d, void* workspace) {
  BackwardWorkspace ws;
  backward_workspace_layout(d, workspace, &ws);
  return ws;
}

// ------------------------------------------------------------------ slab offsets

// One thread: off[0] = 0, off[e + 1] = min(off[e] + max(group_sizes[e], 0), C), as
// int64 (the float32 kernels) or int32 (the grouped GEMMs' offsets).
template <typename Offset>
__global__ void slab_offsets_kernel(const int32_t* __restrict__ group_sizes, int num_experts, int64_t num_rows,
                                    Offset* __restrict__ off) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t o = 0;
  off[0] = 0;
  for (int e = 0; e < num_experts; ++e) {
    const int64_t g = group_sizes[e];
    o += g > 0 ? g : 0;
    if (o > num_rows) o = num_rows;
    off[e + 1] = static_cast<Offset>(o);
  }
}

// ------------------------------------------------------------------ arithmetic

// Products and sums round separately, as on the CPU (the build also passes
// --fmad=false; the intrinsics make it independent of that flag).
__device__ __forceinline__ float fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fsub(float a, float b) { return __fsub_rn(a, b); }

}  // namespace detail
}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_COMMON_CUH_
