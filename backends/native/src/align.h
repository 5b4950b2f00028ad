// Pointer alignment, the condition of every vector access (CPU and CUDA, the grouped GEMMs'
// dispatcher included: no other header needed).
#ifndef MOE_EP_NATIVE_ALIGN_H_
#define MOE_EP_NATIVE_ALIGN_H_

#include <cstdint>

namespace moe_ep {

// Whether p is aligned to `bytes` bytes, and to 16.
inline bool aligned_to(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
inline bool aligned16(const void* p) { return aligned_to(p, 16); }

}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_ALIGN_H_
