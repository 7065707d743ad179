// Stock CUTLASS 3 sm90 GEMM kernels (GemmUniversal + collective builders, nothing of flux_layers), exported
// through a C ABI so benchmarks/bench_cutlass_stock.py can time them beside cuBLAS and the flux_layers GEMM
// in one process. They answer one question: which of CUTLASS's own kernel schedules (cooperative with the
// TMA epilogue, ping-pong, stream-K) is faster than the flux_layers kernel on our shapes.
//
// Layout "nt" only: x [M, K] row-major, W [N, K] (B column-major), D [M, N] row-major, bf16, fp32 accumulate.
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

#include <cstdio>
#include <cstring>

using namespace cute;

namespace {

template <int TM, int TN, int CM, int CN, class KernelSchedule, class EpiSchedule, class Scheduler>
struct Stock {
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = Shape<Int<TM>, Int<TN>, _64>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, 8, Element, LayoutD, 8, EpiSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static int run(void const* x, void const* w, void* d, int m, int n, int k, int swizzle, void* workspace,
                 size_t workspace_bytes, size_t* needed, cudaStream_t stream) {
    auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(m, k, 1));
    auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(n, k, 1));
    auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(m, n, 1));
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {m, n, k, 1},
                                  {static_cast<Element const*>(x), stride_a, static_cast<Element const*>(w), stride_b},
                                  {{1.f, 0.f}, nullptr, stride_d, static_cast<Element*>(d), stride_d},
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

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpiCoop = cutlass::epilogue::TmaWarpSpecializedCooperative;
using EpiPing = cutlass::epilogue::TmaWarpSpecialized;
using Persistent = cutlass::gemm::PersistentScheduler;
using StreamK = cutlass::gemm::StreamKScheduler;

using RunFn = int (*)(void const*, void const*, void*, int, int, int, int, void*, size_t, size_t*, cudaStream_t);
struct Entry {
  char const* name;
  RunFn fn;
};
Entry const kEntries[] = {
    {"coop_128x256_c2x1", &Stock<128, 256, 2, 1, Coop, EpiCoop, Persistent>::run},
    {"coop_128x256_c2x1_streamk", &Stock<128, 256, 2, 1, Coop, EpiCoop, StreamK>::run},
    {"pingpong_128x128_c2x1", &Stock<128, 128, 2, 1, Ping, EpiPing, Persistent>::run},
    {"pingpong_128x128_c1x2", &Stock<128, 128, 1, 2, Ping, EpiPing, Persistent>::run},
    {"pingpong_64x256_c2x1", &Stock<64, 256, 2, 1, Ping, EpiPing, Persistent>::run},
};

}  // namespace

extern "C" {
int stock_count() { return int(sizeof(kEntries) / sizeof(kEntries[0])); }
char const* stock_name(int i) { return kEntries[i].name; }
// 0 on success; 2: workspace too small (*needed says how much); 3: shape not implementable; 4/5/6: CUTLASS or
// CUDA error.
int stock_run(int i, void const* x, void const* w, void* d, int m, int n, int k, int swizzle, void* workspace,
              size_t workspace_bytes, size_t* needed, void* stream) {
  return kEntries[i].fn(x, w, d, m, n, k, swizzle, workspace, workspace_bytes, needed,
                        static_cast<cudaStream_t>(stream));
}
}
