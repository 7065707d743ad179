// One stock CUTLASS 3 sm90 GEMM (GemmUniversal + collective builders, nothing of flux_layers) for
// stock_gemm.cu (bf16) and stock_gemm_fp8.cu (FP8): layout "nt" only, x [M, K] row-major, W [N, K] (B column-major),
// D [M, N] row-major bf16, fp32 accumulate, D = alpha * x @ W^T.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/util/packed_stride.hpp>

namespace stock {

using namespace cute;

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpiCoop = cutlass::epilogue::TmaWarpSpecializedCooperative;
using EpiPing = cutlass::epilogue::TmaWarpSpecialized;
using Persistent = cutlass::gemm::PersistentScheduler;
using StreamK = cutlass::gemm::StreamKScheduler;

// ElementAB: the operands' type; TK: the tile's K (a 128-byte row of it); 16-byte aligned rows.
template <class ElementAB, int TK, int TM, int TN, int CM, int CN, class KernelSchedule, class EpiSchedule,
          class Scheduler>
struct Gemm {
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  static constexpr int kAlignAB = 16 / int(sizeof(ElementAB));

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, ElementD, LayoutD, 8,
      EpiSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB, LayoutB, kAlignAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // 0 on success; 2: workspace too small (*needed says how much); 3: shape not implementable; 4/5/6: CUTLASS or
  // CUDA error.
  static int run(void const* x, void const* w, void* d, int m, int n, int k, float alpha, int swizzle, void* workspace,
                 size_t workspace_bytes, size_t* needed, cudaStream_t stream) {
    auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(m, k, 1));
    auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(n, k, 1));
    auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(m, n, 1));
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<ElementAB const*>(x), stride_a, static_cast<ElementAB const*>(w), stride_b},
        {{alpha, 0.f}, nullptr, stride_d, static_cast<ElementD*>(d), stride_d},
        hw};
    args.scheduler.max_swizzle_size = swizzle;
    Adapter gemm;
    *needed = Adapter::get_workspace_size(args);
    if (*needed > workspace_bytes) return 2;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 3;
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 4;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 5;
    return cudaGetLastError() == cudaSuccess ? 0 : 6;
  }
};

}  // namespace stock
