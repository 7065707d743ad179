// Stock CUTLASS 3 sm90 GEMM kernels (stock_gemm.h), exported through a C ABI so benchmarks/bench_cutlass_stock.py
// can time them beside cuBLAS and the flux_layers GEMM in one process. They answer one question: which of CUTLASS's
// own kernel schedules (cooperative with the TMA epilogue, ping-pong, stream-K) is faster than the flux_layers
// kernel on our shapes.
//
// Layout "nt" only: x [M, K] row-major, W [N, K] (B column-major), D [M, N] row-major, bf16, fp32 accumulate.
#include "stock_gemm.h"

namespace {

using namespace stock;

template <int TM, int TN, int CM, int CN, class KernelSchedule, class EpiSchedule, class Scheduler>
int run_bf16(void const* x, void const* w, void* d, int m, int n, int k, int swizzle, void* workspace,
             size_t workspace_bytes, size_t* needed, cudaStream_t stream) {
  return Gemm<cutlass::bfloat16_t, 64, TM, TN, CM, CN, KernelSchedule, EpiSchedule, Scheduler>::run(
      x, w, d, m, n, k, 1.f, swizzle, workspace, workspace_bytes, needed, stream);
}

using RunFn = int (*)(void const*, void const*, void*, int, int, int, int, void*, size_t, size_t*, cudaStream_t);
struct Entry {
  char const* name;
  RunFn fn;
};
Entry const kEntries[] = {
    {"coop_128x256_c2x1", &run_bf16<128, 256, 2, 1, Coop, EpiCoop, Persistent>},
    {"coop_128x256_c2x1_streamk", &run_bf16<128, 256, 2, 1, Coop, EpiCoop, StreamK>},
    {"pingpong_128x128_c2x1", &run_bf16<128, 128, 2, 1, Ping, EpiPing, Persistent>},
    {"pingpong_128x128_c1x2", &run_bf16<128, 128, 1, 2, Ping, EpiPing, Persistent>},
    {"pingpong_64x256_c2x1", &run_bf16<64, 256, 2, 1, Ping, EpiPing, Persistent>},
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
