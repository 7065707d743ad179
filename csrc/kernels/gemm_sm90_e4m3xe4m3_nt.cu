// FP8 e4m3 x e4m3 -> bf16 (forward GEMMs): split accumulation (128 x 128 tiles) and the fast-accumulation tile most
// shapes take; the other fast-accumulation tiles are in gemm_sm90_e4m3xe4m3_nt_fast.cu.
#include "gemm_sm90_instances.cuh"

FLUX_GEMM_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k128x128, kSplit)
FLUX_GEMM_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k128x256, kFast)
