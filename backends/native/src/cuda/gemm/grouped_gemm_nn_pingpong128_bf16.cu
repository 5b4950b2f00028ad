// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kNN grouped
// GEMM of grouped_gemm_nn_pingpong128.cu (pingpong 128x128x64, cluster 2x1x1) writing D
// as bf16: the float32 accumulator rounded to nearest even in the epilogue.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_nn_pingpong128_bf16,
                           GroupedGemm<GemmLayout::kNN, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                       cute::Shape<cute::_2, cute::_1, cute::_1>, PingpongSchedule,
                                       cutlass::bfloat16_t>)
