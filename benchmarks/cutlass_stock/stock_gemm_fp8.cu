// Stock CUTLASS 3 sm90 FP8 GEMM kernels (stock_gemm.h), exported through a C ABI so
// benchmarks/bench_cutlass_stock.py --fp8 can time them beside cuBLASLt's _scaled_mm and the flux_layers FP8 GEMM in
// one process. The question: does any of CUTLASS's own schedules (cooperative, ping-pong, stream-K; split
// accumulation, which CUTLASS's FP8 mainloop promotes every 4 MMAs, or fast) keep up with cuBLASLt where ours falls
// behind (short K), and which.
//
// Layout "nt" only: x [M, K] row-major e4m3, W [N, K] (B column-major) e4m3, D [M, N] row-major bf16, fp32
// accumulate; one tensor-wise scale, alpha = scale_x * scale_w, passed by value.
#include "stock_gemm.h"

namespace {

using namespace stock;

// Without "FP8FastAccum" in its name a schedule takes CUTLASS's FP8 mainloop: split accumulation.
using CoopFast = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
using PingFast = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;

template <int TM, int TN, int CM, int CN, class KernelSchedule, class EpiSchedule, class Scheduler>
constexpr auto run_e4m3 =
    &Gemm<cutlass::float_e4m3_t, 128, TM, TN, CM, CN, KernelSchedule, EpiSchedule, Scheduler>::run;

using RunFn = int (*)(void const*, void const*, void*, int, int, int, float, int, void*, size_t, size_t*, cudaStream_t);
struct Entry {
  char const* name;
  char const* accum;  // "split" or "fast"
  RunFn fn;
};
Entry const kEntries[] = {
    {"coop_128x128_c2x1", "split", run_e4m3<128, 128, 2, 1, Coop, EpiCoop, Persistent>},
    {"coop_128x128_c2x1_streamk", "split", run_e4m3<128, 128, 2, 1, Coop, EpiCoop, StreamK>},
    {"pingpong_64x128_c2x1", "split", run_e4m3<64, 128, 2, 1, Ping, EpiPing, Persistent>},
    {"pingpong_128x128_c2x1", "split", run_e4m3<128, 128, 2, 1, Ping, EpiPing, Persistent>},
    {"coop_128x256_c2x1", "fast", run_e4m3<128, 256, 2, 1, CoopFast, EpiCoop, Persistent>},
    {"pingpong_128x128_c2x1", "fast", run_e4m3<128, 128, 2, 1, PingFast, EpiPing, Persistent>},
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
