// The fused ops' implementations (csrc/bindings/ops.cpp): registered as torch ops there, and called directly from
// Python by csrc/bindings/fastcall.cpp. Both check every argument and take the epoch only once the call is accepted.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <tuple>

namespace flux::bindings {

// The two failures of a fused call that Python tells apart by type. Each path raises them once as its Python type:
// the direct calls (fastcall.cpp) as flux_layers.runtime.workspace.WorkspaceError and NoGraphTwin; torch, for a
// registered op, as torch.distributed.DistError (flux_layers/ops/_opcalls.py turns it into WorkspaceError) and
// RuntimeError.
//
// The workspace cannot be used any more: a wait timed out, the ranks' calls went out of step, or it was released.
class WorkspaceFailed : public c10::DistError {
 public:
  using c10::DistError::DistError;
};

// A call made while its stream is being captured into a CUDA graph, on a workspace without a CUDA-graph twin.
class NoGraphTwin : public c10::Error {
 public:
  using c10::Error::Error;
};

// (out [M, N], gathered [M, K] or the workspace's [0, K] tensor); M = tp * x_shard_m's rows.
std::tuple<at::Tensor, at::Tensor> ag_gemm(const at::Tensor& x_shard_m, const at::Tensor& w,
                                           const std::optional<at::Tensor>& bias, int64_t workspace_handle,
                                           int64_t plan_index, bool weight_nn, bool return_gathered, bool run_gemm);

// This rank's rows [M / tp, N] of the reduce-scattered x @ op(w) + bias.
at::Tensor gemm_rs(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                   int64_t workspace_handle, int64_t plan_index, bool weight_nn);

// The same with FP8 operands (x_scale, w_scale: csrc/bindings/operands.h check_scales; out bf16): (out, gathered
// FP8 rows [M, K] or [0, K], their scales [tp] (x_scale one element: one per source rank) or [M, 1], or empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor> ag_gemm_fp8(const at::Tensor& x_shard_m, const at::Tensor& w,
                                                           const std::optional<at::Tensor>& bias,
                                                           const std::optional<at::Tensor>& x_scale,
                                                           const std::optional<at::Tensor>& w_scale,
                                                           int64_t workspace_handle, int64_t plan_index, bool weight_nn,
                                                           bool return_gathered, bool run_gemm);
at::Tensor gemm_rs_fp8(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& x_scale, const std::optional<at::Tensor>& w_scale,
                       int64_t workspace_handle, int64_t plan_index, bool weight_nn);

// Throws the typed failure named `which` ("workspace_failed", "no_graph_twin"): the CPU tests check both paths'
// translation with it (tests/cpu/test_native_seam.py).
void typed_error_probe(std::string which);

}  // namespace flux::bindings
