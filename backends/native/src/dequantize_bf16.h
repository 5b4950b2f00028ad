// The implementations of moe_ep_dequantize_bf16 (capi.cc checks the arguments
// once, then calls one of them): cpu/formats.cc and cuda/formats.cu.
#ifndef MOE_EP_NATIVE_DEQUANTIZE_BF16_H_
#define MOE_EP_NATIVE_DEQUANTIZE_BF16_H_

#include <cstdint>

#include "moe_ep_native.h"

namespace moe_ep {

// fmt is MXFP8 or NVFP4; outer * n * inner > 0; transpose_rows 0, or >= 1 with
// inner == 1 and outer % transpose_rows == 0; inexact NULL or a 4-byte aligned int32.
#define MOE_EP_DEQUANTIZE_BF16_DECL                                                                            \
  moe_ep_status dequantize_bf16(void* stream, moe_ep_format fmt, const void* data, const void* scale,          \
                                int64_t outer, int64_t n, int64_t inner, int64_t transpose_rows, uint16_t* out, \
                                int32_t* inexact);

namespace cpu {
MOE_EP_DEQUANTIZE_BF16_DECL
}  // namespace cpu

#ifdef MOE_EP_NATIVE_WITH_CUDA
namespace cuda {
MOE_EP_DEQUANTIZE_BF16_DECL
}  // namespace cuda
#endif

#undef MOE_EP_DEQUANTIZE_BF16_DECL

}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_DEQUANTIZE_BF16_H_
