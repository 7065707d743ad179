// Defines launch_gemm_instance for one (dtype, layout) and both tile configurations. Each .cu that includes
// this is its own translation unit, so the CUTLASS instantiations compile in parallel.
#pragma once

#include "flux/gemm_dispatch.h"
#include "gemm_sm90.cuh"

#define FLUX_DEFINE_GEMM_INSTANCES(DTYPE_ENUM, CUTLASS_TYPE, LAYOUT_ENUM)                                          \
  namespace flux {                                                                                                 \
  template <>                                                                                                      \
  void launch_gemm_instance<DTYPE_ENUM, LAYOUT_ENUM, TileConfig::k256x128>(const GemmProblem& p, cudaStream_t s) { \
    sm90::Launcher<sm90::GemmConfig<CUTLASS_TYPE, LAYOUT_ENUM, 256, 128, kClusterM>>::launch(p, s);                \
  }                                                                                                                \
  template <>                                                                                                      \
  void launch_gemm_instance<DTYPE_ENUM, LAYOUT_ENUM, TileConfig::k128x256>(const GemmProblem& p, cudaStream_t s) { \
    sm90::Launcher<sm90::GemmConfig<CUTLASS_TYPE, LAYOUT_ENUM, 128, 256, kClusterM>>::launch(p, s);                \
  }                                                                                                                \
  }
