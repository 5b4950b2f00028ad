// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kNN grouped
// GEMM for many rows per group (prefill), forward: D[rows, n] = A[rows, k] * B_g[k, n],
// ragged M; pingpong, tile 128x128x64 (a whole 128x128 tile per consumer warpgroup),
// cluster 2x1x1. One warpgroup's epilogue (a 64 KB float32 tile) runs while the other's
// MMAs do, where the cooperative 128x256 kernel stops its MMAs for it: the forward's
// float32 D at a short K (FC2, K = intermediate) is where that shows.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_nn_pingpong128,
                           GroupedGemm<GemmLayout::kNN, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                       cute::Shape<cute::_2, cute::_1, cute::_1>, PingpongSchedule>)
