#include "gemm_sm90_instances.cuh"

FLUX_GEMM_INSTANCE(kBF16, kBF16, kBF16, kNT, k256x128, kSplit)
FLUX_GEMM_INSTANCE(kBF16, kBF16, kBF16, kNT, k128x256, kSplit)
