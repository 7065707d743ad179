// torch binding of the op library: tensor checks, then the torch-free launchers of csrc/runtime and
// csrc/kernels. Registered with TORCH_LIBRARY (no Python C API), so one build loads under any Python version
// of the same torch. Bad arguments raise ValueError (TORCH_CHECK_VALUE); CUDA failures raise RuntimeError.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>

#include "flux/check.h"
#include "flux/fused_ops.h"
#include "flux/gemm_dispatch.h"

namespace {

using at::Tensor;

flux::DType to_dtype(const Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return flux::DType::kBF16;
  if (t.scalar_type() == at::kHalf) return flux::DType::kFP16;
  TORCH_CHECK_VALUE(false, name, " must be bfloat16 or float16, got ", t.scalar_type());
}

// 2-D, unit stride along columns, 16-byte aligned rows: what TMA and the vector epilogue need.
void check_matrix(const Tensor& t, const char* name, const Tensor& like) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " is on ", t.device(), " but x is on ", like.device());
  TORCH_CHECK_VALUE(t.scalar_type() == like.scalar_type(), name, " dtype ", t.scalar_type(), " != x dtype ",
                    like.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(1) == 1 || t.size(1) <= 1, name, " must have unit stride along dim 1, got strides ",
                    t.strides());
  TORCH_CHECK_VALUE(t.size(0) <= 1 || (t.stride(0) * t.element_size()) % 16 == 0, name, " row stride ",
                    t.stride(0), " is not a multiple of 16 bytes");
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                    " data pointer is not 16-byte aligned");
}

struct MatmulShape {
  int64_t m, k, n;
};

MatmulShape check_operands(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, bool weight_nn) {
  to_dtype(x, "x");
  check_matrix(x, "x", x);
  check_matrix(w, "weight", x);
  int64_t k_w = weight_nn ? w.size(0) : w.size(1);
  int64_t n = weight_nn ? w.size(1) : w.size(0);
  TORCH_CHECK_VALUE(x.size(1) == k_w, "x ", x.sizes(), " and weight ", w.sizes(), " (", weight_nn ? "nn" : "nt",
                    " layout) disagree on K");
  TORCH_CHECK_VALUE(k_w % 8 == 0 && k_w > 0, "K = ", k_w, " must be a positive multiple of 8");
  TORCH_CHECK_VALUE(n % 8 == 0, "N = ", n, " must be a multiple of 8");
  if (bias.has_value()) {
    const Tensor& b = *bias;
    TORCH_CHECK_VALUE(b.is_cuda() && b.device() == x.device(), "bias must be on ", x.device());
    TORCH_CHECK_VALUE(b.scalar_type() == x.scalar_type(), "bias dtype ", b.scalar_type(), " != ", x.scalar_type());
    TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == n && b.stride(0) == 1, "bias must be contiguous [", n, "], got ",
                      b.sizes());
  }
  return {x.size(0), k_w, n};
}

flux::TileConfig to_tile(int64_t tile) {
  TORCH_CHECK_VALUE(tile >= 0 && tile < flux::kNumTileConfigs, "tile config ", tile, " outside [0, ",
                    flux::kNumTileConfigs, ")");
  return static_cast<flux::TileConfig>(tile);
}

template <class Fn>
void translate_errors(Fn&& fn) {
  try {
    fn();
  } catch (const flux::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

void check_out(const Tensor& out, const Tensor& x, int64_t rows, int64_t cols, const char* name);

// The persistent grid's options of one launch. stream_k_fill > 0: split a last wave that keeps at most that
// percentage of the clusters busy (the stream-K tail); `scratch` then receives the tail's workspace,
// from the caching allocator on the current stream (so launches on different streams never share it); it must
// outlive the launch call.
flux::LaunchOptions launch_options(const Tensor& like, int64_t sm_count, int64_t swizzle, int64_t stream_k_fill,
                                   Tensor& scratch) {
  TORCH_CHECK_VALUE(sm_count >= 0, "sm_count ", sm_count, " must be >= 0 (0: all SMs)");
  TORCH_CHECK_VALUE(swizzle >= 0 && swizzle <= 64, "swizzle ", swizzle, " outside [0, 64]");
  TORCH_CHECK_VALUE(stream_k_fill >= 0 && stream_k_fill <= 100, "stream_k_fill ", stream_k_fill,
                    " outside [0, 100] (0: no stream-K tail)");
  flux::LaunchOptions o;
  o.sm_count = int(sm_count);
  o.swizzle_m = int(swizzle);
  o.split_max_fill_pct = int(stream_k_fill);
  if (stream_k_fill > 0) {
    int sms = 0;
    FLUX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, like.device().index()));
    scratch = at::empty({flux::split_workspace_bytes(sms)}, like.options().dtype(at::kByte));
    o.split_workspace = scratch.data_ptr();
    o.split_workspace_bytes = scratch.numel();
  }
  return o;
}

void gemm(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, Tensor out, bool weight_nn,
          int64_t tile, int64_t sm_count, int64_t swizzle, int64_t stream_k_fill) {
  auto s = check_operands(x, w, bias, weight_nn);
  check_out(out, x, s.m, s.n, "out");
  c10::cuda::CUDAGuard guard(x.device());
  if (s.m == 0 || s.n == 0) return;
  flux::GemmProblem p;
  p.rows_per_group = int(s.m);
  p.n = int(s.n);
  p.k = int(s.k);
  p.num_groups = 1;
  p.own_group = 0;
  p.a_own = x.data_ptr();
  p.lda_own = x.stride(0);
  p.b = w.data_ptr();
  p.ldb = w.stride(0);
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.d[0] = out.data_ptr();
  p.ldd = s.n;
  Tensor scratch;
  p.launch = launch_options(x, sm_count, swizzle, stream_k_fill, scratch);
  translate_errors([&] {
    flux::launch_gemm(p, to_dtype(x, "x"), weight_nn ? flux::WeightLayout::kNN : flux::WeightLayout::kNT,
                      to_tile(tile), c10::cuda::getCurrentCUDAStream());
  });
}

template <class T>
void copy_ptrs(const std::vector<int64_t>& src, T** dst, int64_t expect, const char* name) {
  TORCH_CHECK_VALUE(int64_t(src.size()) == expect, name, " must hold ", expect, " pointers, got ", src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK_VALUE(src[i] != 0, name, "[", i, "] is null");
    dst[i] = reinterpret_cast<T*>(src[i]);
  }
}

void check_out(const Tensor& out, const Tensor& x, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK_VALUE(out.is_cuda() && out.device() == x.device() && out.scalar_type() == x.scalar_type(), name,
                    " must be a ", x.scalar_type(), " tensor on ", x.device());
  TORCH_CHECK_VALUE(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && out.size(1) == cols, name,
                    " must be contiguous [", rows, ", ", cols, "], got ", out.sizes());
}

void ag_gemm(const Tensor& x_shard_m, const Tensor& w, const std::optional<Tensor>& bias, Tensor out,
             std::optional<Tensor> gathered_out, std::vector<int64_t> buffer_ptrs, std::vector<int64_t> flag_ptrs,
             int64_t chunk_capacity, int64_t rows_per_chunk, int64_t rank, int64_t mode, int64_t order,
             int64_t epoch, int64_t timeout_ns, int64_t error_record_ptr, int64_t error_claim_ptr,
             std::vector<int64_t> comm_streams, bool weight_nn, int64_t tile, int64_t sm_count, int64_t swizzle,
             int64_t stream_k_fill, bool run_gemm, bool graph_protocol) {
  auto s = check_operands(x_shard_m, w, bias, weight_nn);
  int64_t tp = int64_t(buffer_ptrs.size());
  TORCH_CHECK_VALUE(tp >= 2 && tp <= flux::kMaxGroups, "group size ", tp, " outside [2, ", flux::kMaxGroups, "]");
  check_out(out, x_shard_m, tp * s.m, s.n, "out");
  if (gathered_out.has_value()) check_out(*gathered_out, x_shard_m, tp * s.m, s.k, "gathered_out");
  TORCH_CHECK_VALUE(!comm_streams.empty() && comm_streams.size() <= size_t(flux::kMaxGroups),
                    "1 to ", flux::kMaxGroups, " communication streams are needed, got ", comm_streams.size());
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, "mode must be 0 (pull) or 1 (push), got ", mode);
  TORCH_CHECK_VALUE(order == 0 || order == 1, "order must be 0 (mesh) or 1 (ring), got ", order);
  c10::cuda::CUDAGuard guard(x_shard_m.device());
  flux::AgGemmArgs a;
  a.x = x_shard_m.data_ptr();
  a.ldx = x_shard_m.stride(0);
  a.w = w.data_ptr();
  a.ldw = w.stride(0);
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.gathered_out = gathered_out.has_value() ? gathered_out->data_ptr() : nullptr;
  a.dtype = to_dtype(x_shard_m, "x");
  a.layout = weight_nn ? flux::WeightLayout::kNN : flux::WeightLayout::kNT;
  a.tile = to_tile(tile);
  a.rows_per_group = int(s.m);
  a.n = int(s.n);
  a.k = int(s.k);
  a.rank = int(rank);
  a.tp = int(tp);
  copy_ptrs(buffer_ptrs, a.buffers, tp, "buffer_ptrs");
  copy_ptrs(flag_ptrs, a.flags, tp, "flag_ptrs");
  a.chunk_capacity = int(chunk_capacity);
  a.rows_per_chunk = int(rows_per_chunk);
  a.mode = static_cast<flux::AgMode>(mode);
  a.order = static_cast<flux::AgOrder>(order);
  a.protocol = graph_protocol ? flux::FlagProtocol::kCudaGraph : flux::FlagProtocol::kEpoch;
  a.epoch = uint32_t(epoch);
  a.timeout_ns = uint64_t(timeout_ns);
  a.error_record = reinterpret_cast<int*>(error_record_ptr);
  a.error_claim = reinterpret_cast<int*>(error_claim_ptr);
  a.compute = c10::cuda::getCurrentCUDAStream();
  a.num_comm = int(comm_streams.size());
  for (size_t i = 0; i < comm_streams.size(); ++i) a.comm[i] = reinterpret_cast<cudaStream_t>(comm_streams[i]);
  a.run_gemm = run_gemm;
  Tensor scratch;
  a.launch = launch_options(x_shard_m, sm_count, swizzle, run_gemm ? stream_k_fill : 0, scratch);
  translate_errors([&] { flux::ag_gemm(a); });
}

void gemm_rs(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, Tensor out,
             std::vector<int64_t> recv_ptrs, int64_t slot_rows, std::vector<int64_t> flag_ptrs,
             int64_t flags_per_source, int64_t rank, int64_t epoch, int64_t timeout_ns, int64_t error_record_ptr,
             int64_t error_claim_ptr, bool weight_nn, int64_t tile, int64_t sm_count, int64_t swizzle,
             int64_t stream_k_fill, int64_t stage_ptr, int64_t chunk_cols, std::vector<int64_t> comm_streams,
             bool graph_protocol) {
  auto s = check_operands(x, w, bias, weight_nn);
  int64_t tp = int64_t(recv_ptrs.size());
  TORCH_CHECK_VALUE(tp >= 2 && tp <= flux::kMaxGroups, "group size ", tp, " outside [2, ", flux::kMaxGroups, "]");
  TORCH_CHECK_VALUE(s.m % tp == 0, "M = ", s.m, " rows are not divisible by the group size ", tp);
  check_out(out, x, s.m / tp, s.n, "out");
  c10::cuda::CUDAGuard guard(x.device());
  flux::GemmRsArgs a;
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  a.w = w.data_ptr();
  a.ldw = w.stride(0);
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.dtype = to_dtype(x, "x");
  a.layout = weight_nn ? flux::WeightLayout::kNN : flux::WeightLayout::kNT;
  a.tile = to_tile(tile);
  a.rows_per_group = int(s.m / tp);
  a.n = int(s.n);
  a.k = int(s.k);
  a.rank = int(rank);
  a.tp = int(tp);
  copy_ptrs(recv_ptrs, a.recv, tp, "recv_ptrs");
  a.slot_rows = slot_rows;
  copy_ptrs(flag_ptrs, a.flags, tp, "flag_ptrs");
  a.flags_per_source = int(flags_per_source);
  a.protocol = graph_protocol ? flux::FlagProtocol::kCudaGraph : flux::FlagProtocol::kEpoch;
  a.epoch = uint32_t(epoch);
  a.timeout_ns = uint64_t(timeout_ns);
  a.error_record = reinterpret_cast<int*>(error_record_ptr);
  a.error_claim = reinterpret_cast<int*>(error_claim_ptr);
  TORCH_CHECK_VALUE(chunk_cols >= 0, "chunk_cols ", chunk_cols, " must be >= 0 (0: default)");
  TORCH_CHECK_VALUE(comm_streams.size() <= size_t(flux::kMaxGroups), "at most ", flux::kMaxGroups,
                    " communication streams, got ", comm_streams.size());
  TORCH_CHECK_VALUE(stage_ptr == 0 || !comm_streams.empty(),
                    "the copy-engine transport needs at least one communication stream");
  a.stage = reinterpret_cast<char*>(stage_ptr);
  a.chunk_cols = int(chunk_cols);
  a.num_comm = int(comm_streams.size());
  for (size_t i = 0; i < comm_streams.size(); ++i) a.comm[i] = reinterpret_cast<cudaStream_t>(comm_streams[i]);
  Tensor scratch;
  a.launch = launch_options(x, sm_count, swizzle, stream_k_fill, scratch);
  a.compute = c10::cuda::getCurrentCUDAStream();
  translate_errors([&] { flux::gemm_rs(a); });
}

}  // namespace

TORCH_LIBRARY(flux_layers, m) {
  m.def("gemm(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, bool weight_nn, int tile, int sm_count, int swizzle, "
        "int stream_k_fill) -> ()");
  m.def(
      "ag_gemm(Tensor x_shard_m, Tensor weight, Tensor? bias, Tensor(a!) out, Tensor(b!)? gathered_out, "
      "int[] buffer_ptrs, int[] flag_ptrs, int chunk_capacity, int rows_per_chunk, int rank, int mode, int order, "
      "int epoch, int timeout_ns, int error_record_ptr, int error_claim_ptr, int[] comm_streams, bool weight_nn, "
      "int tile, int sm_count, int swizzle, int stream_k_fill, bool run_gemm, bool graph_protocol) -> ()");
  m.def(
      "gemm_rs(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, int[] recv_ptrs, int slot_rows, "
      "int[] flag_ptrs, int flags_per_source, int rank, int epoch, int timeout_ns, int error_record_ptr, "
      "int error_claim_ptr, bool weight_nn, int tile, int sm_count, int swizzle, int stream_k_fill, int stage_ptr, "
      "int chunk_cols, int[] comm_streams, bool graph_protocol) -> ()");
}

TORCH_LIBRARY_IMPL(flux_layers, CUDA, m) {
  m.impl("gemm", &gemm);
  m.impl("ag_gemm", &ag_gemm);
  m.impl("gemm_rs", &gemm_rs);
}
