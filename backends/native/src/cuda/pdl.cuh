// Programmatic dependent launch (sm_90) for the experts stages' kernels. A kernel launched
// by launch_pdl may be launched while the kernel before it on the stream is still running
// (when that one's blocks have all exited, or have all called griddepcontrol.launch_dependents,
// as the exchange's kernels do first thing), instead of after its completion: the launch
// latency and the gap between the two hide behind the predecessor's tail. Such a kernel's
// first statement is pdl_wait(), which returns once the whole predecessor grid has completed
// and its memory is visible; before it the kernel reads and writes nothing. Launched without
// the attribute (<<<>>>, or before sm_90) pdl_wait is a no-op, so the kernels stay correct
// under any launch. CUDA graphs keep the dependency as a programmatic edge.
#ifndef MOE_EP_NATIVE_CUDA_PDL_CUH_
#define MOE_EP_NATIVE_CUDA_PDL_CUH_

#include <cuda_runtime.h>

#include <cstddef>

namespace moe_ep {
namespace cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization.
// The error, as cudaGetLastError would give it (also left there for the usual launch check).
template <typename... KArgs, typename... Args>
inline cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                              Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_PDL_CUH_
