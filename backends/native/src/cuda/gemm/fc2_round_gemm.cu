// FC2 with the nvfp4 round trip in its epilogue (fc2_round_gemm.h): one CUTLASS 4.2
// instantiation (this TU, compiled for sm_90a with -DNDEBUG and --fmad=false like
// fc1_swiglu_gemm.cu): the ptr-array cooperative kernel, tile 128x256x64, cluster 1x2 (the
// layer's bf16 FC2 kernel, grouped_gemm_nn_coop_n2_bf16.cu), with CUTLASS's mainloop and an
// epilogue with no C and no D whose fusion callbacks (Fc2RoundCallbacks) take each 128x128
// subtile of the float32 accumulator in registers (reduce(): the whole subtile), group each
// thread's values by row and 16-column block (columns 0, 1, 8 and 9 of the thread's share of
// a block, found at compile time from the subtile's coordinate layout), agree on the block's
// maximum with the quad's other lanes and store the round-tripped values as bf16.
// Only the experts' rows are written (the caller zeroes the rest); build_fc2_args clamps
// malformed offsets to [0, total_rows] as grouped_gemm_cutlass.cuh's build_group_args does.
#include "cuda/gemm/fc2_round_gemm.h"

#if defined(MOE_EP_NATIVE_WITH_CUTLASS)

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"

#include "cuda/format_math.cuh"
#include "cuda/gemm/epilogue_coords.hpp"
#include "cuda/gemm/group_rows.cuh"
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/pdl.cuh"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the FC2 round-trip GEMM needs CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED (CUDA >= 12.3, sm_90a)"
#endif

namespace moe_ep {
namespace cuda {
namespace fc2_detail {

using namespace cute;
using epilogue::column_of;
using epilogue::element_at;

constexpr int kBlock = 16;  // nvfp4's block: 16 columns of a row

// What the epilogue needs besides the accumulator.
struct EpilogueArgs {
  const int32_t* offsets = nullptr;  // [G + 1] the groups' first rows
  int64_t total_rows = 0;
  const float* weight = nullptr;
  uint16_t* y = nullptr;
  int64_t H = 0;
  int apply_weight = 0;
};

// The fusion callbacks (used as they are, not through an EVT tree): the accumulator passes
// through visit(); reduce() does the work on the whole subtile.
struct Fc2RoundCallbacks {
  using ElementAux = cutlass::bfloat16_t;  // the collective's stand-in for D's element (D is void)
  struct SharedStorage {};
  using Arguments = EpilogueArgs;
  using Params = EpilogueArgs;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE Fc2RoundCallbacks() {}
  CUTLASS_HOST_DEVICE Fc2RoundCallbacks(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue res, int base_m, int base_n, int rows, int cols,
                                          int64_t row0, Params const& p)
        : tCcD(c), residue(res), base_m(base_m), base_n(base_n), rows(rows), cols(cols), row0(row0), params(p) {}

    CoordTensor tCcD;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): coordinates relative to the thread's first element
    Residue residue;
    int base_m, base_n;  // the thread's first element in the group's problem (row, column)
    int rows, cols;      // the group's rows (M) and columns (N = H)
    int64_t row0;        // the group's first row in h and y
    Params const& params;

    template <class ElementAccumulator, int kFrag>
    CUTLASS_DEVICE cutlass::Array<ElementAccumulator, kFrag> visit(cutlass::Array<ElementAccumulator, kFrag> const& frg_acc,
                                                                   int, int, int) {
      return frg_acc;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      Tensor cD = tCcD(_, _, _, epi_m, epi_n);  // this subtile's elements of the thread
      using CL = decltype(cD.layout());
      static_assert(is_static<CL>::value, "the subtile's coordinate layout is static");
      constexpr int kN = decltype(size(CL{}))::value;
      constexpr int kFrags = decltype(size(visit_results))::value;
      constexpr int kF = kN / kFrags;
      static_assert(kF * kFrags == kN, "whole fragments");
      auto v = [&](int k) { return static_cast<float>(visit_results(k / kF)[k % kF]); };
      // The thread's first column is 2 q of a block (q = lane % 4; the subtile starts on a
      // block): element k leads a share (columns 0, 1, 8, 9 of it) when its relative column is
      // a multiple of the block, and the share's other three lanes are lane ^ 1, 2, 3.
      for_each(make_int_sequence<kN>{}, [&](auto K) {
        constexpr int k = decltype(K)::value;
        if constexpr (column_of<CL>(k) % kBlock == 0) {
          constexpr int k1 = element_at<CL>(k, 0, 1), k8 = element_at<CL>(k, 0, 8), k9 = element_at<CL>(k, 0, 9);
          static_assert(k1 >= 0 && k8 >= 0 && k9 >= 0, "a thread holds columns 0, 1, 8 and 9 of its share of a block");
          const auto crd = cD(k);
          const int m = base_m + static_cast<int>(get<0>(crd));
          const int n = base_n + static_cast<int>(get<1>(crd));
          // A row of the group, a block inside N (a cluster's second CTA may hold a tile past N;
          // H is a multiple of 16, so a block is inside or outside whole). The quad's lanes share m and n's block.
          const bool here = m < rows && n < cols;
          const int64_t r = row0 + m;
          float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          if (here) {
            x[0] = v(k), x[1] = v(k1), x[2] = v(k8), x[3] = v(k9);
            if (params.apply_weight) {
              const float w = params.weight[r];
#pragma unroll
              for (int j = 0; j < 4; ++j) x[j] = detail::fmul(w, x[j]);
            }
          }
          const detail::BlockMax bm = detail::group_block_max<4>(x);  // every lane: full-mask shuffles
          if (here) {
            detail::nvfp4_round_trip_with(bm, x, 4);
            uint16_t* yr = params.y + r * params.H + n;
            *reinterpret_cast<uint32_t*>(yr) = detail::bf16_pair(detail::bf16_from_float(x[0]), detail::bf16_from_float(x[1]));
            *reinterpret_cast<uint32_t*>(yr + 8) =
                detail::bf16_pair(detail::bf16_from_float(x[2]), detail::bf16_from_float(x[3]));
          }
        }
      });
    }
  };

  template <bool RefSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    const auto [M, N, K, L] = args.problem_shape_mnkl;
    const auto l = get<3>(args.tile_coord_mnkl);
    const int base_m = static_cast<int>(M) - static_cast<int>(get<0>(args.residue_tCcD));
    const int base_n = static_cast<int>(N) - static_cast<int>(get<1>(args.residue_tCcD));
    int64_t row0 = params.offsets[l];
    row0 = row0 < 0 ? 0 : (row0 > params.total_rows ? params.total_rows : row0);
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        args.tCcD, args.residue_tCcD, base_m, base_n, static_cast<int>(M), static_cast<int>(N), row0, params);
  }
};

using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N = H, K = I) a group
using GroupShape = typename ProblemShape::UnderlyingProblemShape;
using ClusterShape = Shape<_1, _2, _1>;
using TileShape = Shape<_128, _256, _64>;
using EpilogueTile = Shape<_128, _128>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float, void,
    LayoutD*, 8, void, LayoutD*, 8, EpilogueSchedule, Fc2RoundCallbacks>::CollectiveOp;
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, 8, Element, LayoutB*, 8, float, TileShape,
    ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;

// The workspace: grouped_gemm_cutlass.cuh's layout (its ptr_d and stride_d unused: no D).
using gemm_detail::WorkspaceLayout;
using gemm_detail::align_up;
using gemm_detail::leading_stride;
using gemm_detail::status_to_error;

Gemm::Arguments make_arguments(const Fc2RoundProblem& p, char* ws, const WorkspaceLayout& w, int sm_count) {
  Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {p.num_groups, reinterpret_cast<GroupShape*>(ws + w.shapes), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const Element**>(ws + w.ptr_a);
  args.mainloop.dA = reinterpret_cast<StrideA*>(ws + w.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const Element**>(ws + w.ptr_b);
  args.mainloop.dB = reinterpret_cast<StrideB*>(ws + w.stride_b);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = nullptr;
  args.epilogue.dD = nullptr;
  EpilogueArgs& e = args.epilogue.thread;
  e.offsets = p.offsets;
  e.total_rows = p.total_rows;
  e.weight = p.weight;
  e.y = p.y;
  e.H = p.hidden;
  e.apply_weight = p.apply_weight;
  args.hw_info.device_id = 0;  // only read when sm_count <= 0; ours is always set
  args.hw_info.sm_count = sm_count;
  return args;
}

WorkspaceLayout workspace_layout(const Fc2RoundProblem& p, int sm_count) {
  const size_t g = static_cast<size_t>(p.num_groups);
  WorkspaceLayout w;
  size_t at = 0;
  w.shapes = at;   at = align_up(at + g * sizeof(GroupShape));
  w.ptr_a = at;    at = align_up(at + g * sizeof(void*));
  w.ptr_b = at;    at = align_up(at + g * sizeof(void*));
  w.stride_a = at; at = align_up(at + g * sizeof(StrideA));
  w.stride_b = at; at = align_up(at + g * sizeof(StrideB));
  w.cutlass = at;
  auto args = make_arguments(p, nullptr, w, sm_count);
  w.cutlass_bytes = Gemm::get_workspace_size(args);
  w.total = align_up(at + w.cutlass_bytes);
  return w;
}

// One thread per group: its rows (offsets clamped to [0, total_rows]) -> shapes, pointers, strides.
__global__ void build_fc2_args(Fc2RoundProblem p, GroupShape* shapes, const Element** ptr_a, const Element** ptr_b,
                               StrideA* stride_a, StrideB* stride_b) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  const int g = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const GroupRows gr = group_rows(g, p.offsets, nullptr, nullptr, p.total_rows);
  const int64_t I = p.intermediate, H = p.hidden;
  shapes[g] = make_shape(static_cast<int>(gr.end - gr.start), static_cast<int>(H), static_cast<int>(I));
  ptr_a[g] = reinterpret_cast<const Element*>(p.h) + gr.start * I;
  ptr_b[g] = reinterpret_cast<const Element*>(p.w2) + static_cast<int64_t>(g) * I * H;
  stride_a[g] = leading_stride<StrideA>(I);
  stride_b[g] = leading_stride<StrideB>(H);
}

}  // namespace fc2_detail

bool fc2_round_gemm_supported(const Fc2RoundProblem& p) {
  constexpr int64_t kMaxDim = 2147483647;
  const uintptr_t a16 = reinterpret_cast<uintptr_t>(p.h) | reinterpret_cast<uintptr_t>(p.w2);
  return p.num_groups > 0 && p.num_groups <= 1024 && p.offsets != nullptr && p.total_rows >= 0 &&
         p.total_rows < kMaxDim && p.hidden > 0 && p.hidden % fc2_detail::kBlock == 0 && p.hidden < kMaxDim &&
         p.intermediate > 0 && p.intermediate % 8 == 0 && p.intermediate < kMaxDim && p.h != nullptr &&
         p.w2 != nullptr && p.y != nullptr && (p.apply_weight == 0 || p.weight != nullptr) && a16 % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.y) % 4 == 0;
}

size_t fc2_round_gemm_workspace_bytes(const Fc2RoundProblem& p, int sm_count) {
  return fc2_detail::workspace_layout(p, sm_count).total;
}

cudaError_t fc2_round_gemm(const Fc2RoundProblem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                           int sm_count) {
  using namespace fc2_detail;
  if (!fc2_round_gemm_supported(p) || sm_count <= 0) return cudaErrorNotSupported;
  const WorkspaceLayout w = workspace_layout(p, sm_count);
  if (workspace == nullptr || workspace_bytes < w.total || reinterpret_cast<uintptr_t>(workspace) % 128 != 0)
    return cudaErrorInvalidValue;
  char* ws = static_cast<char*>(workspace);
  (void)launch_pdl(build_fc2_args, 1, static_cast<unsigned>(p.num_groups), 0, stream, p,
                   reinterpret_cast<GroupShape*>(ws + w.shapes), reinterpret_cast<const Element**>(ws + w.ptr_a),
                   reinterpret_cast<const Element**>(ws + w.ptr_b), reinterpret_cast<StrideA*>(ws + w.stride_a),
                   reinterpret_cast<StrideB*>(ws + w.stride_b));
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  auto args = make_arguments(p, ws, w, sm_count);
  Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  s = gemm.initialize(args, w.cutlass_bytes > 0 ? ws + w.cutlass : nullptr, stream);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace moe_ep

#else  // no CUTLASS: the caller runs FC2 and its pass

namespace moe_ep {
namespace cuda {
bool fc2_round_gemm_supported(const Fc2RoundProblem&) { return false; }
size_t fc2_round_gemm_workspace_bytes(const Fc2RoundProblem&, int) { return 0; }
cudaError_t fc2_round_gemm(const Fc2RoundProblem&, void*, size_t, cudaStream_t, int) { return cudaErrorNotSupported; }
}  // namespace cuda
}  // namespace moe_ep

#endif
