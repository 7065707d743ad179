// The receive of the host-staged stand-in for NCCL's send/recv (flux_layers/runtime/multinode/sendrecv.py), made the
// way an NCCL receive is: a kernel on SMs that waits for a word the host stores and then copies the bytes, so the
// stand-in puts no stream wait and no copy-engine copy into the hardware queue the persistent GEMM shares under
// CUDA_DEVICE_MAX_CONNECTIONS=1.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flux {

// On `stream`: every CTA waits until *word >= value (a system-scope acquire load of host-mapped memory that a host
// thread stores into), then the grid copies `bytes` bytes from `src` (host-mapped pinned memory, read past the
// caches) to `dst` (device memory). Unbounded: the stand-in's watcher stores the word's maximum on a failure.
void receive_from_host(const uint32_t* word, uint32_t value, const void* src, void* dst, size_t bytes,
                       cudaStream_t stream);

}  // namespace flux
