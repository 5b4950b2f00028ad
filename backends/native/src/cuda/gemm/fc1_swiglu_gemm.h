// FC1 with the SwiGLU in its epilogue (plain C++: no CUTLASS header): one grouped GEMM
// c = x W1_e over the experts' row slabs whose epilogue makes, from the float32 accumulator in
// registers, what the FC1 pass of layer_tc.cu makes from c in memory (fc1_epilogue_vec4_kernel
// with a bf16 intermediate format, bit for bit):
//   h[r, i]     = R_bf16(w[r] * swiglu(g, u)) (router weight in FC1) or R_bf16(swiglu(g, u)),
//   stash[r, :] = bf16(c[r, :]) (when stash is set),
// with g = c[r, i], u = c[r, I + i] clamped as the layer says. c itself never reaches memory.
//
// How the GEMM pairs g and u: its B operand is W1_e [H, 2I] read with the N mode gated
// (gated_mainloop.hpp): a 256-column CTA tile holds gate columns [128 t, 128 t + 64), their up
// columns, then gate [128 t + 64, 128 t + 128) and their up columns, so each thread's
// accumulator holds both values of its pairs. The epilogue (the fusion callbacks of
// fc1_swiglu_gemm.cu) writes h and the stash straight from registers.
//
// Rows past the experts' slabs (r >= off[E]) are not written: the caller zeroes them.
#ifndef MOE_EP_NATIVE_CUDA_GEMM_FC1_SWIGLU_GEMM_H_
#define MOE_EP_NATIVE_CUDA_GEMM_FC1_SWIGLU_GEMM_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe_ep {
namespace cuda {

// Which kernel runs it: cooperative (128x256 tiles, both consumer warpgroups on a tile, the
// epilogue after its mainloop), pingpong (64x256 tiles, a warpgroup a tile: one's epilogue
// under the other's mainloop) or kAuto (cooperative: at DeepSeek-V3's FC1, 4096 tokens, an
// H100, pingpong took 1.39 times FC1's GEMM and the pass, cooperative 1.05 to 1.10).
enum class Fc1SwigluKernel { kAuto, kCooperative, kPingpong };

struct Fc1SwigluProblem {
  int32_t num_groups = 0;              // experts
  const int32_t* offsets = nullptr;    // [G + 1] row offsets (device), or:
  const int32_t* group_sizes = nullptr;  // [G] sizes (device): offsets made by the launch into offsets_out
  int32_t* offsets_out = nullptr;      // [G + 1] (device), with group_sizes
  int64_t total_rows = 0;              // C: rows of x, h and the stash
  int64_t hidden = 0;                  // H (K)
  int64_t intermediate = 0;            // I (N = 2 I)
  const uint16_t* x = nullptr;         // [C, H] bf16, row-major
  const uint16_t* w1 = nullptr;        // [G, H, 2 I] bf16, row-major (gate columns, then up)
  const float* weight = nullptr;       // [C] float32 router weight of each row (read when apply_weight)
  uint16_t* h = nullptr;               // [C, I] bf16 out
  uint16_t* stash = nullptr;           // [C, 2 I] bf16 out, or NULL (no stash)
  int apply_weight = 0;                // the router weight goes into FC1
  int has_clamp = 0;
  float limit = 0.0f;                  // the clamp's L (has_clamp)
  Fc1SwigluKernel kernel = Fc1SwigluKernel::kAuto;
};

// Whether this build has the kernels (CUTLASS, sm_90a) and p's shape fits them: 1 to 1024
// groups (the argument kernel is one block), I a multiple of 128, H a multiple of 8, 16-byte
// aligned x and W1, 4-byte aligned h and stash, at most INT_MAX rows and columns.
bool fc1_swiglu_gemm_supported(const Fc1SwigluProblem& p);

// Workspace bytes for p's number of groups on sm_count SMs, either kernel (0 without them).
size_t fc1_swiglu_gemm_workspace_bytes(const Fc1SwigluProblem& p, int sm_count);

// The launch (capturable: no host sync, nothing allocated). cudaErrorNotSupported when
// fc1_swiglu_gemm_supported(p) is false; cudaErrorInvalidValue for a short or misaligned
// workspace (128 bytes).
cudaError_t fc1_swiglu_gemm(const Fc1SwigluProblem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                            int sm_count);

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_FC1_SWIGLU_GEMM_H_
