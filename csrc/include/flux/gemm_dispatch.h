// Entry point of the GEMM kernels for the C++ runtime: picks the compiled instantiation for dtype, weight
// layout and tile configuration. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "flux/gemm_params.h"

namespace flux {

enum class TileConfig : int {
  k256x128 = 0,  // 256 x 128 x 64 tiles, cluster 2 x 1 (B multicast), cooperative
  k128x256 = 1,  // 128 x 256 x 64 tiles, cluster 2 x 1
};
constexpr int kNumTileConfigs = 2;

inline int tile_m(TileConfig c) { return c == TileConfig::k256x128 ? 256 : 128; }
inline int tile_n(TileConfig c) { return c == TileConfig::k256x128 ? 128 : 256; }
constexpr int kClusterM = 2;

void launch_gemm(const GemmProblem& problem, DType dtype, WeightLayout layout, TileConfig tile,
                 cudaStream_t stream);

// One instantiation per (dtype, layout, tile); defined in gemm_sm90_<dtype>_<layout>.cu.
template <DType D, WeightLayout L, TileConfig T>
void launch_gemm_instance(const GemmProblem& problem, cudaStream_t stream);

}  // namespace flux
