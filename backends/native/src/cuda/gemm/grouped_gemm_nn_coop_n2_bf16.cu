// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kNN grouped
// GEMM of grouped_gemm_nn_coop_n2.cu (cooperative 128x256x64, cluster 1x2x1) writing D as
// bf16: the float32 accumulator rounded to nearest even in the epilogue.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_nn_coop_n2_bf16,
                           GroupedGemm<GemmLayout::kNN, cute::Shape<cute::_128, cute::_256, cute::_64>,
                                       cute::Shape<cute::_1, cute::_2, cute::_1>, CooperativeSchedule,
                                       cutlass::bfloat16_t>)
