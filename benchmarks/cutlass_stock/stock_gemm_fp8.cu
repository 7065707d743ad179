// Stock CUTLASS 3 sm90 FP8 GEMM kernels (GemmUniversal + collective builders, nothing of flux_layers), exported
// through a C ABI so benchmarks/bench_cutlass_stock.py --fp8 can time them beside cuBLASLt's _scaled_mm and the
// flux_layers FP8 GEMM in one process. The question: does any of CUTLASS's own schedules (cooperative, ping-pong,
// stream-K; split accumulation, which CUTLASS's FP8 mainloop promotes every 4 MMAs, or fast) keep up with cuBLASLt
// where ours falls behind (short K), and which.
//
// Layout "nt" only: x [M, K] row-major e4m3, W [N, K] (B column-major) e4m3, D [M, N] row-major bf16, fp32
// accumulate; one tensor-wise scale, alpha = scale_x * scale_w, passed by value.
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

using namespace cute;

namespace {

template <int TM, int TN, int CM, int CN, class KernelSchedule, class EpiSchedule, class Scheduler>
struct StockFp8 {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = Shape<Int<TM>, Int<TN>, _128>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, 8, ElementD, LayoutD, 8, EpiSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, 16, ElementAB, LayoutB, 16, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static int run(void const* x, void const* w, void* d, int m, int n, int k, float alpha, int swizzle,
                 void* workspace, size_t workspace_bytes, size_t* needed, cudaStream_t stream) {
    auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(m, k, 1));
    auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(n, k, 1));
    auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(m, n, 1));
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<ElementAB const*>(x), stride_a, static_cast<ElementAB const*>(w), stride_b},
        {{alpha, 0.f}, nullptr, stride_d, static_cast<ElementD*>(d), stride_d},
        hw};
    args.scheduler.max_swizzle_size = swizzle;
    Gemm gemm;
    *needed = Gemm::get_workspace_size(args);
    if (*needed > workspace_bytes) return 2;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 3;
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 4;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 5;
    return cudaGetLastError() == cudaSuccess ? 0 : 6;
  }
};

// Without "FP8FastAccum" in its name a schedule takes CUTLASS's FP8 mainloop: split accumulation.
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using CoopFast = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
using PingFast = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
using EpiCoop = cutlass::epilogue::TmaWarpSpecializedCooperative;
using EpiPing = cutlass::epilogue::TmaWarpSpecialized;
using Persistent = cutlass::gemm::PersistentScheduler;
using StreamK = cutlass::gemm::StreamKScheduler;

using RunFn = int (*)(void const*, void const*, void*, int, int, int, float, int, void*, size_t, size_t*,
                      cudaStream_t);
struct Entry {
  char const* name;
  char const* accum;  // "split" or "fast"
  RunFn fn;
};
Entry const kEntries[] = {
    {"coop_128x128_c2x1", "split", &StockFp8<128, 128, 2, 1, Coop, EpiCoop, Persistent>::run},
    {"coop_128x128_c2x1_streamk", "split", &StockFp8<128, 128, 2, 1, Coop, EpiCoop, StreamK>::run},
    {"pingpong_64x128_c2x1", "split", &StockFp8<64, 128, 2, 1, Ping, EpiPing, Persistent>::run},
    {"pingpong_128x128_c2x1", "split", &StockFp8<128, 128, 2, 1, Ping, EpiPing, Persistent>::run},
    {"coop_128x256_c2x1", "fast", &StockFp8<128, 256, 2, 1, CoopFast, EpiCoop, Persistent>::run},
    {"pingpong_128x128_c2x1", "fast", &StockFp8<128, 128, 2, 1, PingFast, EpiPing, Persistent>::run},
};

}  // namespace

extern "C" {
int stock_fp8_count() { return int(sizeof(kEntries) / sizeof(kEntries[0])); }
char const* stock_fp8_name(int i) { return kEntries[i].name; }
char const* stock_fp8_accum(int i) { return kEntries[i].accum; }
// 0 on success; 2: workspace too small (*needed says how much); 3: shape not implementable; 4/5/6: CUTLASS or
// CUDA error.
int stock_fp8_run(int i, void const* x, void const* w, void* d, int m, int n, int k, float alpha, int swizzle,
                  void* workspace, size_t workspace_bytes, size_t* needed, void* stream) {
  return kEntries[i].fn(x, w, d, m, n, k, alpha, swizzle, workspace, workspace_bytes, needed,
                        static_cast<cudaStream_t>(stream));
}
}
