// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kTN grouped
// GEMM, weight grad: D_g[m, n] = (A[rows, m])^T * B[rows, n], ragged K;
// cooperative, tile 128x256x64, cluster 2x1x1 (PyTorch's choice for bf16 grouped GEMMs
// on sm_90 when M and N are both above 128).
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_tn_coop,
                           GroupedGemm<GemmLayout::kTN, cute::Shape<cute::_128, cute::_256, cute::_64>,
                                       cute::Shape<cute::_2, cute::_1, cute::_1>, CooperativeSchedule>)
