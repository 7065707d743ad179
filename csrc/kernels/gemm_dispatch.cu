#include "flux/check.h"
#include "flux/gemm_dispatch.h"

namespace flux {

namespace {
template <DType D, WeightLayout L>
void by_tile(const GemmProblem& p, TileConfig t, cudaStream_t s) {
  switch (t) {
    case TileConfig::k256x128:
      return launch_gemm_instance<D, L, TileConfig::k256x128>(p, s);
    case TileConfig::k128x256:
      return launch_gemm_instance<D, L, TileConfig::k128x256>(p, s);
  }
  FLUX_CHECK(false, "unknown tile configuration ", int(t));
}
}  // namespace

void launch_gemm(const GemmProblem& p, DType d, WeightLayout l, TileConfig t, cudaStream_t s) {
  FLUX_CHECK(l == WeightLayout::kNT || l == WeightLayout::kNN, "unknown weight layout ", int(l));
  switch (d) {
    case DType::kBF16:
      return l == WeightLayout::kNT ? by_tile<DType::kBF16, WeightLayout::kNT>(p, t, s)
                                    : by_tile<DType::kBF16, WeightLayout::kNN>(p, t, s);
    case DType::kFP16:
      return l == WeightLayout::kNT ? by_tile<DType::kFP16, WeightLayout::kNT>(p, t, s)
                                    : by_tile<DType::kFP16, WeightLayout::kNN>(p, t, s);
  }
  FLUX_CHECK(false, "no GEMM instance for dtype ", int(d));
}

}  // namespace flux
