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

// The IEEE quotient 1 / d without a branch, for d in [1, 2^64) (recip_rn_fast_ok): ptxas's
// fast path of __fdiv_rn(1, d), written out (the approximate reciprocal, one Newton step,
// then the quotient's residual correction), bit for bit equal to the division there
// (moe_ep_gemm_check --fc1-swiglu checks every such d). __fdiv_rn itself guards its fast
// path with a branch to a slow path; in an unrolled batch those branches keep the compiler
// from interleaving the elements' dependent chains (the fused FC1's epilogue), so a batch
// takes this and divides only the elements outside the range (a NaN d, or d >= 2^64, i.e.
// a gate below -44.3).
__device__ __forceinline__ bool recip_rn_fast_ok(float d) { return d >= 1.0f && d < 0x1p64f; }
__device__ __forceinline__ float recip_rn_fast(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float r1 = __fmaf_rn(r, __fmaf_rn(-d, r, 1.0f), r);
  return __fmaf_rn(r1, __fmaf_rn(-d, r1, 1.0f), r1);
}

// The clamp, NaN-propagating like std::min / jnp.minimum: g = min(g, L),
// u = min(max(u, -L), L).
__device__ __forceinline__ float clamp_gate(float g, float lim) { return lim < g ? lim : g; }
__device__ __forceinline__ float clamp_up(float u, float lim) {
  u = u < -lim ? -lim : u;
  return lim < u ? lim : u;
}

// h = (g * sig) * u, times w when weight: the FC2 operand from the clamped g and u and
// sig = sigmoid(g). swiglu_operand's arithmetic, and the fused FC1 epilogue's, which computes
// its sigmoids apart (in batches).
__device__ __forceinline__ float swiglu_from_sigmoid(float g, float sig, float u, float w, bool weight) {
  const float s = fmul(g, sig);
  const float h = fmul(s, u);
  return weight ? fmul(w, h) : h;
}

// The unrounded FC2 operand of one element: h = (g * sig) * u from the FC1
// output c (clamped), times w when the router weight goes into FC1.
__device__ __forceinline__ float swiglu_operand(float g, float u, float w, const SwigluParams& p) {
  if (p.has_clamp) {
    g = clamp_gate(g, p.limit);
    u = clamp_up(u, p.limit);
  }
  return swiglu_from_sigmoid(g, sigmoid(g), u, w, p.apply_topk_in_fc1 != 0);
}

// The backward of one element (docs/spec.md 9.2) from the stash's raw g~, u~ and dh:
// masks m_g = [g~ <= L], m_u = [-L <= u~ <= L] (1 without a clamp), g and u clamped,
// sig = sigmoid(g), s = g sig, h = s u, dg = dh u sig (1 + g (1 - sig)) m_g and
// du = dh s m_u, evaluated left to right as in the reference (masks multiply: NaN stays NaN).
struct SwigluGrad {
  float h, dg, du;
};

__device__ __forceinline__ SwigluGrad swiglu_grad(float g_raw, float u_raw, float dh, const SwigluParams& p) {
  float g = g_raw, u = u_raw, gate_mask = 1.0f, up_mask = 1.0f;
  if (p.has_clamp) {
    const float lim = p.limit;
    gate_mask = g_raw <= lim ? 1.0f : 0.0f;
    up_mask = (u_raw >= -lim && u_raw <= lim) ? 1.0f : 0.0f;
    g = clamp_gate(g_raw, lim);
    u = clamp_up(u_raw, lim);
  }
  const float sig = sigmoid(g);
  const float s = fmul(g, sig);
  SwigluGrad out;
  out.h = fmul(s, u);
  out.dg = fmul(fmul(fmul(dh, u), sig), fadd(1.0f, fmul(g, fsub(1.0f, sig))));
  out.du = fmul(dh, s);
  if (p.has_clamp) {
    out.dg = fmul(out.dg, gate_mask);
    out.du = fmul(out.du, up_mask);
  }
  return out;
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_SWIGLU_CUH_
