// FC1 with the SwiGLU in its epilogue (fc1_swiglu_gemm.h): two CUTLASS 4.2 instantiations
// (this TU, compiled for sm_90a with -DNDEBUG like grouped_gemm_cutlass.cuh's): the ptr-array
// cooperative kernel, tile 128x256x64, and the pingpong one, 64x256x64, cluster 1x2
// (grouped_gemm_nn_coop_n2.cu's reason), with
//   - the mainloop of gated_mainloop.hpp: B's N mode gated, so a tile's 256 columns are two
//     blocks of 64 gate columns each followed by its 64 up columns;
//   - an epilogue with no C and no D, whose fusion callbacks (Fc1SwigluCallbacks) take each
//     128x128 (64x128) subtile of the float32 accumulator in registers (reduce(): the whole subtile),
//     pair every gate value with its up value (the element 64 columns on in the same thread,
//     found at compile time from the subtile's coordinate layout) and store h and the stash
//     straight to global memory, two bf16 columns a store.
// Only the experts' rows are written (the caller zeroes the rest); build_fc1_args clamps
// malformed offsets to [0, total_rows] as grouped_gemm_cutlass.cuh's build_group_args does.
#include "cuda/gemm/fc1_swiglu_gemm.h"

#if defined(MOE_EP_NATIVE_WITH_CUTLASS)

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

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
#include "cuda/gemm/gated_mainloop.hpp"
#include "cuda/gemm/group_rows.cuh"
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/pdl.cuh"
#include "cuda/swiglu.cuh"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the FC1 SwiGLU GEMM needs CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED (CUDA >= 12.3, sm_90a)"
#endif

namespace moe_ep {
namespace cuda {
namespace fc1_detail {

using namespace cute;

constexpr int kGate = 64;  // gate columns of a block (MoeEpGatedCollectiveMma::kGate)
constexpr int kBatch = 16;  // the epilogue's elements a batch (Fc1SwigluCallbacks::reduce)

// What the epilogue needs besides the accumulator.
struct EpilogueArgs {
  const int32_t* offsets = nullptr;  // [G + 1] the groups' first rows (made before the GEMM runs)
  int64_t total_rows = 0;
  const float* weight = nullptr;
  uint16_t* h = nullptr;
  uint16_t* stash = nullptr;
  int64_t I = 0;
  int apply_weight = 0;
  int has_clamp = 0;
  float limit = 0.0f;
};

// The index of the element of the coordinate layout CL at (m, n) of element k plus (dm, dn), or
// -1: evaluated at compile time (CL is static: a thread's subtile, relative coordinates).
template <class CL>
CUTE_HOST_DEVICE constexpr int element_at(int k, int dm, int dn) {
  constexpr int n = decltype(size(CL{}))::value;
  const auto ck = CL{}(k);
  const int m0 = static_cast<int>(get<0>(ck)) + dm, n0 = static_cast<int>(get<1>(ck)) + dn;
  for (int j = 0; j < n; ++j) {
    const auto cj = CL{}(j);
    if (static_cast<int>(get<0>(cj)) == m0 && static_cast<int>(get<1>(cj)) == n0) return j;
  }
  return -1;
}

// The index of the first element of the coordinate layout CL in the row of element k
// (compile time, as element_at).
template <class CL>
CUTE_HOST_DEVICE constexpr int first_in_row(int k) {
  const int m = static_cast<int>(get<0>(CL{}(k)));
  for (int j = 0; j < k; ++j)
    if (static_cast<int>(get<0>(CL{}(j))) == m) return j;
  return k;
}

// The column (relative to the thread's first element) and row of element k of CL.
template <class CL>
CUTE_HOST_DEVICE constexpr int col_of(int k) {
  return static_cast<int>(get<1>(CL{}(k)));
}
template <class CL>
CUTE_HOST_DEVICE constexpr int row_of(int k) {
  return static_cast<int>(get<0>(CL{}(k)));
}
// Element k has its up value (the element kGate columns on) in the thread: a gate element.
template <class CL>
CUTE_HOST_DEVICE constexpr bool has_up(int k) {
  return element_at<CL>(k, 0, kGate) >= 0;
}

// What the epilogue's paired path (Fc1SwigluCallbacks::reduce) needs of a thread's subtile CL,
// at compile time: every gate element at an even column stored with the next column (itself
// a gate element, in the same batch), every one at an odd column with the previous one;
// then the columns' extent, which reduce compares with the thread's first column.
// (From the elements' coordinates listed once: element_at per element exceeds the compiler's
// constexpr budget.)
struct SubtileColumns {
  bool paired = true;
  int max_gate = 0;      // the largest column of a gate element
  int min_up = 1 << 30;  // the smallest column of an element without its up value (an up value)
  int max = 0;           // the largest column
};
template <class CL>
CUTE_HOST_DEVICE constexpr SubtileColumns subtile_columns() {
  constexpr int n = decltype(size(CL{}))::value;
  int row[n] = {}, col[n] = {};
  for (int k = 0; k < n; ++k) row[k] = row_of<CL>(k), col[k] = col_of<CL>(k);
  auto at = [&](int k, int dm, int dn) {
    for (int j = 0; j < n; ++j)
      if (row[j] == row[k] + dm && col[j] == col[k] + dn) return j;
    return -1;
  };
  SubtileColumns r;
  for (int k = 0; k < n; ++k) {
    const int c = col[k];
    r.max = c > r.max ? c : r.max;
    if (at(k, 0, kGate) < 0) {
      r.min_up = c < r.min_up ? c : r.min_up;
      continue;
    }
    r.max_gate = c > r.max_gate ? c : r.max_gate;
    const int next = at(k, 0, (c & 1) == 0 ? 1 : -1);
    if (next < 0 || at(next, 0, kGate) < 0 || next / kBatch != k / kBatch) r.paired = false;
  }
  return r;
}

// Element k of a thread's subtile of kN elements from the fusion callbacks' visit_results
// (the elements in the subtile's coordinate-layout order, kN / size(visit_results) a fragment).
template <int kN, class VTensor>
CUTLASS_DEVICE float subtile_value(VTensor const& visit_results, int k) {
  constexpr int kFrags = decltype(size(visit_results))::value;
  constexpr int kF = kN / kFrags;
  static_assert(kF * kFrags == kN, "whole fragments");
  return static_cast<float>(visit_results(k / kF)[k % kF]);
}

__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// The fusion callbacks (used as they are, not through an EVT tree): the accumulator passes
// through visit(); reduce() does the work on the whole subtile.
struct Fc1SwigluCallbacks {
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

  CUTLASS_HOST_DEVICE Fc1SwigluCallbacks() {}
  CUTLASS_HOST_DEVICE Fc1SwigluCallbacks(Params const& p, SharedStorage const&) : params(p) {}
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
    int base_m, base_n;  // the thread's first element in the group's problem (row, gated column)
    int rows, cols;      // the group's rows (M) and gated columns (N = 2 I)
    int64_t row0;        // the group's first row in x, h and the stash
    Params const& params;

    template <class ElementAccumulator, int kFrag>
    CUTLASS_DEVICE cutlass::Array<ElementAccumulator, kFrag> visit(cutlass::Array<ElementAccumulator, kFrag> const& frg_acc,
                                                                   int, int, int) {
      return frg_acc;
    }

    // The subtile. Its layout CL is the accumulator's (compile time): each thread holds two
    // rows and, of each, the column pairs 8 j + {0, 1} from its first column (wgmma's C layout),
    // so its columns lie in one block of kGate gate columns and their kGate up columns, each
    // gate value with its up value and its neighbour column (subtile_columns, asserted here),
    // and its first column is even and at most 6 into the block (checked: a thread whose
    // columns do not line up takes reduce_general, element by element). Per row: its pointers,
    // its router weight and whether it is one of the group's. Per batch of kBatch elements:
    // every gate value's sigmoid (recip_rn_fast; a batch with a value outside its range
    // divides); then per pair of gate columns h, the stash's gate and up words, each by one
    // convert (bf16_pair_rn_cvt; a pair with a NaN among its six values rounds them with
    // bf16_from_float), stored at compile-time offsets from the row's pointers. The
    // arithmetic is swiglu_operand's (swiglu_from_sigmoid); without a clamp g and u are the
    // accumulator's (clamp_gate(g, inf) = g, clamp_up(u, inf) = u, NaN included), so the
    // kClamp = false instance leaves the compares out.
    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      Tensor cD = tCcD(_, _, _, epi_m, epi_n);  // this subtile's elements of the thread
      using CL = decltype(cD.layout());
      static_assert(is_static<CL>::value, "the subtile's coordinate layout is static");
      constexpr SubtileColumns kCols = subtile_columns<CL>();
      static_assert(kCols.paired, "each gate value has its up value and its neighbour column in the thread");
      const int m0 = base_m + static_cast<int>(get<0>(cD(0)));  // the thread's first element
      const int n0 = base_n + static_cast<int>(get<1>(cD(0)));
      const int lo = n0 & (2 * kGate - 1);  // its column in its block of gate and up columns
      if ((lo & 1) != 0 || lo + kCols.max_gate >= kGate || lo + kCols.min_up < kGate || lo + kCols.max >= 2 * kGate) {
        reduce_general(cD, visit_results);
        return;
      }
      // 2 I is a multiple of 2 kGate (fc1_swiglu_gemm_supported): the block lies in the
      // problem's columns or past them (the cluster's second CTA), nothing to store then.
      if (n0 - lo >= cols) return;
      if (params.has_clamp)
        reduce_paired<CL, true>(m0, n0 - lo, lo, visit_results);
      else
        reduce_paired<CL, false>(m0, n0 - lo, lo, visit_results);
    }

    // reduce's work on a thread's block from column S (lo its first element's column in it).
    template <class CL, bool kClamp, class VTensor>
    CUTLASS_DEVICE void reduce_paired(int m0, int S, int lo, VTensor const& visit_results) {
      constexpr int kN = decltype(size(CL{}))::value;
      static_assert(kN % kBatch == 0, "whole batches");
      auto v = [&](int k) { return subtile_value<kN>(visit_results, k); };
      const int64_t I = params.I;
      const bool apply_weight = params.apply_weight != 0;
      const bool stash = params.stash != nullptr;
      const float lim = params.limit;
      auto gate = [&](int k) { return kClamp ? detail::clamp_gate(v(k), lim) : v(k); };
      auto up = [&](int k) { return kClamp ? detail::clamp_up(v(k), lim) : v(k); };

      // At a row's first element: the row's router weight, whether the group has it, where
      // its h and stash columns of the block start.
      float w_row[kN];
      bool ok_row[kN];
      uint16_t* h_row[kN];
      uint16_t* s_row[kN];
      for_each(make_int_sequence<kN>{}, [&](auto K) {
        constexpr int k = decltype(K)::value;
        if constexpr (first_in_row<CL>(k) == k) {
          const int m = m0 + row_of<CL>(k);
          const int64_t r = row0 + m;
          ok_row[k] = m < rows;
          w_row[k] = apply_weight && ok_row[k] ? params.weight[r] : 0.0f;
          const int64_t col = (S >> 1) + lo;  // h's column of the block's first gate column, plus lo
          h_row[k] = params.h + r * I + col;
          s_row[k] = stash ? params.stash + r * 2 * I + col : nullptr;
        }
      });

      for_each(make_int_sequence<kN / kBatch>{}, [&](auto B) {
        constexpr int b0 = decltype(B)::value * kBatch;
        // Every gate value's sigmoid: d = 1 + exp(-g) is at least 1 or NaN, so recip_rn_fast_ok(d)
        // is d < 2^64; a batch with one outside divides all its gate values (the same quotients
        // where recip_rn_fast applies).
        float sig[kBatch];
        bool divide = false;
        for_each(make_int_sequence<kBatch>{}, [&](auto J) {
          constexpr int j = decltype(J)::value;
          if constexpr (has_up<CL>(b0 + j)) {
            const float d = detail::fadd(1.0f, expf(-gate(b0 + j)));
            sig[j] = detail::recip_rn_fast(d);
            divide |= !(d < 0x1p64f);
          }
        });
        if (divide) {
          for_each(make_int_sequence<kBatch>{}, [&](auto J) {
            constexpr int j = decltype(J)::value;
            if constexpr (has_up<CL>(b0 + j)) sig[j] = detail::sigmoid(gate(b0 + j));
          });
        }
        auto h_of = [&](int k, float w) {  // h of gate element k, unrounded
          return detail::swiglu_from_sigmoid(gate(k), sig[k - b0], up(element_at<CL>(k, 0, kGate)), w, apply_weight);
        };
        // The pairs: j at an even column (k), its neighbour k1; their up elements ku, ku1.
        for_each(make_int_sequence<kBatch>{}, [&](auto J) {
          constexpr int j = decltype(J)::value, k = b0 + j;
          if constexpr (has_up<CL>(k) && (col_of<CL>(k) & 1) == 0) {
            constexpr int k1 = element_at<CL>(k, 0, 1), ku = element_at<CL>(k, 0, kGate),
                          ku1 = element_at<CL>(k1, 0, kGate);
            constexpr int f = first_in_row<CL>(k), c = col_of<CL>(k);
            const float w = w_row[f];
            const float h0 = h_of(k, w), h1 = h_of(k1, w);
            uint32_t ph = detail::bf16_pair_rn_cvt(h0, h1), pg = 0, pu = 0;
            bool nan = detail::any_nan(h0, h1);
            if (stash) {
              pg = detail::bf16_pair_rn_cvt(v(k), v(k1));
              pu = detail::bf16_pair_rn_cvt(v(ku), v(ku1));
              nan |= detail::any_nan(v(k), v(k1)) | detail::any_nan(v(ku), v(ku1));
            }
            if (nan) {
              ph = pack2(detail::bf16_from_float(h0), detail::bf16_from_float(h1));
              pg = pack2(detail::bf16_from_float(v(k)), detail::bf16_from_float(v(k1)));
              pu = pack2(detail::bf16_from_float(v(ku)), detail::bf16_from_float(v(ku1)));
            }
            if (ok_row[f]) {
              *reinterpret_cast<uint32_t*>(h_row[f] + c) = ph;
              if (stash) {
                *reinterpret_cast<uint32_t*>(s_row[f] + c) = pg;
                *reinterpret_cast<uint32_t*>(s_row[f] + I + c) = pu;
              }
            }
          }
        });
      });
    }

    // The general path (any first column): per element, as the pass.
    template <class CTensor, class VTensor>
    CUTLASS_DEVICE void reduce_general(CTensor const& cD, VTensor const& visit_results) {
      using CL = decltype(cD.layout());
      constexpr int kN = decltype(size(CL{}))::value;
      static_assert(kN % kBatch == 0, "whole batches");
      auto v = [&](int k) { return subtile_value<kN>(visit_results, k); };
      const int64_t I = params.I;
      const bool apply_weight = params.apply_weight != 0;
      const float lim = params.has_clamp ? params.limit : __int_as_float(0x7f800000);

      float w_row[kN];  // at a row's first element: the row's router weight
      for_each(make_int_sequence<kN>{}, [&](auto K) {
        constexpr int k = decltype(K)::value;
        if constexpr (first_in_row<CL>(k) == k) {
          const int m = base_m + static_cast<int>(get<0>(cD(k)));
          w_row[k] = apply_weight && m < rows ? params.weight[row0 + m] : 0.0f;
        }
      });

      // In batches of kBatch consecutive elements (a batch's gate values and the columns
      // stored with them): enough independent chains to interleave, few enough that the
      // accumulator and the batch's temporaries stay in registers.
      for_each(make_int_sequence<kN / kBatch>{}, [&](auto B) {
        constexpr int b0 = decltype(B)::value * kBatch;
        float sig[kBatch];  // at a gate element: sigmoid of its clamped value
        uint32_t divide = 0;
        for_each(make_int_sequence<kBatch>{}, [&](auto J) {
          constexpr int j = decltype(J)::value;
          if constexpr (element_at<CL>(b0 + j, 0, kGate) >= 0) {
            const float d = detail::fadd(1.0f, expf(-detail::clamp_gate(v(b0 + j), lim)));
            sig[j] = detail::recip_rn_fast(d);
            divide |= static_cast<uint32_t>(!detail::recip_rn_fast_ok(d)) << j;
          }
        });
        if (divide != 0) {
          for_each(make_int_sequence<kBatch>{}, [&](auto J) {
            constexpr int j = decltype(J)::value;
            if constexpr (element_at<CL>(b0 + j, 0, kGate) >= 0) {
              if ((divide >> j) & 1) sig[j] = detail::sigmoid(detail::clamp_gate(v(b0 + j), lim));
            }
          });
        }
        // h of the gate element b0 + j (its up element ku), unrounded.
        auto h_of = [&](int j, int ku, float w) {
          return detail::swiglu_from_sigmoid(detail::clamp_gate(v(b0 + j), lim), sig[j], detail::clamp_up(v(ku), lim),
                                             w, apply_weight);
        };
        for_each(make_int_sequence<kBatch>{}, [&](auto J) {
          constexpr int j = decltype(J)::value;
          constexpr int k = b0 + j;
          constexpr int ku = element_at<CL>(k, 0, kGate);  // its up value, if k is a gate value
          constexpr int k1 = element_at<CL>(k, 0, 1);      // the next column
          constexpr int ku1 = k1 >= 0 ? element_at<CL>(k1, 0, kGate) : -1;
          constexpr int km1 = element_at<CL>(k, 0, -1);    // the previous column
          constexpr int kmu = km1 >= 0 ? element_at<CL>(km1, 0, kGate) : -1;
          if constexpr (ku >= 0) {
            const auto crd = cD(k);
            const int m = base_m + static_cast<int>(get<0>(crd));
            const int n = base_n + static_cast<int>(get<1>(crd));
            // A gate column of a row of the group (a cluster's second CTA may hold a tile past N).
            if (m < rows && n < cols && (n & (2 * kGate - 1)) < kGate) {
              const int64_t r = row0 + m;
              const int64_t col = static_cast<int64_t>(n >> 7) * kGate + (n & (kGate - 1));
              const float w = w_row[first_in_row<CL>(k)];
              const uint16_t hb = detail::bf16_from_float(h_of(j, ku, w));
              bool done = false;
              if constexpr (k1 >= 0 && ku1 >= 0) {
                static_assert(k1 < 0 || (k1 >= b0 && k1 < b0 + kBatch), "a column pair in one batch");
                if ((n & 1) == 0) {  // with the next column: 4-byte stores
                  const uint16_t hb1 = detail::bf16_from_float(h_of(k1 - b0, ku1, w));
                  *reinterpret_cast<uint32_t*>(params.h + r * I + col) = pack2(hb, hb1);
                  if (params.stash != nullptr) {
                    uint16_t* s = params.stash + r * 2 * I + col;
                    *reinterpret_cast<uint32_t*>(s) =
                        pack2(detail::bf16_from_float(v(k)), detail::bf16_from_float(v(k1)));
                    *reinterpret_cast<uint32_t*>(s + I) =
                        pack2(detail::bf16_from_float(v(ku)), detail::bf16_from_float(v(ku1)));
                  }
                  done = true;
                }
              }
              if constexpr (km1 >= 0 && kmu >= 0) {
                if ((n & 1) == 1) done = true;  // stored with the previous column
              }
              if (!done) {
                params.h[r * I + col] = hb;
                if (params.stash != nullptr) {
                  params.stash[r * 2 * I + col] = detail::bf16_from_float(v(k));
                  params.stash[r * 2 * I + I + col] = detail::bf16_from_float(v(ku));
                }
              }
            }
          }
        });
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

// The kernels: cooperative (both consumer warpgroups on one 128x256 tile, the epilogue after
// the mainloop) and pingpong (each warpgroup its own 64x256 tile, one's epilogue under the
// other's mainloop). Cluster 1x2 either way (grouped_gemm_nn_coop_n2.cu's reason).
using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N = 2 I, K) a group
using GroupShape = typename ProblemShape::UnderlyingProblemShape;
// B (N, K, L): N = (kGate, 2, N / 2 kGate) with strides (1, I, kGate), K with the row stride 2 I.
using GatedStrideB = Stride<Stride<_1, int64_t, Int<kGate>>, int64_t, _0>;
using ClusterShape = Shape<_1, _2, _1>;

template <bool kPingpong>
struct Fc1Kernel {
  using TileShape = std::conditional_t<kPingpong, Shape<_64, _256, _64>, Shape<_128, _256, _64>>;
  using EpilogueTile = std::conditional_t<kPingpong, Shape<_64, _128>, Shape<_128, _128>>;  // whole gate / up blocks
  using KernelSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float, void,
      LayoutD*, 8, void, LayoutD*, 8, EpilogueSchedule, Fc1SwigluCallbacks>::CollectiveOp;
  using StdMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, 8, Element, LayoutB*, 8, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  static_assert(cute::is_same_v<cute::remove_cvref_t<decltype(get<0>(typename StdMainloop::InternalStrideB{}))>, _1>,
                "B is N-major");
  using CollectiveMainloop = cutlass::gemm::collective::MoeEpGatedCollectiveMma<
      StdMainloop::DispatchPolicy::Stages, ClusterShape, KernelSchedule, TileShape, typename StdMainloop::ElementA,
      typename StdMainloop::StrideA, typename StdMainloop::ElementB, GatedStrideB*, typename StdMainloop::TiledMma,
      typename StdMainloop::GmemTiledCopyA, typename StdMainloop::SmemLayoutAtomA, typename StdMainloop::SmemCopyAtomA,
      typename StdMainloop::TransformA, typename StdMainloop::GmemTiledCopyB, typename StdMainloop::SmemLayoutAtomB,
      typename StdMainloop::SmemCopyAtomB, typename StdMainloop::TransformB>;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};
using StrideA = typename Fc1Kernel<false>::GemmKernel::InternalStrideA;
static_assert(cute::is_same_v<StrideA, typename Fc1Kernel<true>::GemmKernel::InternalStrideA>, "one A stride");

// The workspace: grouped_gemm_cutlass.cuh's layout (its ptr_d and stride_d unused: no D).
using gemm_detail::WorkspaceLayout;
using gemm_detail::align_up;
using gemm_detail::status_to_error;

template <class Gemm>
typename Gemm::Arguments make_arguments(const Fc1SwigluProblem& p, char* ws, const WorkspaceLayout& w, int sm_count) {
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {p.num_groups, reinterpret_cast<GroupShape*>(ws + w.shapes), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const Element**>(ws + w.ptr_a);
  args.mainloop.dA = reinterpret_cast<StrideA*>(ws + w.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const Element**>(ws + w.ptr_b);
  args.mainloop.dB = reinterpret_cast<GatedStrideB*>(ws + w.stride_b);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = nullptr;
  args.epilogue.dD = nullptr;
  EpilogueArgs& e = args.epilogue.thread;
  e.offsets = p.group_sizes != nullptr ? p.offsets_out : p.offsets;
  e.total_rows = p.total_rows;
  e.weight = p.weight;
  e.h = p.h;
  e.stash = p.stash;
  e.I = p.intermediate;
  e.apply_weight = p.apply_weight;
  e.has_clamp = p.has_clamp;
  e.limit = p.limit;
  args.hw_info.device_id = 0;  // only read when sm_count <= 0; ours is always set
  args.hw_info.sm_count = sm_count;
  return args;
}

template <class Gemm>
WorkspaceLayout workspace_layout(const Fc1SwigluProblem& p, int sm_count) {
  const size_t g = static_cast<size_t>(p.num_groups);
  WorkspaceLayout w;
  size_t at = 0;
  w.shapes = at;   at = align_up(at + g * sizeof(GroupShape));
  w.ptr_a = at;    at = align_up(at + g * sizeof(void*));
  w.ptr_b = at;    at = align_up(at + g * sizeof(void*));
  w.stride_a = at; at = align_up(at + g * sizeof(StrideA));
  w.stride_b = at; at = align_up(at + g * sizeof(GatedStrideB));
  w.cutlass = at;
  auto args = make_arguments<Gemm>(p, nullptr, w, sm_count);
  w.cutlass_bytes = Gemm::get_workspace_size(args);
  w.total = align_up(at + w.cutlass_bytes);
  return w;
}

// One thread per group: its rows (group_rows: offsets, or sizes made into published offsets,
// clamped to [0, total_rows]) -> shapes, pointers, strides.
__global__ void build_fc1_args(Fc1SwigluProblem p, GroupShape* shapes, const Element** ptr_a, const Element** ptr_b,
                               StrideA* stride_a, GatedStrideB* stride_b) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  const int g = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const GroupRows gr = group_rows(g, p.offsets, p.group_sizes, p.offsets_out, p.total_rows);
  const int64_t start = gr.start, end = gr.end;
  const int64_t I = p.intermediate, H = p.hidden;
  shapes[g] = make_shape(static_cast<int>(end - start), static_cast<int>(2 * I), static_cast<int>(H));
  ptr_a[g] = reinterpret_cast<const Element*>(p.x) + start * H;
  ptr_b[g] = reinterpret_cast<const Element*>(p.w1) + static_cast<int64_t>(g) * H * 2 * I;
  stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(static_cast<int>(H), static_cast<int>(H), 1));
  GatedStrideB sb{};
  get<0, 1>(sb) = I;      // gate -> up
  get<1>(sb) = 2 * I;     // the next k: a row of W1
  stride_b[g] = sb;
}

}  // namespace fc1_detail

bool fc1_swiglu_gemm_supported(const Fc1SwigluProblem& p) {
  constexpr int64_t kMaxDim = 2147483647;
  const uintptr_t a16 = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.w1);
  const uintptr_t a4 = reinterpret_cast<uintptr_t>(p.h) | reinterpret_cast<uintptr_t>(p.stash);
  const bool offsets_ok = p.group_sizes != nullptr ? p.offsets_out != nullptr : p.offsets != nullptr;
  return p.num_groups > 0 && p.num_groups <= 1024 && offsets_ok && p.total_rows >= 0 && p.total_rows < kMaxDim &&
         p.intermediate > 0 && p.intermediate % (2 * fc1_detail::kGate) == 0 && 2 * p.intermediate < kMaxDim &&
         p.hidden > 0 && p.hidden % 8 == 0 && p.hidden < kMaxDim && p.x != nullptr && p.w1 != nullptr &&
         p.h != nullptr && (p.apply_weight == 0 || p.weight != nullptr) && a16 % 16 == 0 && a4 % 4 == 0;
}

size_t fc1_swiglu_gemm_workspace_bytes(const Fc1SwigluProblem& p, int sm_count) {
  using namespace fc1_detail;
  return std::max(workspace_layout<Fc1Kernel<false>::Gemm>(p, sm_count).total,
                  workspace_layout<Fc1Kernel<true>::Gemm>(p, sm_count).total);
}

namespace fc1_detail {

template <class Gemm>
cudaError_t launch(const Fc1SwigluProblem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   int sm_count) {
  const WorkspaceLayout w = workspace_layout<Gemm>(p, sm_count);
  if (workspace == nullptr || workspace_bytes < w.total || reinterpret_cast<uintptr_t>(workspace) % 128 != 0)
    return cudaErrorInvalidValue;
  char* ws = static_cast<char*>(workspace);
  (void)launch_pdl(build_fc1_args, 1, static_cast<unsigned>(p.num_groups), 0, stream, p,
                   reinterpret_cast<GroupShape*>(ws + w.shapes), reinterpret_cast<const Element**>(ws + w.ptr_a),
                   reinterpret_cast<const Element**>(ws + w.ptr_b), reinterpret_cast<StrideA*>(ws + w.stride_a),
                   reinterpret_cast<GatedStrideB*>(ws + w.stride_b));
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  auto args = make_arguments<Gemm>(p, ws, w, sm_count);
  Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  s = gemm.initialize(args, w.cutlass_bytes > 0 ? ws + w.cutlass : nullptr, stream);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return status_to_error(s);
  return cudaGetLastError();
}

}  // namespace fc1_detail

cudaError_t fc1_swiglu_gemm(const Fc1SwigluProblem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                            int sm_count) {
  using namespace fc1_detail;
  if (!fc1_swiglu_gemm_supported(p) || sm_count <= 0) return cudaErrorNotSupported;
  if (p.kernel == Fc1SwigluKernel::kPingpong)
    return launch<Fc1Kernel<true>::Gemm>(p, workspace, workspace_bytes, stream, sm_count);
  return launch<Fc1Kernel<false>::Gemm>(p, workspace, workspace_bytes, stream, sm_count);
}

}  // namespace cuda
}  // namespace moe_ep

#else  // no CUTLASS: the caller runs FC1 and its pass

namespace moe_ep {
namespace cuda {
bool fc1_swiglu_gemm_supported(const Fc1SwigluProblem&) { return false; }
size_t fc1_swiglu_gemm_workspace_bytes(const Fc1SwigluProblem&, int) { return 0; }
cudaError_t fc1_swiglu_gemm(const Fc1SwigluProblem&, void*, size_t, cudaStream_t, int) {
  return cudaErrorNotSupported;
}
}  // namespace cuda
}  // namespace moe_ep

#endif
