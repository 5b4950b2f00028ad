// The CUDA implementation's build description (moe_ep_build_info).
#include "internal.h"

#ifndef MOE_EP_CUDA_ARCHS
#define MOE_EP_CUDA_ARCHS "unknown"
#endif

namespace moe_ep {
namespace cuda {

// The CUDA architectures compiled in (CMAKE_CUDA_ARCHITECTURES, e.g. "90").
const char* arch_list() { return MOE_EP_CUDA_ARCHS; }

}  // namespace cuda
}  // namespace moe_ep
