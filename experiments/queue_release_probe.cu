// Can anything release a stream wait that holds a context's only hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1)?
//
// A fused call's handshake waits (cuStreamWaitValue32) have no bound of their own; the watchdog ends a wait whose peer
// died by writing the awaited word. With one hardware queue per context its write, issued on any stream of the same
// context, queues behind the wait (docs/design.md §4). This probe sets up exactly that, torch-free, on one GPU: a word
// in virtual-memory-mapped device memory (as torch's symmetric memory maps it), a stream wait on it, a kernel on a
// second stream of the same context, then a write of the word issued from a second driver context of the process,
// made by cuCtxCreate as resolved through cudaGetDriverEntryPointByVersion at 13000 (its CUDA 13 signature, with
// creation parameters) or at 12000 (three arguments; how the op library resolves driver calls, so the probe says
// whether that resolution gives the signature it assumes). Every driver call goes through entry points, as in the
// op library: no libcuda at link time. It reports, per run, whether the second stream was held, whether a pinned
// host allocation (the watchdog makes one before it releases) returns meanwhile, whether the other context was
// created and saw the mapping (cuMemGetAccess), whether its write completed, and whether the wait then passed.
//
// Each variant runs in its own process (a wait that is never released leaves the context unusable):
//   nvcc -O2 -std=c++17 -arch=sm_90a -o queue_release_probe benchmarks/queue_release_probe.cu
//   for c in 1 8; do for w in memset write_value; do for r in at13000 at12000; do
//     timeout 30 ./queue_release_probe $c $w $r; done; done; done
// Each line printed is one finding (a JSON record), printed as soon as it is known: where a call never returns
// (the driver may need the blocked queue for it), the lines stop before it and `timeout` ends the process.
// Durations are seconds, -1 where the thing did not happen within the probe's limit; results are CUresult codes.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace {

__global__ void mark(volatile unsigned* host_marker) { *host_marker = 1; }

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Poll `done` for up to `limit_s`; the seconds it took, or -1.
template <class F>
double wait_for(F done, double limit_s) {
  auto const t0 = Clock::now();
  while (seconds_since(t0) < limit_s) {
    if (done()) return seconds_since(t0);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return -1;
}

template <class Fn>
Fn driver(const char* name, int version = 13000) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::printf("{\"error\": \"no driver entry point %s at %d\"}\n", name, version);
    std::exit(2);
  }
  return reinterpret_cast<Fn>(fn);
}

#define DRIVER(name) static auto const name = driver<decltype(&::name)>(#name)

#define CHECK_CU(x)                                                              \
  do {                                                                           \
    CUresult r_ = (x);                                                           \
    if (r_ != CUDA_SUCCESS) {                                                    \
      std::printf("{\"error\": \"%s failed with CUresult %d\"}\n", #x, int(r_)); \
      std::exit(2);                                                              \
    }                                                                            \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  char const* connections = argc > 1 ? argv[1] : "1";
  char const* write = argc > 2 ? argv[2] : "memset";        // memset | write_value
  char const* resolution = argc > 3 ? argv[3] : "at13000";  // at13000 | at12000
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections, 1);    // read when the primary context is created, below

  cudaSetDevice(0);
  cudaFree(nullptr);  // the primary context
  DRIVER(cuDeviceGet);
  DRIVER(cuMemGetAllocationGranularity);
  DRIVER(cuMemCreate);
  DRIVER(cuMemAddressReserve);
  DRIVER(cuMemMap);
  DRIVER(cuMemSetAccess);
  DRIVER(cuMemsetD32);
  DRIVER(cuMemsetD32Async);
  DRIVER(cuStreamWaitValue32);
  DRIVER(cuStreamWriteValue32);
  DRIVER(cuMemGetAccess);
  DRIVER(cuStreamCreate);
  DRIVER(cuStreamQuery);
  DRIVER(cuCtxPopCurrent);
  CUdevice dev = 0;
  CHECK_CU(cuDeviceGet(&dev, 0));

  // One word in virtual-memory-mapped device memory, readable and writable by the device.
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t granularity = 0;
  CHECK_CU(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemGenericAllocationHandle handle{};
  CHECK_CU(cuMemCreate(&handle, granularity, &prop, 0));
  CUdeviceptr word = 0;
  CHECK_CU(cuMemAddressReserve(&word, granularity, 0, 0, 0));
  CHECK_CU(cuMemMap(word, granularity, 0, handle, 0));
  CUmemAccessDesc access_desc{};
  access_desc.location = prop.location;
  access_desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CHECK_CU(cuMemSetAccess(word, granularity, &access_desc, 1));
  CHECK_CU(cuMemsetD32(word, 0, 1));

  unsigned* host_marker = nullptr;  // the second stream's kernel writes it; the host reads it without a CUDA call
  cudaHostAlloc(reinterpret_cast<void**>(&host_marker), sizeof(unsigned), cudaHostAllocMapped);
  *host_marker = 0;
  unsigned* marker_device = nullptr;
  cudaHostGetDevicePointer(reinterpret_cast<void**>(&marker_device), host_marker, 0);

  // One JSON line per finding, printed at once: a call that never returns leaves the lines before it.
  auto report = [&](const char* what, double value) {
    std::printf("{\"connections\": %s, \"write\": \"%s\", \"resolution\": \"%s\", \"%s\": %.4f}\n", connections, write,
                resolution, what, value);
    std::fflush(stdout);
  };
  cudaStream_t waiter = nullptr, other = nullptr;
  cudaStreamCreateWithFlags(&waiter, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking);
  CHECK_CU(cuStreamWaitValue32(reinterpret_cast<CUstream>(waiter), word, 1, CU_STREAM_WAIT_VALUE_GEQ));
  mark<<<1, 1, 0, other>>>(marker_device);
  report("other_stream_ran_s", wait_for([&] { return *static_cast<volatile unsigned*>(host_marker) != 0; }, 0.5));

  // Host calls the watchdog makes before its release: pinned host memory for the flags' copy. If the driver needs
  // the blocked queue for it (mapping the pages for the device), it never returns: asked on a thread, given 2 s.
  std::atomic<double> host_alloc_s{-1};
  std::thread([&] {
    auto const t0 = Clock::now();
    void* pinned = nullptr;
    if (cudaHostAlloc(&pinned, 4096, cudaHostAllocPortable) == cudaSuccess) host_alloc_s = seconds_since(t0);
  }).detach();
  report("host_alloc_portable_s", wait_for([&] { return host_alloc_s.load() >= 0; }, 2.0));

  // The second context, made current on this thread.
  CUcontext second = nullptr;
  CUresult create = CUDA_ERROR_UNKNOWN;
  if (std::strcmp(resolution, "at12000") == 0) {
    create = driver<CUresult (*)(CUcontext*, unsigned int, CUdevice)>("cuCtxCreate", 12000)(&second, 0, dev);
  } else {
    create = driver<CUresult (*)(CUcontext*, CUctxCreateParams*, unsigned int, CUdevice)>("cuCtxCreate", 13000)(
        &second, nullptr, 0, dev);
  }
  report("second_context_create_result", create);
  if (create == CUDA_SUCCESS) {
    CUmemLocation location{};
    location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    location.id = 0;
    unsigned long long access = 0;
    report("second_context_mem_get_access_result", cuMemGetAccess(&access, &location, word));
    report("access_flags", double(access));
    CUstream stream = nullptr;
    CHECK_CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CUresult const issued = std::strcmp(write, "write_value") == 0 ? cuStreamWriteValue32(stream, word, 0x7f7f7f7f, 0)
                                                                   : cuMemsetD32Async(word, 0x7f7f7f7f, 1, stream);
    report("write_issue_result", issued);
    if (issued == CUDA_SUCCESS)
      report("write_done_s", wait_for([&] { return cuStreamQuery(stream) == CUDA_SUCCESS; }, 3.0));
    CUcontext popped = nullptr;
    cuCtxPopCurrent(&popped);
  }
  double const passed_s = wait_for([&] { return cudaStreamQuery(waiter) == cudaSuccess; }, 3.0);
  report("wait_passed_s", passed_s);
  report("other_stream_ran_after_s", wait_for([&] { return *static_cast<volatile unsigned*>(host_marker) != 0; }, 1.0));
  std::_Exit(passed_s >= 0 ? 0 : 1);  // a wait never released: no teardown through the stuck context
}
