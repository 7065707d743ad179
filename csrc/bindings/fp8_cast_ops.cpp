// torch ops of the FP8 casts (csrc/include/flux/fp8_cast.h): flux_layers/ops/fp8.py calls them for CUDA tensors and
// keeps the same arithmetic in torch ops for the CPU. No host sync: the amax, the scale and the data stay on the
// device, so the casts capture into CUDA graphs (the tensor-wise one-pass kernel as a cooperative kernel node).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "flux/check.h"
#include "flux/fp8_cast.h"
#include "operands.h"

namespace {

using at::Tensor;

template <class Fn>
void value_errors(Fn&& fn) {
  try {
    fn();
  } catch (const flux::Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

flux::DType fp8_dtype(at::ScalarType t) {
  TORCH_CHECK_VALUE(t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2,
                    "quantize_fp8: dtype must be float8_e4m3fn or float8_e5m2, got ", t);
  return t == at::kFloat8_e4m3fn ? flux::DType::kE4M3 : flux::DType::kE5M2;
}

// (data [M, K], scale [1] or [M, 1], data transposed [K, M] or an empty tensor). two_pass: the amax and cast passes
// even where the one-pass kernels apply (the benchmarks' baseline; FLUX_LAYERS_FP8_CAST=two_pass).
std::tuple<Tensor, Tensor, Tensor> quantize_fp8(const Tensor& x, at::ScalarType dtype, bool rowwise,
                                                double margin_factor, bool transposed, bool two_pass) {
  TORCH_CHECK_VALUE(x.is_cuda() && x.dim() == 2, "quantize_fp8: x must be a 2-D CUDA tensor, got ", x.sizes(), " on ",
                    x.device());
  TORCH_CHECK_VALUE(x.stride(1) == 1 || x.size(1) <= 1, "quantize_fp8: x must have unit stride along dim 1");
  TORCH_CHECK_VALUE(!(rowwise && transposed), "quantize_fp8: a transposed copy takes the tensor-wise scale");
  flux::CastInput in;
  in.x = x.data_ptr();
  in.dtype = flux::bindings::to_dtype(x, "x");
  in.rows = x.size(0);
  in.cols = x.size(1);
  in.ld = x.size(0) > 1 ? x.stride(0) : x.size(1);
  flux::DType const out = fp8_dtype(dtype);
  c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream();
  flux::QuantizePlan plan;
  value_errors([&] { plan = flux::plan_quantize_fp8(in, out, rowwise, transposed, two_pass); });
  auto f32 = x.options().dtype(at::kFloat);
  Tensor scratch = at::empty({plan.scratch_floats}, f32);
  Tensor data = at::empty({in.rows, in.cols}, x.options().dtype(dtype));
  Tensor scale = at::empty(rowwise ? at::IntArrayRef{in.rows, 1} : at::IntArrayRef{1}, f32);
  Tensor data_t = at::empty({transposed ? in.cols : 0, transposed ? in.rows : 0}, x.options().dtype(dtype));
  value_errors([&] {
    flux::launch_quantize_fp8(plan, in, rowwise, float(margin_factor), out, data.data_ptr(),
                              transposed ? data_t.data_ptr() : nullptr, scale.data_ptr<float>(),
                              scratch.data_ptr<float>(), stream);
  });
  return {data, scale, data_t};
}

// (data^T [K, M] with one scale [1]) for FP8 data [M, K] whose rows come in block_scale.numel() blocks.
std::tuple<Tensor, Tensor> transpose_fp8_to_common_scale(const Tensor& data, const Tensor& block_scale) {
  TORCH_CHECK_VALUE(data.is_cuda() && data.dim() == 2 && data.is_contiguous(),
                    "transpose_fp8_to_common_scale: data must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK_VALUE(block_scale.is_cuda() && block_scale.scalar_type() == at::kFloat && block_scale.is_contiguous() &&
                        block_scale.numel() >= 1,
                    "transpose_fp8_to_common_scale: block_scale must be a contiguous float32 CUDA tensor");
  flux::DType const dtype = fp8_dtype(data.scalar_type());
  c10::cuda::CUDAGuard guard(data.device());
  Tensor out = at::empty({data.size(1), data.size(0)}, data.options());
  Tensor scale = at::empty({1}, block_scale.options());
  value_errors([&] {
    flux::launch_transpose_to_common_scale(data.data_ptr(), dtype, data.size(0), data.size(1),
                                           block_scale.data_ptr<float>(), int(block_scale.numel()), out.data_ptr(),
                                           scale.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  });
  return {out, scale};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flux_layers, m) {
  m.def(
      "quantize_fp8(Tensor x, ScalarType dtype, bool rowwise, float margin_factor, bool transposed, bool "
      "two_pass=False) -> (Tensor, Tensor, Tensor)");
  m.def("transpose_fp8_to_common_scale(Tensor data, Tensor block_scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flux_layers, CUDA, m) {
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("transpose_fp8_to_common_scale", &transpose_fp8_to_common_scale);
}
