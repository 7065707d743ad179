// Entry point of the GEMM kernels for the C++ runtime: picks the compiled instantiation for the operand types,
// weight layout and tile configuration. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "flux/gemm_params.h"

namespace flux {

// The element types of one GEMM: x (A), W (B) and out (and a reduce-scatter's partials). 16-bit: all three the
// same. FP8: e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3 (e5m2 x e5m2 is not a GEMM the libraries offer either), out
// bf16, 'nt' layout.
struct GemmTypes {
  DType a = DType::kBF16;
  DType b = DType::kBF16;
  DType out = DType::kBF16;
  Accumulation accumulation = Accumulation::kSplit;  // FP8 only (16-bit operands: kSplit)
};

void launch_gemm(const GemmProblem& problem, const GemmTypes& types, WeightLayout layout, TileConfig tile,
                 cudaStream_t stream);
// 16-bit operands and output of one dtype.
void launch_gemm(const GemmProblem& problem, DType dtype, WeightLayout layout, TileConfig tile, cudaStream_t stream);

// Whether an instantiation exists (checked before anything of a call is enqueued), and, if not, why in words.
bool gemm_instance_exists(const GemmTypes& types, WeightLayout layout, TileConfig tile);
const char* gemm_types_unsupported(const GemmTypes& types, WeightLayout layout);  // null: some tile exists

// One instantiation per (types, layout, tile, accumulation); defined in gemm_sm90_*.cu.
template <DType A, DType B, DType D, WeightLayout L, TileConfig T, Accumulation Acc>
void launch_gemm_instance(const GemmProblem& problem, cudaStream_t stream);

}  // namespace flux
