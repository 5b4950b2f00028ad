// The rows of one group of a grouped GEMM over row slabs, for the kernels that build the
// groups' arguments (grouped_gemm_cutlass.cuh's build_group_args, fc1_swiglu_gemm.cu's
// build_fc1_args): from device offsets, or made from the groups' sizes and published.
#ifndef MOE_EP_NATIVE_CUDA_GEMM_GROUP_ROWS_CUH_
#define MOE_EP_NATIVE_CUDA_GEMM_GROUP_ROWS_CUH_

#include <cstdint>

namespace moe_ep {
namespace cuda {

struct GroupRows {
  int64_t start, end;
};

// Group g's rows [start, end): offsets[g], offsets[g + 1], or, with group_sizes, the clamped
// running sum min(prefix sum, total_rows) of the sizes (each made >= 0), whose end thread g
// writes to offsets_out[g + 1] (and thread 0 offsets_out[0] = 0) for the kernels after the
// launch. Either way clamped to 0 <= start <= end <= total_rows, so that malformed offsets
// cannot send TMA outside the operands.
__device__ __forceinline__ GroupRows group_rows(int g, const int32_t* offsets, const int32_t* group_sizes,
                                                int32_t* offsets_out, int64_t total_rows) {
  int64_t start, end;
  if (group_sizes != nullptr) {
    int64_t sum = 0;
    for (int e = 0; e < g; ++e) sum += group_sizes[e] > 0 ? group_sizes[e] : 0;
    const int64_t size = group_sizes[g] > 0 ? group_sizes[g] : 0;
    start = sum < total_rows ? sum : total_rows;
    end = sum + size < total_rows ? sum + size : total_rows;
    if (g == 0) offsets_out[0] = 0;
    offsets_out[g + 1] = static_cast<int32_t>(end);
  } else {
    start = offsets[g];
    end = offsets[g + 1];
  }
  start = start < 0 ? 0 : (start > total_rows ? total_rows : start);
  end = end < start ? start : (end > total_rows ? total_rows : end);
  return {start, end};
}

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_GROUP_ROWS_CUH_
