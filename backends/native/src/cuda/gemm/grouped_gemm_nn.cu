// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kNN grouped
// GEMM, forward: D[rows, n] = A[rows, k] * B_g[k, n], ragged M;
// cooperative, tile 128x256x64, cluster 2x1x1 (PyTorch's choice for bf16 grouped GEMMs
// on sm_90 when M and N are both above 128).
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_nn_coop,
                           GroupedGemm<GemmLayout::kNN, cute::Shape<cute::_128, cute::_256, cute::_64>,
                                       cute::Shape<cute::_2, cute::_1, cute::_1>, CooperativeSchedule>)
