// FP8 e5m2 x e4m3 -> bf16 (a gradient in e5m2 as x: dgrad).
#include "gemm_sm90_instances.cuh"

FLUX_GEMM_INSTANCE(kE5M2, kE4M3, kBF16, kNT, k128x128, kSplit)
FLUX_GEMM_INSTANCE(kE5M2, kE4M3, kBF16, kNT, k128x256, kFast)
