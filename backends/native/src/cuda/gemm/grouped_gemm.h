// bf16 grouped GEMMs on Hopper tensor cores (CUTLASS 4.2, sm_90a), behind a plain
// C++ interface: no CUTLASS header is included here, so any TU of the core can call
// these. The CUTLASS instantiations live one per TU (grouped_gemm_{nn,nt,tn}.cu);
// grouped_gemm.cu dispatches. A build without CUTLASS (MOE_EP_NATIVE_CUTLASS=OFF)
// still links: grouped_gemm_supported() is then false and the launch returns
// cudaErrorNotSupported, so callers fall back to their own kernels.
//
// Contract of every launch:
//   * the per-group row counts are read only on the device (from `offsets`): no host
//     synchronisation, nothing allocated, so the launch can be captured in a CUDA graph;
//   * the caller provides the workspace (grouped_gemm_workspace_bytes); its size depends
//     only on layout, num_groups, the fixed dims and sm_count, never on the offsets' values;
//   * operands are bf16 (given as their uint16_t bit patterns), dense row-major, 16-byte
//     aligned base pointers; products are exact, sums are float32 in tensor-core order
//     (not the sequential order of the CPU kernels); D is float32, or bf16 (d_bf16).
#ifndef MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_H_
#define MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe_ep {
namespace cuda {

// Which operand is ragged and how B is stored. For group g, rows(g) = off[g+1] - off[g].
//   kNN (forward, ragged M):   D_g[rows(g), n] = A_g[rows(g), k] * B_g[k, n]
//   kNT (data grad, ragged M): D_g[rows(g), n] = A_g[rows(g), k] * (Bs_g[n, k])^T
//   kTN (weight grad, ragged K): D_g[m, n] = (A_g[rows(g), m])^T * B_g[rows(g), n]
enum class GemmLayout : int { kNN = 0, kNT = 1, kTN = 2 };

// The CUTLASS kernel a launch runs (grouped_gemm_kernel picks it for kAuto):
//   kCooperative:   cooperative 128x256x64, cluster 2x1 (every layout);
//   kPingpong:      pingpong 64x128x128, cluster 2x1 (kNN, kNT): few rows a group;
//   kCooperativeN2: cooperative 128x256x64, cluster 1x2 (kNN): a cluster's two CTAs on
//                   neighbouring N tiles, so no CTA idles on a group's odd M tile count.
enum class GemmKernel : int { kAuto = 0, kCooperative = 1, kPingpong = 2, kCooperativeN2 = 3 };

// One grouped GEMM over num_groups groups:  D_g = A_g * B_g + (accumulate ? D_g : 0).
// Operands (all dense row-major):
//   layout kNN:
//     a [total_rows, k] bf16: rows off[g]..off[g+1] are A_g;
//     b [num_groups, k, n] bf16: B_g (group stride k*n elements);
//     d [total_rows, n] float32: rows off[g]..off[g+1] are D_g (other rows untouched).
//   layout kNT:
//     a [total_rows, k] bf16: as kNN;
//     b [num_groups, n, k] bf16: B_g is the transpose of b[g] (group stride n*k);
//     d [total_rows, n] float32: as kNN.
//   layout kTN:
//     a [total_rows, m] bf16: A_g is the transpose of rows off[g]..off[g+1];
//     b [total_rows, n] bf16: rows off[g]..off[g+1] are B_g;
//     d [num_groups, m, n] float32: D_g (group stride m*n). A group with no rows gets
//       D_g = accumulate ? D_g : 0 (zeros written on the device).
//   offsets [num_groups + 1] int32, device: off[0] = 0, nondecreasing,
//     off[num_groups] <= total_rows. Never read on the host. Rows past off[num_groups]
//     are not read (kTN) or not written (kNN, kNT).
// The fixed dims: kNN and kNT use n and k (m is ignored); kTN uses m and n (k is ignored).
struct GroupedGemmProblem {
  GemmLayout layout = GemmLayout::kNN;
  int32_t num_groups = 0;
  const int32_t* offsets = nullptr;  // [num_groups + 1] int32, device
  // Or the offsets made on the device from group_sizes [num_groups] int32 (device):
  // off[0] = 0, off[g + 1] = min(off[g] + max(group_sizes[g], 0), total_rows), written to
  // offsets_out [num_groups + 1] int32 (device) by the launch that builds the groups'
  // arguments, before the GEMM runs (later kernels on the stream may read them there).
  // offsets is then not read. One launch fewer than a separate offsets kernel.
  const int32_t* group_sizes = nullptr;
  int32_t* offsets_out = nullptr;
  int64_t total_rows = 0;            // rows of the ragged operands (an upper bound on off[num_groups])
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  const uint16_t* a = nullptr;  // bf16 bit patterns, device, 16-byte aligned
  const uint16_t* b = nullptr;  // bf16 bit patterns, device, 16-byte aligned
  float* d = nullptr;           // float32, device, 16-byte aligned
  // kNN or kTN without accumulate only: D as bf16 instead (d then unused): the float32
  // accumulator rounded to nearest even, bf16 bit patterns of D's shape ([total_rows, n] for
  // kNN, [num_groups, m, n] for kTN: a group with no rows gets bf16 zeros), device, 16-byte aligned.
  uint16_t* d_bf16 = nullptr;
  bool accumulate = false;      // D_g += A_g * B_g instead of D_g = A_g * B_g
  // The kernel; kAuto (the default) lets grouped_gemm_kernel choose. Set for tests and
  // timings of one kernel; a kernel the layout does not have is not supported. Results
  // do not depend on it beyond float32 summation order.
  GemmKernel kernel = GemmKernel::kAuto;
};

// The kernel a launch of p runs: p.kernel, or for kAuto:
//   kTN: the cooperative kernel;
//   kNN where n spans an even number of 256-column tiles (n = 4096, 7168, ...): the
//     cooperative 1x2 kernel at any rows a group (2026-12-02, run 27: the one-rank jax-ffi
//     forward 5.90 ms against 6.03 with the 2x1 kernel; the FC1 GEMM at 32 rows a group
//     0.45 ms against the pingpong kernel's 0.63);
//   otherwise (kNT, and kNN with an odd count): few rows a group (total_rows / num_groups
//     at most 128, read on the host, never from the offsets; or n <= 128) the pingpong
//     64x128x128 kernel, else the cooperative 2x1 kernel.
// MOE_EP_GEMM_KNN=cooperative|pingpong|cooperative_1x2 (read once) overrides the kNN
// choice, to time the kernels in a whole layer.
GemmKernel grouped_gemm_kernel(const GroupedGemmProblem& p);

// "cooperative", "pingpong" or "cooperative_1x2": grouped_gemm_kernel(p)'s name.
const char* grouped_gemm_kernel_name(const GroupedGemmProblem& p);

// True when this build has the CUTLASS kernels (MOE_EP_NATIVE_WITH_CUTLASS) and the
// problem is supported: num_groups in [1, 1024]; every row length (k and n for
// kNN/kNT, m and n for kTN) a positive multiple of 8 elements and below 2^31; total_rows
// in [0, 2^31); non-null operands 16-byte aligned; d_bf16 only with kNN or kTN and no accumulate;
// p.kernel one the layout has.
// Does not look at the offsets. The
// device must be sm_90 (the kernels are sm_90a only): callers check the device once.
bool grouped_gemm_supported(const GroupedGemmProblem& p);

// True when this build contains the CUTLASS kernels at all.
bool grouped_gemm_built();

// Bytes of device workspace a launch of p needs on a device with sm_count SMs (the
// device's multiProcessorCount): the per-group pointer/stride/shape arrays plus
// CUTLASS's own workspace. Depends only on layout, num_groups, m/n/k and sm_count.
// 0 when the problem is not supported.
size_t grouped_gemm_workspace_bytes(const GroupedGemmProblem& p, int sm_count);

// Enqueues the grouped GEMM on stream. workspace: device memory of at least
// grouped_gemm_workspace_bytes(p, sm_count) bytes, 256-byte aligned, for this stream's
// exclusive use until the launch completes (its contents need not be initialised).
// sm_count: as passed to grouped_gemm_workspace_bytes (0: asks the current device,
// cudaDeviceGetAttribute, which is not a sync). Returns cudaSuccess, cudaErrorNotSupported
// for an unsupported problem, cudaErrorInvalidValue for a too-small workspace, or the
// launch error. Allocates nothing, never synchronises.
cudaError_t grouped_gemm_bf16(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream, int sm_count = 0);

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_H_
