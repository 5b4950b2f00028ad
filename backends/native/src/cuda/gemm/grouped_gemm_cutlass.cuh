// The CUTLASS 4.2 ptr-array grouped GEMM (sm_90a, bf16 x bf16 -> float32 or bf16, float32
// accumulate) shared by the per-instantiation TUs grouped_gemm_{nn,nt,tn}{,_pingpong}.cu. Include it
// only from those TUs (each instantiates ONE kernel: ~100 s and ~3.4 GB of nvcc each), compiled
// with -DNDEBUG for sm_90a, and from fc1_swiglu_gemm.cu, which takes its workspace helpers.
//
// How a launch goes (the pattern of PyTorch's torch._grouped_mm):
//   1. build_group_args<<<1, num_groups>>> reads the device offsets and writes, per group,
//      the problem shape (M, N, K), the A/B/C/D pointers and the strides into the caller's
//      workspace;
//   2. the CUTLASS kernel (persistent, group tile scheduler) reads those arrays on the
//      device. The host problem shapes are nullptr, so nothing about the groups' sizes is
//      known or needed on the host: no sync, CUDA-graph capturable.
// C aliases D; beta = accumulate ? 1 : 0 (with beta = 0 CUTLASS does not load C).
#ifndef MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_CUTLASS_CUH_
#define MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_CUTLASS_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/pdl.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"

#include "cuda/gemm/group_rows.cuh"
#include "cuda/gemm/grouped_gemm.h"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the grouped GEMM needs CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED (CUDA >= 12.3, compiled for sm_90a)"
#endif

namespace moe_ep {
namespace cuda {
namespace gemm_detail {

struct CooperativeSchedule {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct PingpongSchedule {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// kLayout fixes the operand layouts (CUTLASS's view: A is M x K, B is K x N, D is M x N):
//   kNN: A row-major (K-major), B row-major (N-major),  D row-major;
//   kNT: A row-major (K-major), B column-major (K-major), D row-major;
//   kTN: A column-major (M-major), B row-major (N-major), D row-major.
// Out: the element of D (float, or cutlass::bfloat16_t: the float32 accumulator rounded to
// nearest even in the epilogue; then D is GroupedGemmProblem::d_bf16, kNN or kTN without
// accumulate).
template <GemmLayout kLayout, class TileShape_, class ClusterShape_, class Schedule, class Out = float>
struct GroupedGemm {
  static constexpr GemmLayout layout = kLayout;
  static constexpr bool kBf16Out = std::is_same<Out, cutlass::bfloat16_t>::value;
  static_assert(!kBf16Out || kLayout == GemmLayout::kNN || kLayout == GemmLayout::kTN,
                "a bf16 D is for the forward (kNN) and the weight gradients (kTN) only");
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementC = Out;
  using ElementD = Out;
  using ElementAccumulator = float;
  using LayoutA = std::conditional_t<kLayout == GemmLayout::kTN, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<kLayout == GemmLayout::kNT, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(ElementA);  // 8 elements: 16-byte TMA rows
  static constexpr int kAlignCD = 16 / sizeof(ElementD);  // 4 (float) or 8 (bf16) elements
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
      ElementC, LayoutD*, kAlignCD, ElementD, LayoutD*, kAlignCD, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator, ElementC,
                                                   ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB,
      LayoutB*, kAlignAB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using StrideD = typename GemmKernel::InternalStrideD;
  static_assert(std::is_same<StrideC, StrideD>::value, "C aliases D: one stride array serves both");
  using Shape = typename ProblemShape::UnderlyingProblemShape;

  // The problem's D as this instantiation's element.
  static __host__ __device__ ElementD* d_of(const GroupedGemmProblem& p) {
    if constexpr (kBf16Out) return reinterpret_cast<ElementD*>(p.d_bf16);
    else return p.d;
  }
};

// Where the per-group arrays and CUTLASS's workspace sit in the caller's workspace.
struct WorkspaceLayout {
  size_t shapes = 0, ptr_a = 0, ptr_b = 0, ptr_d = 0, stride_a = 0, stride_b = 0, stride_d = 0;
  size_t cutlass = 0, cutlass_bytes = 0, total = 0;
};

constexpr size_t kWorkspaceAlign = 256;
inline size_t align_up(size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

template <class G>
typename G::Gemm::Arguments make_arguments(const GroupedGemmProblem& p, char* ws, const WorkspaceLayout& w,
                                           int sm_count) {
  typename G::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {p.num_groups, reinterpret_cast<typename G::Shape*>(ws + w.shapes), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const typename G::ElementA**>(ws + w.ptr_a);
  args.mainloop.dA = reinterpret_cast<typename G::StrideA*>(ws + w.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const typename G::ElementB**>(ws + w.ptr_b);
  args.mainloop.dB = reinterpret_cast<typename G::StrideB*>(ws + w.stride_b);
  args.epilogue.ptr_C = reinterpret_cast<const typename G::ElementC**>(ws + w.ptr_d);
  args.epilogue.dC = reinterpret_cast<typename G::StrideC*>(ws + w.stride_d);
  args.epilogue.ptr_D = reinterpret_cast<typename G::ElementD**>(ws + w.ptr_d);
  args.epilogue.dD = reinterpret_cast<typename G::StrideD*>(ws + w.stride_d);
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = p.accumulate ? 1.0f : 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  args.hw_info.device_id = 0;  // only read when sm_count <= 0; ours is always set
  args.hw_info.sm_count = sm_count;
  return args;
}

template <class G>
WorkspaceLayout workspace_layout(const GroupedGemmProblem& p, int sm_count) {
  const size_t g = static_cast<size_t>(p.num_groups);
  WorkspaceLayout w;
  size_t at = 0;
  w.shapes = at;   at = align_up(at + g * sizeof(typename G::Shape));
  w.ptr_a = at;    at = align_up(at + g * sizeof(void*));
  w.ptr_b = at;    at = align_up(at + g * sizeof(void*));
  w.ptr_d = at;    at = align_up(at + g * sizeof(void*));
  w.stride_a = at; at = align_up(at + g * sizeof(typename G::StrideA));
  w.stride_b = at; at = align_up(at + g * sizeof(typename G::StrideB));
  w.stride_d = at; at = align_up(at + g * sizeof(typename G::StrideD));
  w.cutlass = at;
  // CUTLASS's workspace (tensor maps per SM, scheduler) depends on num_groups and sm_count only.
  auto args = make_arguments<G>(p, nullptr, w, sm_count);
  w.cutlass_bytes = G::Gemm::get_workspace_size(args);
  w.total = align_up(at + w.cutlass_bytes);
  return w;
}

// The leading dimension of a packed 2-D stride (cute::Stride<int64_t, _1, _0> or
// Stride<_1, int64_t, _0>): make_cute_packed_stride takes it from the shape's mode that
// the stride type says is strided, so both modes get ld.
template <class Stride>
__device__ __forceinline__ Stride leading_stride(int64_t ld) {
  return cutlass::make_cute_packed_stride(Stride{}, cute::make_shape(static_cast<int>(ld), static_cast<int>(ld), 1));
}

// One thread per group: offsets -> shapes, pointers, strides (see grouped_gemm.h for
// the operand layouts). Malformed offsets are clamped to [0, total_rows] so that a
// bad input cannot send TMA outside the operands.
template <class G>
__global__ void build_group_args(GroupedGemmProblem p, typename G::Shape* shapes, const typename G::ElementA** ptr_a,
                                 const typename G::ElementB** ptr_b, typename G::ElementD** ptr_d,
                                 typename G::StrideA* stride_a, typename G::StrideB* stride_b,
                                 typename G::StrideD* stride_d) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh): after the stage's previous kernel
  const int g = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  // The offsets, or made from the sizes and published (one block: launch below).
  const GroupRows gr = group_rows(g, p.offsets, p.group_sizes, p.offsets_out, p.total_rows);
  const int64_t start = gr.start, end = gr.end;
  const int rows = static_cast<int>(end - start);
  const auto* a = reinterpret_cast<const typename G::ElementA*>(p.a);
  const auto* b = reinterpret_cast<const typename G::ElementB*>(p.b);
  if constexpr (G::layout == GemmLayout::kTN) {
    // Ragged K. An empty group gets M = 0 (no tiles); its D is handled by zero_empty_groups.
    shapes[g] = cute::make_shape(rows > 0 ? static_cast<int>(p.m) : 0, static_cast<int>(p.n), rows);
    ptr_a[g] = a + start * p.m;
    ptr_b[g] = b + start * p.n;
    ptr_d[g] = G::d_of(p) + static_cast<int64_t>(g) * p.m * p.n;
    stride_a[g] = leading_stride<typename G::StrideA>(p.m);
    stride_b[g] = leading_stride<typename G::StrideB>(p.n);
  } else {
    // Ragged M; an empty group has no tiles.
    shapes[g] = cute::make_shape(rows, static_cast<int>(p.n), static_cast<int>(p.k));
    ptr_a[g] = a + start * p.k;
    ptr_b[g] = b + static_cast<int64_t>(g) * p.k * p.n;
    ptr_d[g] = G::d_of(p) + start * p.n;
    stride_a[g] = leading_stride<typename G::StrideA>(p.k);
    stride_b[g] = leading_stride<typename G::StrideB>(G::layout == GemmLayout::kNT ? p.k : p.n);
  }
  stride_d[g] = leading_stride<typename G::StrideD>(p.n);
}

// kTN without accumulate: D_g = 0 for the groups with no rows (CUTLASS runs no tile for
// them), of the D element T (float, or cutlass::bfloat16_t: zero bits either way). grid
// (x, num_groups); blocks of non-empty groups return at once. static: each TU that includes
// this header has its own copy (only the kTN TUs launch it).
template <class T>
static __global__ void zero_empty_groups(const int32_t* offsets, int64_t total_rows, int64_t group_elems, T* d) {
  const int g = blockIdx.y;
  int64_t start = offsets[g], end = offsets[g + 1];
  start = start < 0 ? 0 : (start > total_rows ? total_rows : start);
  end = end < start ? start : (end > total_rows ? total_rows : end);
  if (end > start) return;
  // group_elems is a multiple of 64 (m and n multiples of 8): whole 16-byte vectors.
  uint4* out = reinterpret_cast<uint4*>(d + static_cast<int64_t>(g) * group_elems);
  const int64_t n16 = group_elems * static_cast<int64_t>(sizeof(T)) / 16;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

template <class G>
size_t workspace_bytes(const GroupedGemmProblem& p, int sm_count) {
  return workspace_layout<G>(p, sm_count).total;
}

inline cudaError_t status_to_error(cutlass::Status s) {
  switch (s) {
    case cutlass::Status::kSuccess: return cudaSuccess;
    case cutlass::Status::kErrorMisalignedOperand:
    case cutlass::Status::kErrorInvalidProblem:
    case cutlass::Status::kErrorNotSupported: return cudaErrorNotSupported;
    case cutlass::Status::kErrorWorkspaceNull: return cudaErrorInvalidValue;
    default: {
      const cudaError_t e = cudaGetLastError();
      return e != cudaSuccess ? e : cudaErrorLaunchFailure;
    }
  }
}

template <class G>
cudaError_t launch(const GroupedGemmProblem& p, void* workspace, size_t workspace_size, cudaStream_t stream,
                   int sm_count) {
  const WorkspaceLayout w = workspace_layout<G>(p, sm_count);
  if (workspace == nullptr || workspace_size < w.total) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(workspace) % 128 != 0) return cudaErrorInvalidValue;  // tensor maps: 128-byte aligned
  char* ws = static_cast<char*>(workspace);

  (void)launch_pdl(
      build_group_args<G>, 1, static_cast<unsigned>(p.num_groups), 0, stream, p,
      reinterpret_cast<typename G::Shape*>(ws + w.shapes),
      reinterpret_cast<const typename G::ElementA**>(ws + w.ptr_a),
      reinterpret_cast<const typename G::ElementB**>(ws + w.ptr_b),
      reinterpret_cast<typename G::ElementD**>(ws + w.ptr_d), reinterpret_cast<typename G::StrideA*>(ws + w.stride_a),
      reinterpret_cast<typename G::StrideB*>(ws + w.stride_b), reinterpret_cast<typename G::StrideD*>(ws + w.stride_d));
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;

  if constexpr (G::layout == GemmLayout::kTN) {
    if (!p.accumulate) {
      const int64_t elems = p.m * p.n;
      const int64_t blocks = (elems * static_cast<int64_t>(sizeof(typename G::ElementD)) / 16 + 255) / 256;
      dim3 grid(static_cast<unsigned>(blocks < 128 ? blocks : 128), static_cast<unsigned>(p.num_groups));
      zero_empty_groups<typename G::ElementD><<<grid, 256, 0, stream>>>(
          p.group_sizes != nullptr ? p.offsets_out : p.offsets, p.total_rows, elems, G::d_of(p));
      e = cudaGetLastError();
      if (e != cudaSuccess) return e;
    }
  }

  auto args = make_arguments<G>(p, ws, w, sm_count);
  typename G::Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  s = gemm.initialize(args, w.cutlass_bytes > 0 ? ws + w.cutlass : nullptr, stream);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  return cudaGetLastError();
}

}  // namespace gemm_detail
}  // namespace cuda
}  // namespace moe_ep

// Defines name##_workspace_bytes / name##_launch (grouped_gemm_impl.h) for one configuration.
#define MOE_EP_GROUPED_GEMM_DEFINE(name, ...)                                                         \
  namespace moe_ep {                                                                                  \
  namespace cuda {                                                                                    \
  namespace gemm_detail {                                                                             \
  size_t name##_workspace_bytes(const GroupedGemmProblem& p, int sm_count) {                         \
    return workspace_bytes<__VA_ARGS__>(p, sm_count);                                                 \
  }                                                                                                   \
  cudaError_t name##_launch(const GroupedGemmProblem& p, void* workspace, size_t ws_bytes,           \
                            cudaStream_t stream, int sm_count) {                                      \
    return launch<__VA_ARGS__>(p, workspace, ws_bytes, stream, sm_count);                            \
  }                                                                                                   \
  }                                                                                                   \
  }                                                                                                   \
  }

#endif  // MOE_EP_NATIVE_CUDA_GEMM_GROUPED_GEMM_CUTLASS_CUH_
