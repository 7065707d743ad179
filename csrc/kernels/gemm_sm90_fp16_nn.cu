#include "gemm_sm90_instances.cuh"

FLUX_GEMM_INSTANCE(kFP16, kFP16, kFP16, kNN, k256x128, kSplit)
FLUX_GEMM_INSTANCE(kFP16, kFP16, kFP16, kNN, k128x256, kSplit)
