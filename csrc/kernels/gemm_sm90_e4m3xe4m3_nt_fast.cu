// FP8 e4m3 x e4m3 -> bf16 with fast accumulation: the 128 x 128 and 256 x 128 tiles.
#include "gemm_sm90_instances.cuh"

FLUX_GEMM_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k128x128, kFast)
FLUX_GEMM_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k256x128, kFast)
