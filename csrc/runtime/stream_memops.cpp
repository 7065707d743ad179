// cuStreamWriteValue32 / cuStreamWaitValue32 obtained through cudaGetDriverEntryPointByVersion, so the
// library needs no libcuda at link time (the build machine has none).
#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>

#include "flux/check.h"
#include "flux/fused_ops.h"

namespace flux {
namespace {

using WriteFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WaitFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct MemOps {
  WriteFn write = nullptr;
  WaitFn wait = nullptr;
};

template <class Fn>
Fn entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  FLUX_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status));
  FLUX_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "the CUDA driver does not provide ", name);
  return reinterpret_cast<Fn>(fn);
}

const MemOps& memops() {
  static MemOps ops;
  static std::once_flag once;
  std::call_once(once, [] {
    ops.write = entry_point<WriteFn>("cuStreamWriteValue32");
    ops.wait = entry_point<WaitFn>("cuStreamWaitValue32");
  });
  return ops;
}

void check_driver(CUresult r, const char* what) {
  FLUX_CHECK(r == CUDA_SUCCESS, what, " failed with CUresult ", int(r));
}

}  // namespace

void stream_write_u32(cudaStream_t stream, uint32_t* address, uint32_t value) {
  // Default flags: the write is ordered after all prior work of the stream and its memory effects.
  check_driver(memops().write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value,
                              CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue32");
}

void stream_wait_u32_geq(cudaStream_t stream, const uint32_t* address, uint32_t value) {
  check_driver(memops().wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value,
                             CU_STREAM_WAIT_VALUE_GEQ),
               "cuStreamWaitValue32");
}

}  // namespace flux
