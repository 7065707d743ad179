// Checks of a GEMM call's tensors, shared by the plain GEMM and the fused ops (csrc/bindings/ops.cpp): dtypes and
// their pairing, shapes, strides and alignment (what TMA and the epilogue need), and FP8 scales. Bad arguments raise
// ValueError (TORCH_CHECK_VALUE) naming the argument, what it is and what was expected.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "flux/gemm_dispatch.h"
#include "flux/gemm_params.h"

namespace flux::bindings {

// The flux::DType of a tensor: bfloat16, float16, float8_e4m3fn or float8_e5m2 (else ValueError naming `name`).
DType to_dtype(const at::Tensor& t, const char* name);
const char* dtype_name(DType d);

struct MatmulShape {
  int64_t m, k, n;
};

// x [M, K] and the weight ([N, K] 'nt', [K, N] 'nn'), optional bias [N]: one CUDA device; 2-D, unit stride along
// columns, 16-byte aligned rows and data; K and N multiples of 8 (16 for FP8); 16-bit operands of one dtype (out the
// same) or FP8 operands in an allowed pair ('nt' only, out bfloat16); the bias in the output dtype.
struct Operands {
  MatmulShape shape;
  GemmTypes types;
  at::ScalarType out_dtype;
};
Operands check_operands(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool weight_nn,
                        bool fast_accum);

// FP8 scales as torch._scaled_mm takes them (fp32, contiguous, on x's device): x_scale one element (tensor-wise) or
// [x_rows, 1] (row-wise); w_scale one element or one per output column ([1, N] or [N, 1]). Both are required with
// FP8 operands and refused with 16-bit ones. The modes and pointers as GemmProblem takes them (ScaleMode).
struct Scales {
  ScaleMode x_mode = ScaleMode::kNone;
  const float* x = nullptr;
  ScaleMode w_mode = ScaleMode::kNone;
  const float* w = nullptr;
};
Scales check_scales(const Operands& ops, const at::Tensor& x, const std::optional<at::Tensor>& x_scale,
                    const std::optional<at::Tensor>& w_scale, int64_t x_rows, const char* op);

// out: a contiguous [rows, cols] tensor of dtype `dtype` on x's device.
void check_out(const at::Tensor& out, const at::Tensor& x, at::ScalarType dtype, int64_t rows, int64_t cols,
               const char* name);

}  // namespace flux::bindings
