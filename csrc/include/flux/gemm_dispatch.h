// Entry point of the GEMM kernels for the C++ runtime: picks the compiled instantiation for dtype, weight
// layout and tile configuration. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "flux/gemm_params.h"

namespace flux {

void launch_gemm(const GemmProblem& problem, DType dtype, WeightLayout layout, TileConfig tile, cudaStream_t stream);

// One instantiation per (dtype, layout, tile); defined in gemm_sm90_<dtype>_<layout>.cu.
template <DType D, WeightLayout L, TileConfig T>
void launch_gemm_instance(const GemmProblem& problem, cudaStream_t stream);

}  // namespace flux
