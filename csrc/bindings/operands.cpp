#include "operands.h"

#include <c10/util/Exception.h>

#include <cstdint>

namespace flux::bindings {

using at::Tensor;

DType to_dtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return DType::kBF16;
    case at::kHalf:
      return DType::kFP16;
    case at::kFloat8_e4m3fn:
      return DType::kE4M3;
    case at::kFloat8_e5m2:
      return DType::kE5M2;
    default:
      TORCH_CHECK_VALUE(false, name, " must be bfloat16, float16, float8_e4m3fn or float8_e5m2, got ", t.scalar_type());
  }
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kFP16:
      return "float16";
    case DType::kE4M3:
      return "float8_e4m3fn";
    case DType::kE5M2:
      return "float8_e5m2";
  }
  return "?";
}

namespace {

// 2-D, unit stride along columns, 16-byte aligned rows: what TMA and the vector epilogue need.
void check_matrix(const Tensor& t, const char* name, const Tensor& x) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.device() == x.device(), name, " is on ", t.device(), " but x is on ", x.device(), "; x and ",
                    name, " must be on the same device");
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(1) == 1 || t.size(1) <= 1, name, " must have unit stride along dim 1, got strides ",
                    t.strides());
  TORCH_CHECK_VALUE(t.size(0) <= 1 || (t.stride(0) * t.element_size()) % 16 == 0, name, " row stride ", t.stride(0),
                    " is not a multiple of 16 bytes");
  TORCH_CHECK_VALUE(
      reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
      " data pointer is not 16-byte aligned (address % 16 = ", reinterpret_cast<uintptr_t>(t.data_ptr()) % 16, ")");
}

at::ScalarType scalar_type(DType d) {
  switch (d) {
    case DType::kBF16:
      return at::kBFloat16;
    case DType::kFP16:
      return at::kHalf;
    case DType::kE4M3:
      return at::kFloat8_e4m3fn;
    case DType::kE5M2:
      return at::kFloat8_e5m2;
  }
  return at::kBFloat16;
}

// One scale tensor: fp32, contiguous, on x's device, 4-byte aligned; its mode from its element count.
ScaleMode scale_mode(const Tensor& s, const Tensor& x, int64_t per_row_count, bool row_shape_ok, const char* name,
                     const char* row_shape, const char* op) {
  TORCH_CHECK_VALUE(s.is_cuda() && s.device() == x.device(), op, ": ", name, " must be a CUDA tensor on ", x.device(),
                    " (the device of x), got ", s.device());
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE(s.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", s.strides());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(s.data_ptr()) % 4 == 0, op, ": ", name, " is not 4-byte aligned");
  if (s.numel() == 1 && s.dim() <= 2) return ScaleMode::kPerShard;
  TORCH_CHECK_VALUE(row_shape_ok && s.numel() == per_row_count, op, ": ", name,
                    " must hold one element (tensor-wise) or have shape ", row_shape, " (row-wise), got ", s.sizes());
  return ScaleMode::kPerRow;
}

}  // namespace

Operands check_operands(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, bool weight_nn,
                        bool fast_accum) {
  GemmTypes types;
  types.a = to_dtype(x, "x");
  types.b = to_dtype(w, "weight");
  bool const fp8 = is_fp8(types.a) || is_fp8(types.b);
  types.out = fp8 ? DType::kBF16 : types.a;
  types.accumulation = fast_accum && fp8 ? Accumulation::kFast : Accumulation::kSplit;
  WeightLayout const layout = weight_nn ? WeightLayout::kNN : WeightLayout::kNT;
  if (const char* why = gemm_types_unsupported(types, layout)) {
    TORCH_CHECK_VALUE(false, why, " (x ", x.scalar_type(), ", weight ", w.scalar_type(), ", layout ",
                      weight_nn ? "'nn'" : "'nt'", ")");
  }
  check_matrix(x, "x", x);
  check_matrix(w, "weight", x);
  int64_t const k_w = weight_nn ? w.size(0) : w.size(1);
  int64_t const n = weight_nn ? w.size(1) : w.size(0);
  TORCH_CHECK_VALUE(x.size(1) == k_w, "x ", x.sizes(), " and weight ", w.sizes(), " (", weight_nn ? "nn" : "nt",
                    " layout) disagree on K");
  int64_t const multiple = fp8 ? 16 : 8;  // FP8: as torch._scaled_mm requires
  TORCH_CHECK_VALUE(k_w % multiple == 0 && k_w > 0, "K = ", k_w, " (x's columns) must be a positive multiple of ",
                    multiple);
  TORCH_CHECK_VALUE(n % multiple == 0, "N = ", n, " (the weight's output features) must be a multiple of ", multiple);
  at::ScalarType const out_dtype = scalar_type(types.out);
  if (bias.has_value()) {
    const Tensor& b = *bias;
    TORCH_CHECK_VALUE(b.is_cuda() && b.device() == x.device(), "bias must be a CUDA tensor on ", x.device(),
                      " (the device of x), got ", b.device());
    TORCH_CHECK_VALUE(b.scalar_type() == out_dtype, "bias dtype ", b.scalar_type(), " must be the output dtype ",
                      out_dtype, fp8 ? " (FP8 GEMMs take a bfloat16 bias)" : "");
    TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == n, "bias must have shape [", n,
                      "] (N, the weight's output features), got ", b.sizes());
    TORCH_CHECK_VALUE(b.stride(0) == 1, "bias must be contiguous, got stride ", b.stride(0));
  }
  return {{x.size(0), k_w, n}, types, out_dtype};
}

Scales check_scales(const Operands& ops, const Tensor& x, const std::optional<Tensor>& x_scale,
                    const std::optional<Tensor>& w_scale, int64_t x_rows, const char* op) {
  Scales s;
  if (!is_fp8(ops.types.a)) {
    TORCH_CHECK_VALUE(!x_scale.has_value() && !w_scale.has_value(), op,
                      ": x_scale and w_scale apply to FP8 operands only (x is ", x.scalar_type(), ")");
    return s;
  }
  TORCH_CHECK_VALUE(x_scale.has_value() && w_scale.has_value(), op,
                    ": FP8 operands need x_scale and w_scale (float32 dequantization scales)");
  const Tensor& xs = *x_scale;
  const Tensor& ws = *w_scale;
  bool const x_row_shape = xs.dim() == 2 && xs.size(1) == 1;
  s.x_mode = scale_mode(xs, x, x_rows, x_row_shape, "x_scale", "[rows of x, 1]", op);
  int64_t const n = ops.shape.n;
  bool const w_row_shape = ws.dim() == 2 && (ws.size(0) == 1 || ws.size(1) == 1);
  s.w_mode = scale_mode(ws, x, n, w_row_shape, "w_scale", "[1, N] or [N, 1]", op);
  s.x = xs.data_ptr<float>();
  s.w = ws.data_ptr<float>();
  return s;
}

void check_out(const Tensor& out, const Tensor& x, at::ScalarType dtype, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK_VALUE(out.is_cuda() && out.device() == x.device() && out.scalar_type() == dtype, name, " must be a ",
                    dtype, " tensor on ", x.device(), ", got ", out.scalar_type(), " on ", out.device());
  TORCH_CHECK_VALUE(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && out.size(1) == cols, name,
                    " must be contiguous [", rows, ", ", cols, "], got ", out.sizes());
}

}  // namespace flux::bindings
