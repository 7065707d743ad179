// CUDA driver entry points, each resolved once through cudaGetDriverEntryPointByVersion, so the library needs no
// libcuda at link time (the build machine has none) and a call pays no symbol lookup:
//   * cuStreamWriteValue32 / cuStreamWaitValue32 / cuStreamBatchMemOp (the copy-engine flags and handshakes);
//   * cuTensorMapEncodeTiled, which CUTLASS calls for every TMA descriptor. The library is compiled with
//     CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, so CUTLASS calls this symbol directly; defined here (hidden) it
//     forwards to the driver's entry point. Without it CUTLASS looks the entry point up by name for every
//     descriptor, several times per fused call.
#include <cuda.h>
#include <cuda_runtime.h>

#include "flux/check.h"
#include "flux/fused_ops.h"

namespace flux {
namespace {

using WriteFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WaitFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using BatchFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

template <class Fn>
Fn entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  FLUX_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status));
  FLUX_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "the CUDA driver does not provide ", name);
  return reinterpret_cast<Fn>(fn);
}

// Function-local statics: initialised once, thread-safe.
WriteFn write_fn() {
  static WriteFn const fn = entry_point<WriteFn>("cuStreamWriteValue32");
  return fn;
}
WaitFn wait_fn() {
  static WaitFn const fn = entry_point<WaitFn>("cuStreamWaitValue32");
  return fn;
}

BatchFn batch_fn() {
  static BatchFn const fn = entry_point<BatchFn>("cuStreamBatchMemOp");
  return fn;
}

void batch(cudaStream_t stream, const FlagOp* ops, int count, bool wait) {
  FLUX_CHECK(count >= 0 && count <= kMaxFlagOps, count, " flag operations in one batch (at most ", kMaxFlagOps, ")");
  CUstreamBatchMemOpParams params[kMaxFlagOps] = {};
  for (int i = 0; i < count; ++i) {
    if (wait) {
      params[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      params[i].waitValue.address = reinterpret_cast<CUdeviceptr>(ops[i].address);
      params[i].waitValue.value = ops[i].value;
      params[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    } else {
      params[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      params[i].writeValue.address = reinterpret_cast<CUdeviceptr>(ops[i].address);
      params[i].writeValue.value = ops[i].value;
      params[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
  }
  CUresult const r = batch_fn()(reinterpret_cast<CUstream>(stream), unsigned(count), params, 0);
  FLUX_CHECK(r == CUDA_SUCCESS, "cuStreamBatchMemOp (", count, wait ? " waits" : " writes", ") failed with CUresult ",
             int(r));
}

void check_driver(CUresult r, const char* what) {
  FLUX_CHECK(r == CUDA_SUCCESS, what, " failed with CUresult ", int(r));
}

}  // namespace

void stream_write_u32(cudaStream_t stream, uint32_t* address, uint32_t value) {
  // Default flags: the write is ordered after all prior work of the stream and its memory effects.
  check_driver(write_fn()(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value,
                          CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue32");
}

void stream_wait_u32_geq(cudaStream_t stream, const uint32_t* address, uint32_t value) {
  check_driver(wait_fn()(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value,
                         CU_STREAM_WAIT_VALUE_GEQ),
               "cuStreamWaitValue32");
}

void stream_write_u32_all(cudaStream_t stream, const FlagOp* writes, int count) {
  if (count == 1) return stream_write_u32(stream, writes[0].address, writes[0].value);
  if (count > 1) batch(stream, writes, count, false);
}

void stream_write_signed_flag(cudaStream_t stream, uint32_t* slot, const uint32_t* signature, uint32_t* flag,
                              uint32_t value) {
  static_assert(kSignatureWords + 1 <= kMaxFlagOps, "a signature and its flag fit one batch");
  FlagOp ops[kSignatureWords + 1];
  for (int i = 0; i < kSignatureWords; ++i) ops[i] = {slot + i, signature[i]};
  ops[kSignatureWords] = {flag, value};
  stream_write_u32_all(stream, ops, kSignatureWords + 1);
}

void stream_wait_u32_geq_all(cudaStream_t stream, const FlagOp* waits, int count) {
  if (count == 1) return stream_wait_u32_geq(stream, waits[0].address, waits[0].value);
  if (count > 1) batch(stream, waits, count, true);
}

}  // namespace flux

extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI
cuTensorMapEncodeTiled(CUtensorMap* tensor_map, CUtensorMapDataType data_type, cuuint32_t rank, void* global_address,
                       const cuuint64_t* global_dim, const cuuint64_t* global_strides, const cuuint32_t* box_dim,
                       const cuuint32_t* element_strides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                       CUtensorMapL2promotion l2_promotion, CUtensorMapFloatOOBfill oob_fill) {
  static flux::EncodeTiledFn const fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status);
    return err == cudaSuccess && status == cudaDriverEntryPointSuccess ? reinterpret_cast<flux::EncodeTiledFn>(p)
                                                                       : nullptr;
  }();
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;  // CUTLASS reports a failed encode
  return fn(tensor_map, data_type, rank, global_address, global_dim, global_strides, box_dim, element_strides,
            interleave, swizzle, l2_promotion, oob_fill);
}
