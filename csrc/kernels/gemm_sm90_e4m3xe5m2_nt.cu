// FP8 e4m3 x e5m2 -> bf16 (a gradient in e5m2 as W, e.g. wgrad with the gradient second).
#include "gemm_sm90_instances.cuh"

FLUX_GEMM_INSTANCE(kE4M3, kE5M2, kBF16, kNT, k128x128, kSplit)
FLUX_GEMM_INSTANCE(kE4M3, kE5M2, kBF16, kNT, k128x256, kFast)
