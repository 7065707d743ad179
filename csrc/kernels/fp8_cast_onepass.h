// The one-pass FP8 casts' launchers (csrc/kernels/fp8_cast_onepass.cu, fp8_cast_rowwise.cu), called by
// launch_quantize_fp8 (csrc/kernels/fp8_cast.cu) on inputs it has checked.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flux/fp8_cast.h"

namespace flux {
namespace fp8cast {

// The tensor-wise one-pass kernel's launch for one input and format on the current device: `grid` CTAs, all
// co-resident, each holding `held` work units on chip with `smem` bytes of dynamic shared memory. grid 0: the device
// cannot run it (no cooperative launches, or the kernel does not fit an SM). The first call per kernel and device
// also raises the kernel's shared memory limit, so launch_onepass makes no host call but the launch.
struct OnePassShape {
  int grid = 0;
  int held = 0;
  size_t smem = 0;
};

OnePassShape onepass_shape(const CastInput& in, DType out, bool transposed);

// data (and data_t where non-null) and scale[0]; `partial` holds shape.grid floats of any contents (each CTA writes
// its own before any reads them). false, with nothing launched, where the driver refuses the grid as larger than
// can be co-resident (the context has fewer SMs than the device).
bool launch_onepass(const OnePassShape& shape, const CastInput& in, float margin_factor, DType out, void* data,
                    void* data_t, float* scale, float* partial, cudaStream_t stream);

// Row-wise: one block per row reads its row once and writes data and scale[r].
void launch_rowwise_onepass(const CastInput& in, float margin_factor, DType out, void* data, float* scale,
                            cudaStream_t stream);

}  // namespace fp8cast
}  // namespace flux
