#include "flux/check.h"
#include "flux/gemm_dispatch.h"

namespace flux {

namespace {

using LaunchFn = void (*)(const GemmProblem&, cudaStream_t);

struct Instance {
  DType a, b, out;
  WeightLayout layout;
  TileConfig tile;
  Accumulation accumulation;
  LaunchFn launch;
};

#define FLUX_INSTANCE(A, B, D, L, T, ACC)                                                                      \
  Instance {                                                                                                   \
    DType::A, DType::B, DType::D, WeightLayout::L, TileConfig::T, Accumulation::ACC,                           \
        &launch_gemm_instance<DType::A, DType::B, DType::D, WeightLayout::L, TileConfig::T, Accumulation::ACC> \
  }

// Every compiled instantiation (gemm_sm90_*.cu). FP8 with split accumulation holds two accumulator fragments,
// which fit the registers of 128 x 128 tiles only.
constexpr Instance kInstances[] = {
    FLUX_INSTANCE(kBF16, kBF16, kBF16, kNT, k256x128, kSplit),
    FLUX_INSTANCE(kBF16, kBF16, kBF16, kNT, k128x256, kSplit),
    FLUX_INSTANCE(kBF16, kBF16, kBF16, kNN, k256x128, kSplit),
    FLUX_INSTANCE(kBF16, kBF16, kBF16, kNN, k128x256, kSplit),
    FLUX_INSTANCE(kFP16, kFP16, kFP16, kNT, k256x128, kSplit),
    FLUX_INSTANCE(kFP16, kFP16, kFP16, kNT, k128x256, kSplit),
    FLUX_INSTANCE(kFP16, kFP16, kFP16, kNN, k256x128, kSplit),
    FLUX_INSTANCE(kFP16, kFP16, kFP16, kNN, k128x256, kSplit),
    FLUX_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k128x128, kSplit),
    FLUX_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k128x128, kFast),
    FLUX_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k128x256, kFast),
    FLUX_INSTANCE(kE4M3, kE4M3, kBF16, kNT, k256x128, kFast),
    FLUX_INSTANCE(kE4M3, kE5M2, kBF16, kNT, k128x128, kSplit),
    FLUX_INSTANCE(kE4M3, kE5M2, kBF16, kNT, k128x256, kFast),
    FLUX_INSTANCE(kE5M2, kE4M3, kBF16, kNT, k128x128, kSplit),
    FLUX_INSTANCE(kE5M2, kE4M3, kBF16, kNT, k128x256, kFast),
};

#undef FLUX_INSTANCE

// 16-bit operands always accumulate in fp32 (their instances are listed as kSplit).
Accumulation effective(const GemmTypes& t) { return is_fp8(t.a) ? t.accumulation : Accumulation::kSplit; }

const Instance* find(const GemmTypes& t, WeightLayout layout, TileConfig tile) {
  Accumulation const acc = effective(t);
  for (const Instance& i : kInstances)
    if (i.a == t.a && i.b == t.b && i.out == t.out && i.layout == layout && i.tile == tile && i.accumulation == acc)
      return &i;
  return nullptr;
}

}  // namespace

const char* gemm_types_unsupported(const GemmTypes& t, WeightLayout layout) {
  if (is_fp8(t.a) != is_fp8(t.b)) return "x and the weight must both be FP8 or both 16-bit";
  if (!is_fp8(t.a)) {
    if (t.a != t.b || t.out != t.a) return "16-bit GEMMs take x, weight and out of one dtype";
  } else {
    if (t.a == DType::kE5M2 && t.b == DType::kE5M2) return "e5m2 x e5m2 is not supported (one operand must be e4m3)";
    if (t.out != DType::kBF16) return "FP8 GEMMs write bfloat16";
    if (layout != WeightLayout::kNT)
      return "FP8 GEMMs need both operands K-major: the 'nt' layout (pass the transposed FP8 weight)";
  }
  Accumulation const acc = effective(t);
  for (const Instance& i : kInstances)
    if (i.a == t.a && i.b == t.b && i.out == t.out && i.layout == layout && i.accumulation == acc) return nullptr;
  return "no GEMM instance for these operand types";
}

bool gemm_instance_exists(const GemmTypes& t, WeightLayout layout, TileConfig tile) {
  return find(t, layout, tile) != nullptr;
}

void launch_gemm(const GemmProblem& p, const GemmTypes& t, WeightLayout l, TileConfig tile, cudaStream_t s) {
  const char* why = gemm_types_unsupported(t, l);
  FLUX_CHECK(why == nullptr, why);
  const Instance* i = find(t, l, tile);
  FLUX_CHECK(i != nullptr, "no GEMM instance with tile configuration ", int(tile), " for these operand types (",
             is_fp8(t.a) ? (effective(t) == Accumulation::kSplit ? "FP8 split accumulation: 128 x 128 tiles only"
                                                                 : "FP8 fast accumulation")
                         : "16-bit: 256 x 128 or 128 x 256 tiles",
             ")");
  i->launch(p, s);
}

void launch_gemm(const GemmProblem& p, DType dtype, WeightLayout l, TileConfig tile, cudaStream_t s) {
  launch_gemm(p, GemmTypes{dtype, dtype, dtype, Accumulation::kSplit}, l, tile, s);
}

}  // namespace flux
