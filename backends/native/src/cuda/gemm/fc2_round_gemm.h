// FC2 with the nvfp4 round trip in its epilogue (plain C++: no CUTLASS header): one grouped
// GEMM y = h W2_e over the experts' row slabs whose epilogue makes, from the float32
// accumulator in registers, what layer_tc.cu's FC2 pass for combine_format nvfp4 with bf16
// rows makes from the float32 y in memory (fc2_epilogue_block_vec4_kernel<NVFP4, kWeight,
// true>, bit for bit):
//   y[r, :] = R_nvfp4(w[r] * acc[r, :]) (router weight in FC2) or R_nvfp4(acc[r, :]),
// R_nvfp4 the quantize + dequantize of each 16-column block, written as bf16 (exact: E2M1
// times E4M3 is a bf16 value). The float32 y never reaches memory: the GEMM writes half the
// bytes, and the combine reads bf16 rows.
//
// How a block's 16 values meet: the tensor cores' accumulator gives each thread two adjacent
// columns of every 8 (columns 2 q, 2 q + 1 of lane q = lane % 4), so a row's 16-column block
// lies in the 4 lanes of a quad, 4 values each; their block maximum is agreed through two
// shuffles (format_math.cuh's group_block_max), then each lane rounds and stores its 4.
//
// Rows past the experts' slabs (r >= off[E]) are not written: the caller zeroes them.
#ifndef MOE_EP_NATIVE_CUDA_GEMM_FC2_ROUND_GEMM_H_
#define MOE_EP_NATIVE_CUDA_GEMM_FC2_ROUND_GEMM_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe_ep {
namespace cuda {

struct Fc2RoundProblem {
  int32_t num_groups = 0;            // experts
  const int32_t* offsets = nullptr;  // [G + 1] row offsets (device), made before the launch
  int64_t total_rows = 0;            // C: rows of h and y
  int64_t hidden = 0;                // H (N)
  int64_t intermediate = 0;          // I (K)
  const uint16_t* h = nullptr;       // [C, I] bf16, row-major: FC2's operand
  const uint16_t* w2 = nullptr;      // [G, I, H] bf16, row-major
  const float* weight = nullptr;     // [C] float32 router weight of each row (read when apply_weight)
  int apply_weight = 0;              // the router weight goes into FC2
  uint16_t* y = nullptr;             // [C, H] bf16 out: the nvfp4 round trip of each row's blocks
};

// Whether this build has the kernel (CUTLASS, sm_90a) and p's shape fits it: 1 to 1024 groups
// (the argument kernel is one block), H a multiple of 16 (whole blocks in a row), I a multiple
// of 8, 16-byte aligned h and W2, 4-byte aligned y, at most INT_MAX rows and columns.
bool fc2_round_gemm_supported(const Fc2RoundProblem& p);

// Workspace bytes for p's number of groups on sm_count SMs (0 without the kernel).
size_t fc2_round_gemm_workspace_bytes(const Fc2RoundProblem& p, int sm_count);

// The launch (capturable: no host sync, nothing allocated). cudaErrorNotSupported when
// fc2_round_gemm_supported(p) is false; cudaErrorInvalidValue for a short or misaligned
// workspace (128 bytes).
cudaError_t fc2_round_gemm(const Fc2RoundProblem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                           int sm_count);

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_FC2_ROUND_GEMM_H_
