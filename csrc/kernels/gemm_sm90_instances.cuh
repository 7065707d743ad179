// Defines launch_gemm_instance for the GEMM instantiations one translation unit compiles (so the CUTLASS
// instantiations compile in parallel): FLUX_GEMM_INSTANCE(A, B, D, layout, tile, accumulation) with the flux::DType
// names of x, W and out, the WeightLayout, the TileConfig and the Accumulation.
#pragma once

#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include "flux/gemm_dispatch.h"
#include "gemm_sm90_launch.cuh"

namespace flux::sm90 {

template <DType D>
struct CutlassType;
template <>
struct CutlassType<DType::kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassType<DType::kFP16> {
  using type = cutlass::half_t;
};
template <>
struct CutlassType<DType::kE4M3> {
  using type = cutlass::float_e4m3_t;
};
template <>
struct CutlassType<DType::kE5M2> {
  using type = cutlass::float_e5m2_t;
};

}  // namespace flux::sm90

#define FLUX_GEMM_INSTANCE(A, B, D, LAYOUT, TILE, ACCUM)                                                            \
  namespace flux {                                                                                                  \
  template <>                                                                                                       \
  void launch_gemm_instance<DType::A, DType::B, DType::D, WeightLayout::LAYOUT, TileConfig::TILE,                   \
                            Accumulation::ACCUM>(const GemmProblem& p, cudaStream_t s) {                            \
    using Cfg = sm90::GemmConfig<sm90::CutlassType<DType::A>::type, sm90::CutlassType<DType::B>::type,              \
                                 sm90::CutlassType<DType::D>::type, WeightLayout::LAYOUT, tile_m(TileConfig::TILE), \
                                 tile_n(TileConfig::TILE), kClusterM, Accumulation::ACCUM>;                         \
    sm90::Launcher<Cfg>::launch(p, s);                                                                              \
  }                                                                                                                 \
  }
