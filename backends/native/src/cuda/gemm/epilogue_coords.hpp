// Compile-time lookups in a thread's share of an epilogue subtile, for the fusion callbacks
// of fc1_swiglu_gemm.cu and fc2_round_gemm.cu (CUTLASS/CuTe TUs only): the callbacks get the
// subtile's coordinates as a static layout relative to the thread's first element.
#ifndef MOE_EP_NATIVE_CUDA_GEMM_EPILOGUE_COORDS_HPP_
#define MOE_EP_NATIVE_CUDA_GEMM_EPILOGUE_COORDS_HPP_

#include "cute/tensor.hpp"

namespace moe_ep {
namespace cuda {
namespace epilogue {

// The index of the element of the coordinate layout CL at (m, n) of element k plus (dm, dn), or
// -1: evaluated at compile time (CL is static: a thread's subtile, relative coordinates).
template <class CL>
CUTE_HOST_DEVICE constexpr int element_at(int k, int dm, int dn) {
  constexpr int n = decltype(cute::size(CL{}))::value;
  const auto ck = CL{}(k);
  const int m0 = static_cast<int>(cute::get<0>(ck)) + dm, n0 = static_cast<int>(cute::get<1>(ck)) + dn;
  for (int j = 0; j < n; ++j) {
    const auto cj = CL{}(j);
    if (static_cast<int>(cute::get<0>(cj)) == m0 && static_cast<int>(cute::get<1>(cj)) == n0) return j;
  }
  return -1;
}

// The column of element k, relative to the thread's first element.
template <class CL>
CUTE_HOST_DEVICE constexpr int column_of(int k) {
  return static_cast<int>(cute::get<1>(CL{}(k)));
}

}  // namespace epilogue
}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_EPILOGUE_COORDS_HPP_
