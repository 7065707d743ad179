#include "gemm_sm90_instances.cuh"

FLUX_DEFINE_GEMM_INSTANCES(DType::kFP16, cutlass::half_t, WeightLayout::kNN)
