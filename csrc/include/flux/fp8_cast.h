// FP8 casts with current scaling (torch-free launchers; csrc/kernels/fp8_cast.cu). Scales are dequantization scales
// (value = fp8 * scale), scale = amax * margin_factor / fp8_max, 1 where the amax is 0; data = x * (1 / scale) (the
// inverse rounded once to fp32, then one multiply per element, cheaper than a division and within about an fp32 ulp
// of x / scale), saturated to the format's finite range and rounded to nearest: the same arithmetic as
// flux_layers/ops/fp8.py's torch path, so both give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flux/gemm_params.h"

namespace flux {

// A 16-bit matrix [rows, cols] with row stride ld (elements), 16-byte aligned rows.
struct CastInput {
  const void* x = nullptr;
  DType dtype = DType::kBF16;  // kBF16 or kFP16
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
};

// amax[0] = max |x| (per_row false; amax[0] must hold 0 or a smaller value beforehand: blocks combine by atomicMax),
// or amax[r] = max |x[r, :]| (per_row).
void launch_amax(const CastInput& in, bool per_row, float* amax, cudaStream_t stream);

// data [rows, cols] (contiguous) = cast of x by its scale, the scale (one, or one per row) written to scale; with
// data_t non-null (tensor-wise only) also the transpose [cols, rows] (contiguous) with the same scale.
void launch_cast_fp8(const CastInput& in, const float* amax, bool per_row, float margin_factor, DType out, void* data,
                     void* data_t, float* scale, cudaStream_t stream);

// The kernels of one cast (plan_quantize_fp8 picks them).
enum class CastKernel : int {
  kNone = 0,        // no rows: nothing to write
  kOnePass = 1,     // tensor-wise: one cooperative kernel reads the input once (csrc/kernels/fp8_cast_onepass.cu)
  kRowOnePass = 2,  // row-wise: one block per row reads it once (csrc/kernels/fp8_cast_rowwise.cu)
  kTwoPass = 3,     // launch_amax, then launch_cast_fp8
};

struct QuantizePlan {
  CastKernel kernel = CastKernel::kNone;
  int grid = 0;                // kOnePass: CTAs, all co-resident
  int held = 0;                // kOnePass: 8 KB work units each CTA holds on chip
  size_t smem = 0;             // kOnePass: dynamic shared memory per CTA, bytes
  int64_t scratch_floats = 0;  // device scratch launch_quantize_fp8 takes, of any contents
};

// The kernels for a cast of `in` to `out` on the current device: one pass where they apply (every input the casts
// take, on a device with cooperative launches), else, or with two_pass, the amax and cast passes. Checks the input
// (flux::Error naming what is wrong); host-only, device properties asked once per device.
QuantizePlan plan_quantize_fp8(const CastInput& in, DType out, bool per_row, bool transposed, bool two_pass);

// The cast `plan` describes (plan_quantize_fp8 of the same input, format and flags): data [rows, cols]
// (contiguous), data_t [cols, rows] (contiguous) where non-null (tensor-wise only), scale [1] or [rows] (per_row);
// scratch holds plan.scratch_floats floats. Only kernel launches (and, two-pass tensor-wise, a memset of the amax) on
// `stream`: no host sync, capturable in CUDA graphs (the one-pass kernel is a cooperative launch, which stream capture
// records as a cooperative kernel node).
void launch_quantize_fp8(const QuantizePlan& plan, const CastInput& in, bool per_row, float margin_factor, DType out,
                         void* data, void* data_t, float* scale, float* scratch, cudaStream_t stream);

// out [cols, rows] = the transpose of FP8 data [rows, cols] whose rows come in `blocks` equal blocks with scales
// block_scale[b], re-cast to one scale, the largest (written to out_scale[0]).
void launch_transpose_to_common_scale(const void* data, DType dtype, int64_t rows, int64_t cols,
                                      const float* block_scale, int blocks, void* out, float* out_scale,
                                      cudaStream_t stream);

}  // namespace flux
