// FP8 e4m3 x e4m3 -> bf16, split accumulation on 128 x 144 tiles. CUTLASS's collective builder covers a 144-column
// tile with one 64 x 144 x 32 wgmma only with its extended shapes; without them it takes 64 x 16 x 32 and ptxas
// spills KBs and serializes the wgmmas. The macro changes no choice of the other tiles (128 and 256 columns), which
// are compiled in the other translation units without it. Two fragments of 72 accumulators leave the consumers'
// 232 registers short by a few: ptxas spills 88 bytes of loop state, loaded once per run of k tiles, none inside it.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "gemm_sm90_instances.cuh"

FLUX_GEMM_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k128x144, kSplit)
