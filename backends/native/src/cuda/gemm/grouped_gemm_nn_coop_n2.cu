// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kNN grouped
// GEMM for many rows per group (prefill), forward: D[rows, n] = A[rows, k] * B_g[k, n],
// ragged M; cooperative, tile 128x256x64 as grouped_gemm_nn.cu, but cluster 1x2x1: the
// two CTAs of a cluster take neighbouring N tiles of the same rows (A multicast) instead
// of neighbouring M tiles of the same weights. CUTLASS's group scheduler rounds each
// group's tile count up to the cluster along the cluster's axis; a group's M tiles follow
// the routing (an odd count leaves one CTA of the last cluster idle for a whole tile),
// while its N tiles are fixed, and even at n = 4096 and 7168.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_nn_coop_n2,
                           GroupedGemm<GemmLayout::kNN, cute::Shape<cute::_128, cute::_256, cute::_64>,
                                       cute::Shape<cute::_1, cute::_2, cute::_1>, CooperativeSchedule>)
