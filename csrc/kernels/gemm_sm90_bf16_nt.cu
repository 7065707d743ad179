#include "gemm_sm90_instances.cuh"

FLUX_DEFINE_GEMM_INSTANCES(DType::kBF16, cutlass::bfloat16_t, WeightLayout::kNT)
