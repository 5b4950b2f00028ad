// One CUTLASS instantiation (its own TU: ~100 s and ~3.4 GB of nvcc): the kTN grouped
// GEMM of grouped_gemm_tn.cu (weight grad, cooperative 128x256x64, cluster 2x1x1) writing D
// as bf16: the float32 accumulator rounded to nearest even in the epilogue, a group with no
// rows bf16 zeros. The layer's weight gradients use it for
// MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 (a bf16 weight leaf with no float32 main_grad): half
// the bytes stored, and no separate cast pass.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"
#include "cuda/gemm/grouped_gemm_impl.h"

MOE_EP_GROUPED_GEMM_DEFINE(grouped_gemm_tn_coop_bf16,
                           GroupedGemm<GemmLayout::kTN, cute::Shape<cute::_128, cute::_256, cute::_64>,
                                       cute::Shape<cute::_2, cute::_1, cute::_1>, CooperativeSchedule,
                                       cutlass::bfloat16_t>)
