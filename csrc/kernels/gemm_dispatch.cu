#include "flux/check.h"
#include "flux/gemm_dispatch.h"

namespace flux {

namespace {
template <DType D, WeightLayout L>
void by_tile(const GemmProblem& p, TileConfig t, cudaStream_t s) {
  switch (t) {
    case TileConfig::k256x128: return launch_gemm_instance<D, L, TileConfig::k256x128>(p, s);
    case TileConfig::k128x256: return launch_gemm_instance<D, L, TileConfig::k128x256>(p, s);
  }
  FLUX_CHECK(false, "unknown tile configuration ", int(t));
}
}  // namespace

void launch_gemm(const GemmProblem& p, DType d, WeightLayout l, TileConfig t, cudaStream_t s) {
  if (d == DType::kBF16) {
    return l == WeightLayout::kNT ? by_tile<DType::kBF16, WeightLayout::kNT>(p, t, s)
                                  : by_tile<DType::kBF16, WeightLayout::kNN>(p, t, s);
  }
  return l == WeightLayout::kNT ? by_tile<DType::kFP16, WeightLayout::kNT>(p, t, s)
                                : by_tile<DType::kFP16, WeightLayout::kNN>(p, t, s);
}

}  // namespace flux
