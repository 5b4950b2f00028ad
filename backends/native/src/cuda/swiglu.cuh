// The SwiGLU of docs/spec.md section 5 on one element, shared by the float32
// kernels (experts.cu) and the tensor-core path (layer_tc.cu): float32, every
// product and sum rounded separately, the clamp NaN-propagating.
#ifndef MOE_EP_NATIVE_CUDA_SWIGLU_CUH_
#define MOE_EP_NATIVE_CUDA_SWIGLU_CUH_

#include <cstdint>

#include "cuda/common.cuh"

namespace moe_ep {
namespace cuda {
namespace detail {

struct SwigluParams {
  int64_t C, I;
  int apply_topk_in_fc1;
  int has_clamp;
  float limit;
};

// sigmoid(g) = 1 / (1 + exp(-g)) in float32 (accurate expf, IEEE division).
__device__ __forceinline__ float sigmoid(float g) { return __fdiv_rn(1.0f, fadd(1.0f, expf(-g))); }

// The clamp, NaN-propagating like std::min / jnp.minimum: g = min(g, L),
// u = min(max(u, -L), L).
__device__ __forceinline__ float clamp_gate(float g, float lim) { return lim < g ? lim : g; }
__device__ __forceinline__ float clamp_up(float u, float lim) {
  u = u < -lim ? -lim : u;
  return lim < u ? lim : u;
}

// The unrounded FC2 operand of one element: h = (g * sig) * u from the FC1
// output c (clamped), times w when the router weight goes into FC1.
__device__ __forceinline__ float swiglu_operand(float g, float u, float w, const SwigluParams& p) {
  if (p.has_clamp) {
    g = clamp_gate(g, p.limit);
    u = clamp_up(u, p.limit);
  }
  const float s = fmul(g, sigmoid(g));
  const float h = fmul(s, u);
  return p.apply_topk_in_fc1 ? fmul(w, h) : h;
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_SWIGLU_CUH_
