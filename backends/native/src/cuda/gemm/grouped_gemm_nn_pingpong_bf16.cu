// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kNN grouped
// GEMM of grouped_gemm_nn_pingpong.cu (pingpong 64x128x128, cluster 2x1x1: few rows per
// group, decode) writing D as bf16 (see grouped_gemm_nn_bf16.cu).
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_nn_pingpong_bf16,
                           GroupedGemm<GemmLayout::kNN, cute::Shape<cute::_64, cute::_128, cute::_128>,
                                       cute::Shape<cute::_2, cute::_1, cute::_1>, PingpongSchedule,
                                       cutlass::bfloat16_t>)
