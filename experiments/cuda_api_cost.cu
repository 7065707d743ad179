// Host cost of one call of each CUDA operation a fused call makes: empty-kernel launches with parameter blocks of
// several sizes (plain and with a cluster attribute, as the persistent GEMM is launched), stream memory operations
// (single and batched), event record and wait, device-to-device copies through each API, a memset, the capture
// query, and the push all-gather's comm-stream sequence (and the whole TP=2 call) op by op against one graph of it.
// Each figure: wall time per call of 300 calls enqueued on two streams behind a ~30 ms GPU spin (so the GPU never
// drains the queue while the host enqueues), median of 7. One GPU; no torch.
//
// Build and run (nvcc on the CPU machine; the binary alone travels to the GPU machine):
//   nvcc -O2 -std=c++17 -arch=sm_90a -o cuda_api_cost experiments/cuda_api_cost.cu && ./cuda_api_cost
// Results: benchmarks/results/cuda_api_cost_h200.json.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
template <int N> struct alignas(64) P { char b[N]; };
template <int N> __global__ void kplain(const __grid_constant__ P<N> p) { if (p.b[0] == 123 && threadIdx.x == 9999) printf("x"); }
template <int N> __global__ void kclu(const __grid_constant__ P<N> p) { if (p.b[0] == 123 && threadIdx.x == 9999) printf("x"); }
using Clock = std::chrono::steady_clock;
__global__ void spin(long long ns) {
  long long t0 = clock64();
  while (clock64() - t0 < ns * 2) {}  // ~2 cycles per ns at the H200's clocks: long enough to queue behind
}
cudaStream_t g_streams[2];
// Host wall time per call of n calls queued on both streams behind a ~30 ms GPU spin: the GPU never drains the
// queue while the host enqueues, so this is the host's cost alone.
template <class F> double per_call(F f, int n = 300) {
  std::vector<double> r;
  for (int rep = 0; rep < 7; ++rep) {
    cudaDeviceSynchronize();
    spin<<<1, 1, 0, g_streams[0]>>>(30000000);
    spin<<<1, 1, 0, g_streams[1]>>>(30000000);
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) f(i);
    auto t1 = Clock::now();
    r.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / n);
  }
  cudaDeviceSynchronize();
  std::sort(r.begin(), r.end());
  return r[3];
}
template <int N> void launches(cudaStream_t s) {
  P<N> p{}; p.b[0] = 1;
  double plain = per_call([&](int) { kplain<N><<<132, 384, 0, s>>>(p); });
  cudaLaunchAttribute attr; attr.id = cudaLaunchAttributeClusterDimension; attr.val.clusterDim.x = 2; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(132); cfg.blockDim = dim3(384); cfg.stream = s; cfg.attrs = &attr; cfg.numAttrs = 1;
  double clu = per_call([&](int) { cudaLaunchKernelEx(&cfg, kclu<N>, p); });
  std::printf("params %5d B: <<<>>> %.2f us, cudaLaunchKernelEx cluster 2 %.2f us\n", N, plain, clu);
}
int main() {
  cudaSetDevice(0);
  cudaStream_t s, s2; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
  g_streams[0] = s; g_streams[1] = s2;
  launches<256>(s); launches<1024>(s); launches<2048>(s); launches<4096>(s); launches<6144>(s); launches<8192>(s);
  launches<256>(s); launches<6144>(s);
  unsigned* w; cudaMalloc(&w, 4096); cudaMemset(w, 0, 4096);
  void* fn; cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &q);
  auto wr = reinterpret_cast<CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned)>(fn);
  cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &q);
  auto wt = reinterpret_cast<CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned)>(fn);
  cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &fn, 12000, cudaEnableDefault, &q);
  auto bt = reinterpret_cast<CUresult (*)(CUstream, unsigned, CUstreamBatchMemOpParams*, unsigned)>(fn);
  std::printf("cuStreamWriteValue32 %.2f us\n", per_call([&](int i) { wr((CUstream)s, (CUdeviceptr)w, i, 0); }));
  std::printf("cuStreamWaitValue32 (passes) %.2f us\n", per_call([&](int) { wt((CUstream)s, (CUdeviceptr)w, 0, CU_STREAM_WAIT_VALUE_GEQ); }));
  CUstreamBatchMemOpParams ops[3] = {};
  for (int j = 0; j < 3; ++j) { ops[j].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32; ops[j].writeValue.address = (CUdeviceptr)(w + j); ops[j].writeValue.value = 1; }
  std::printf("cuStreamBatchMemOp 3 writes %.2f us\n", per_call([&](int) { bt((CUstream)s, 3, ops, 0); }));
  cudaEvent_t e; cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  std::printf("cudaEventRecord %.2f us\n", per_call([&](int) { cudaEventRecord(e, s); }));
  std::printf("cudaStreamWaitEvent %.2f us\n", per_call([&](int) { cudaStreamWaitEvent(s2, e, 0); }));
  cudaStreamCaptureStatus cs;
  std::printf("cudaStreamIsCapturing %.2f us\n", per_call([&](int) { cudaStreamIsCapturing(s, &cs); }));
  int dev; std::printf("cudaGetDevice %.3f us\n", per_call([&](int) { cudaGetDevice(&dev); }));
  char *a, *b; cudaMalloc(&a, 1 << 24); cudaMalloc(&b, 1 << 24);
  std::printf("cudaMemcpyAsync D2D 8 MiB %.2f us\n", per_call([&](int) { cudaMemcpyAsync(b, a, 1 << 23, cudaMemcpyDefault, s2); }));
  std::printf("cudaMemcpy2DAsync D2D %.2f us\n", per_call([&](int) { cudaMemcpy2DAsync(b, 8192, a, 8192, 4096, 256, cudaMemcpyDefault, s2); }));
  std::printf("cudaMemcpyAsync D2D kind DeviceToDevice %.2f us\n", per_call([&](int) { cudaMemcpyAsync(b, a, 1 << 20, cudaMemcpyDeviceToDevice, s2); }));
  std::printf("cudaMemcpyAsync D2D 1 MiB kind Default %.2f us\n", per_call([&](int) { cudaMemcpyAsync(b, a, 1 << 20, cudaMemcpyDefault, s2); }));
  std::printf("cudaMemcpyAsync D2D 64 KiB kind Default %.2f us\n", per_call([&](int) { cudaMemcpyAsync(b, a, 1 << 16, cudaMemcpyDefault, s2); }));
  cudaGetDriverEntryPointByVersion("cuMemcpyDtoDAsync", &fn, 12000, cudaEnableDefault, &q);
  auto dd = reinterpret_cast<CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream)>(fn);
  std::printf("cuMemcpyDtoDAsync 1 MiB %.2f us\n", per_call([&](int) { dd((CUdeviceptr)b, (CUdeviceptr)a, 1 << 20, (CUstream)s2); }));
  cudaGetDriverEntryPointByVersion("cuMemcpyAsync", &fn, 12000, cudaEnableDefault, &q);
  auto ma = reinterpret_cast<CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream)>(fn);
  std::printf("cuMemcpyAsync 1 MiB %.2f us\n", per_call([&](int) { ma((CUdeviceptr)b, (CUdeviceptr)a, 1 << 20, (CUstream)s2); }));
  std::printf("cudaMemsetAsync 64 B %.2f us\n", per_call([&](int) { cudaMemsetAsync(w, 0, 64, s); }));

  // The push all-gather's comm-stream sequence at TP=2 (one chunk): a wait batch (the GEMM's started word, the
  // peer's done of the previous call), the 8 MiB copy, a write batch (the chunk flag, the sent word); each call's
  // values are its epoch. Enqueued op by op, against one graph of the same three operations whose two batch nodes
  // take the call's values before each launch (cuGraphExecBatchMemOpNodeSetParams), and that graph launched alone.
  cudaGetDriverEntryPointByVersion("cuGraphExecBatchMemOpNodeSetParams", &fn, 12000, cudaEnableDefault, &q);
  auto set_batch = reinterpret_cast<CUresult (*)(CUgraphExec, CUgraphNode, const CUDA_BATCH_MEM_OP_NODE_PARAMS*)>(fn);
  cudaGetDriverEntryPointByVersion("cuGraphNodeGetType", &fn, 12000, cudaEnableDefault, &q);
  auto node_type = reinterpret_cast<CUresult (*)(CUgraphNode, CUgraphNodeType*)>(fn);
  cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &q);
  CUcontext ctx = nullptr;
  reinterpret_cast<CUresult (*)(CUcontext*)>(fn)(&ctx);
  cudaMemset(w, 0, 4096);  // every wait below passes: it waits for >= 0
  CUstreamBatchMemOpParams waits[2] = {}, writes[2] = {};
  auto fill = [&](int epoch) {
    for (int j = 0; j < 2; ++j) {
      waits[j].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      waits[j].waitValue.address = (CUdeviceptr)(w + 8 + j);
      waits[j].waitValue.value = 0;
      waits[j].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
      writes[j].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      writes[j].writeValue.address = (CUdeviceptr)(w + 16 + j);
      writes[j].writeValue.value = epoch;
    }
  };
  auto sequence = [&](int epoch) {
    fill(epoch);
    bt((CUstream)s2, 2, waits, 0);
    cudaMemcpyAsync(b, a, 1 << 23, cudaMemcpyDefault, s2);
    bt((CUstream)s2, 2, writes, 0);
  };
  std::printf("comm sequence op by op (wait batch, 8 MiB copy, write batch) %.2f us\n", per_call(sequence));
  cudaGraph_t graph;
  cudaStreamBeginCapture(s2, cudaStreamCaptureModeThreadLocal);
  sequence(1);
  cudaError_t captured = cudaStreamEndCapture(s2, &graph);
  cudaGraphExec_t exec;
  cudaError_t instantiated = captured == cudaSuccess ? cudaGraphInstantiate(&exec, graph, 0) : captured;
  std::printf("graph capture: %s, instantiation: %s\n", cudaGetErrorString(captured), cudaGetErrorString(instantiated));
  if (instantiated != cudaSuccess) return 1;
  size_t count = 0;
  cudaGraphGetNodes(graph, nullptr, &count);
  std::vector<cudaGraphNode_t> nodes(count);
  cudaGraphGetNodes(graph, nodes.data(), &count);
  std::vector<CUgraphNode> batches;  // in capture order: the waits, then the writes
  cudaGraphNode_t copy_node = nullptr;
  for (cudaGraphNode_t n : nodes) {
    CUgraphNodeType t;
    if (node_type((CUgraphNode)n, &t) != CUDA_SUCCESS) continue;
    if (t == CU_GRAPH_NODE_TYPE_BATCH_MEM_OP) batches.push_back((CUgraphNode)n);
    if (t == CU_GRAPH_NODE_TYPE_MEMCPY) copy_node = n;
  }
  std::printf("graph: %zu nodes, %zu batch nodes, copy node %s\n", count, batches.size(), copy_node ? "found" : "none");
  if (batches.size() == 2 && copy_node != nullptr) {
    auto graphed = [&](int epoch) {
      fill(epoch);
      CUDA_BATCH_MEM_OP_NODE_PARAMS wp = {ctx, 2, waits, 0}, xp = {ctx, 2, writes, 0};
      set_batch((CUgraphExec)exec, batches[0], &wp);
      set_batch((CUgraphExec)exec, batches[1], &xp);
      cudaGraphLaunch(exec, s2);
    };
    // each call's source: the layer's activation is not always at the same address
    auto graphed_copy = [&](int epoch) {
      fill(epoch);
      CUDA_BATCH_MEM_OP_NODE_PARAMS wp = {ctx, 2, waits, 0}, xp = {ctx, 2, writes, 0};
      set_batch((CUgraphExec)exec, batches[0], &wp);
      cudaGraphExecMemcpyNodeSetParams1D(exec, copy_node, b, a + (epoch & 1) * (1 << 23), 1 << 23, cudaMemcpyDefault);
      set_batch((CUgraphExec)exec, batches[1], &xp);
      cudaGraphLaunch(exec, s2);
    };
    std::printf("comm sequence as a graph, 2 batch nodes set, launch %.2f us\n", per_call(graphed));
    std::printf("comm sequence as a graph, 2 batch nodes and the copy's source set, launch %.2f us\n",
                per_call(graphed_copy));
    std::printf("the graph's launch alone %.2f us\n", per_call([&](int) { cudaGraphLaunch(exec, s2); }));
    cudaDeviceSynchronize();
    unsigned flag = 0;  // the last graphed call's epoch reached the word: the set values are the ones that ran
    graphed(4242);
    cudaDeviceSynchronize();
    cudaMemcpy(&flag, w + 16, 4, cudaMemcpyDeviceToHost);
    std::printf("graph's write after setting 4242: %u\n", flag);
  }

  // The whole call at TP=2 as one graph: the GEMM's launch (a 6 KB parameter block, cluster 2) on s beside the comm
  // sequence on s2, against the same enqueued op by op; per call the kernel node takes new parameters (the call's
  // operands) and the batch and copy nodes theirs.
  P<6144> gemm_params{};
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2; cluster.val.clusterDim.y = 1; cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t gemm_cfg = {};
  gemm_cfg.gridDim = dim3(132); gemm_cfg.blockDim = dim3(384); gemm_cfg.stream = s; gemm_cfg.attrs = &cluster;
  gemm_cfg.numAttrs = 1;
  cudaEvent_t fork, join;
  cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
  auto whole_call = [&](int epoch) {
    gemm_params.b[1] = char(epoch);
    cudaLaunchKernelEx(&gemm_cfg, kclu<6144>, gemm_params);
    sequence(epoch);
  };
  std::printf("whole call op by op (GEMM launch, wait batch, copy, write batch) %.2f us\n", per_call(whole_call));
  cudaGraph_t call_graph;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  cudaEventRecord(fork, s);
  cudaStreamWaitEvent(s2, fork, 0);
  whole_call(1);
  cudaEventRecord(join, s2);
  cudaStreamWaitEvent(s, join, 0);
  captured = cudaStreamEndCapture(s, &call_graph);
  cudaGraphExec_t call_exec;
  instantiated = captured == cudaSuccess ? cudaGraphInstantiate(&call_exec, call_graph, 0) : captured;
  std::printf("call graph capture: %s, instantiation: %s\n", cudaGetErrorString(captured),
              cudaGetErrorString(instantiated));
  if (instantiated == cudaSuccess) {
    cudaGraphGetNodes(call_graph, nullptr, &count);
    nodes.resize(count);
    cudaGraphGetNodes(call_graph, nodes.data(), &count);
    std::vector<CUgraphNode> call_batches;
    cudaGraphNode_t call_copy = nullptr, kernel = nullptr;
    for (cudaGraphNode_t n : nodes) {
      CUgraphNodeType t;
      if (node_type((CUgraphNode)n, &t) != CUDA_SUCCESS) continue;
      if (t == CU_GRAPH_NODE_TYPE_BATCH_MEM_OP) call_batches.push_back((CUgraphNode)n);
      if (t == CU_GRAPH_NODE_TYPE_MEMCPY) call_copy = n;
      if (t == CU_GRAPH_NODE_TYPE_KERNEL) kernel = n;
    }
    cudaKernelNodeParams kp = {};
    if (kernel != nullptr) cudaGraphKernelNodeGetParams(kernel, &kp);
    std::printf("call graph: %zu nodes, %zu batch nodes, copy %s, kernel %s\n", count, call_batches.size(),
                call_copy ? "found" : "none", kernel ? "found" : "none");
    if (call_batches.size() == 2 && call_copy != nullptr && kernel != nullptr) {
      void* kernel_args[1] = {&gemm_params};
      kp.kernelParams = kernel_args;
      auto graphed_call = [&](int epoch) {
        fill(epoch);
        gemm_params.b[1] = char(epoch);
        cudaGraphExecKernelNodeSetParams(call_exec, kernel, &kp);
        CUDA_BATCH_MEM_OP_NODE_PARAMS wp = {ctx, 2, waits, 0}, xp = {ctx, 2, writes, 0};
        set_batch((CUgraphExec)call_exec, call_batches[0], &wp);
        cudaGraphExecMemcpyNodeSetParams1D(call_exec, call_copy, b, a + (epoch & 1) * (1 << 23), 1 << 23,
                                           cudaMemcpyDefault);
        set_batch((CUgraphExec)call_exec, call_batches[1], &xp);
        cudaGraphLaunch(call_exec, s);
      };
      std::printf("whole call as a graph, kernel, batch and copy nodes set, launch %.2f us\n", per_call(graphed_call));
    }
  }
  std::printf("error: %s\n", cudaGetErrorString(cudaGetLastError()));
}
