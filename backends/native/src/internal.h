// Internal interface of the native core: capi.cc validates every size and
// pointer once, then calls one implementation (cpu:: always, cuda:: when built
// with MOE_EP_NATIVE_CUDA). Implementations may assume the checks of capi.cc
// passed; they report data errors (CPU only) and runtime failures through
// moe_ep::fail().
#ifndef MOE_EP_NATIVE_INTERNAL_H_
#define MOE_EP_NATIVE_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "moe_ep_native.h"

namespace moe_ep {

// Sets the calling thread's last error and returns `status`.
moe_ep_status fail(moe_ep_status status, const std::string& message);

// Block sizes of the block-scaled formats.
constexpr int64_t kMxfp8Block = 32;
constexpr int64_t kNvfp4Block = 16;
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Workspace bytes (one definition for every implementation): forward needs
// the FC2 operand [C, I] float32; backward h, a = dY W2^T [C, I] each,
// dc [C, 2I] and z = h W2 [C, H], float32. Both add (E_local + 1) int64 slab
// offsets, 256-byte aligned pieces.
size_t forward_workspace_bytes(const moe_ep_expert_desc& d);
size_t backward_workspace_bytes(const moe_ep_expert_desc& d);

#define MOE_EP_IMPL_DECLS                                                                                          \
  moe_ep_status quantize(void* stream, moe_ep_format fmt, const float* x, int64_t outer, int64_t n, int64_t inner,   \
                         void* data, void* scale);                                                                 \
  moe_ep_status dequantize(void* stream, moe_ep_format fmt, const void* data, const void* scale, int64_t outer,     \
                           int64_t n, int64_t inner, float* out);                                                  \
  moe_ep_status plan_routes(void* stream, const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk,           \
                            int64_t num_experts, int32_t* send_route, int32_t* route_pos, int32_t* route_expert,    \
                            int32_t* counts);                                                                      \
  moe_ep_status permute_rows(void* stream, const void* tokens, int64_t num_tokens, int64_t num_topk,               \
                             int64_t row_bytes, const int32_t* send_route, int64_t num_rows, void* dst);           \
  moe_ep_status combine_reduce(void* stream, const float* rows, int64_t num_rows, const int32_t* route_pos,        \
                               int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out);                  \
  moe_ep_status expert_forward(void* stream, const moe_ep_expert_desc& d, const float* x, const float* w,          \
                               const float* fc1, const float* fc2, const int32_t* group_sizes, float* y, float* c,  \
                               void* workspace);                                                                   \
  moe_ep_status expert_backward(void* stream, const moe_ep_expert_desc& d, const float* x, const float* w,         \
                                const float* fc1, const float* fc2, const uint16_t* fc1_c, const float* dy,         \
                                const int32_t* group_sizes, float* dx, float* dw, float* dfc1, float* dfc2,         \
                                void* workspace);

namespace cpu {
MOE_EP_IMPL_DECLS
}  // namespace cpu

#ifdef MOE_EP_NATIVE_WITH_CUDA
namespace cuda {
MOE_EP_IMPL_DECLS
const char* arch_list();  // the CUDA architectures compiled in, for moe_ep_build_info
}  // namespace cuda
#endif

#undef MOE_EP_IMPL_DECLS

}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_INTERNAL_H_
