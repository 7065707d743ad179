// flux/host_receive.h: the host-staged stand-in's receive kernel.
#include <algorithm>

#include "flux/check.h"
#include "flux/host_receive.h"
#include "sync_primitives.cuh"

namespace flux {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4;  // beside a persistent GEMM that leaves FLUX_LAYERS_NCCL_SMS SMs free, as NCCL's kernels

__global__ void receive_from_host_kernel(const uint32_t* word, uint32_t value, const uint8_t* src, uint8_t* dst,
                                         size_t bytes) {
  if (threadIdx.x == 0) {
    while (!epoch_reached(ld_acquire<Scope::kSys>(word), value)) __nanosleep(2000);
  }
  __syncthreads();
  size_t const first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t const step = size_t(gridDim.x) * blockDim.x;
  bool const vectors = (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0;
  size_t const head = vectors ? bytes / 16 * 16 : 0;
  // __ldcv: a pinned buffer is reused across exchanges; a line an earlier receive read must not be served again.
  for (size_t i = first * 16; i < head; i += step * 16)
    *reinterpret_cast<uint4*>(dst + i) = __ldcv(reinterpret_cast<const uint4*>(src + i));
  for (size_t i = head + first; i < bytes; i += step) dst[i] = __ldcv(src + i);
}

}  // namespace

void receive_from_host(const uint32_t* word, uint32_t value, const void* src, void* dst, size_t bytes,
                       cudaStream_t stream) {
  size_t const per_block = size_t(kThreads) * 16 * 8;
  int const blocks =
      static_cast<int>(std::max<size_t>(1, std::min<size_t>(kMaxBlocks, (bytes + per_block - 1) / per_block)));
  receive_from_host_kernel<<<blocks, kThreads, 0, stream>>>(word, value, static_cast<const uint8_t*>(src),
                                                            static_cast<uint8_t*>(dst), bytes);
  FLUX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flux
