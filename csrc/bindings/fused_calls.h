// The fused ops' implementations (csrc/bindings/ops.cpp): registered as torch ops there, and called directly from
// Python by csrc/bindings/fastcall.cpp. Both check every argument and take the epoch only once the call is accepted.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace flux::bindings {

// (out [M, N], gathered [M, K] or the workspace's [0, K] tensor); M = tp * x_shard_m's rows.
std::tuple<at::Tensor, at::Tensor> ag_gemm(const at::Tensor& x_shard_m, const at::Tensor& w,
                                           const std::optional<at::Tensor>& bias, int64_t workspace_handle,
                                           int64_t plan_index, bool weight_nn, bool return_gathered, bool run_gemm);

// This rank's rows [M / tp, N] of the reduce-scattered x @ op(w) + bias.
at::Tensor gemm_rs(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                   int64_t workspace_handle, int64_t plan_index, bool weight_nn);

}  // namespace flux::bindings
