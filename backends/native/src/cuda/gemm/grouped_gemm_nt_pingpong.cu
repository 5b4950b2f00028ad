// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kNT grouped
// GEMM for few rows per group (decode), data grad: D[rows, n] = A[rows, k] * (B_g[n, k])^T, ragged M;
// pingpong, tile 64x128x128, cluster 2x1x1 (PyTorch's choice for bf16 grouped GEMMs on
// sm_90 when M or N is at most 128): more, smaller tiles than the cooperative 128x256
// kernel, so the weight reads spread over all SMs when each group has few rows.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_nt_pingpong,
                           GroupedGemm<GemmLayout::kNT, cute::Shape<cute::_64, cute::_128, cute::_128>,
                                       cute::Shape<cute::_2, cute::_1, cute::_1>, PingpongSchedule>)
