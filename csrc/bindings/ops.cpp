// torch binding of the op library: the workspace object (a torch custom class around flux::WorkspaceState),
// tensor checks, then the torch-free launchers of csrc/runtime and csrc/kernels. Registered with TORCH_LIBRARY (no
// Python C API here; fastcall.cpp calls the fused ops from Python through the stable ABI). Bad arguments raise
// ValueError (TORCH_CHECK_VALUE); CUDA failures raise RuntimeError; a workspace that timed out or has no CUDA-graph
// twin raises RuntimeError tagged kWorkspaceErrorTag, which flux_layers/runtime/workspace.py turns into WorkspaceError.
// Everything a call checks is checked before its epoch advances, so a rejected call leaves the ranks in step.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "flux/check.h"
#include "flux/fused_ops.h"
#include "flux/gemm_dispatch.h"
#include "flux/workspace_state.h"
#include "fused_calls.h"
#include "operands.h"

namespace {

using at::Tensor;

constexpr const char* kWorkspaceErrorTag = "[flux_layers.WorkspaceError] ";

using flux::bindings::check_operands;
using flux::bindings::check_out;
using flux::bindings::to_dtype;

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

// For checks of arguments made in the torch-free layer: flux::Error -> ValueError.
template <class Fn>
void translate_value_errors(Fn&& fn) {
  try {
    fn();
  } catch (const flux::Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// The persistent grid's options of one launch. stream_k_fill > 0: split a last wave that keeps at most that
// percentage of the clusters busy (the stream-K tail), using `scratch` for the tail's partials: allocated here if
// undefined, from the caching allocator on the current stream, and kept by the caller for as long as it wants it
// (a plain GEMM: the launch; a workspace: its lifetime, as its calls are ordered on the GPU).
flux::LaunchOptions launch_options(const Tensor& like, int sms, int sm_count, int swizzle, int stream_k_fill,
                                   Tensor& scratch) {
  flux::LaunchOptions o;
  o.sm_count = sm_count;
  o.swizzle_m = swizzle;
  o.split_max_fill_pct = stream_k_fill;
  if (stream_k_fill > 0) {
    if (!scratch.defined()) scratch = at::empty({flux::split_workspace_bytes(sms)}, like.options().dtype(at::kByte));
    o.split_workspace = scratch.data_ptr();
    o.split_workspace_bytes = scratch.numel();
  }
  return o;
}

// out = (x @ op(w)) * scales + bias on the persistent GEMM, no communication. FP8 operands take x_scale and w_scale
// (operands.h check_scales) and write bfloat16; fast_accum selects FP8 fast accumulation.
void gemm(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const std::optional<Tensor>& x_scale,
          const std::optional<Tensor>& w_scale, Tensor out, bool weight_nn, int64_t tile, int64_t sm_count,
          int64_t swizzle, int64_t stream_k_fill, bool fast_accum) {
  auto ops = check_operands(x, w, bias, weight_nn, fast_accum);
  auto const& s = ops.shape;
  auto scales = flux::bindings::check_scales(ops, x, x_scale, w_scale, s.m, "gemm");
  check_out(out, x, ops.out_dtype, s.m, s.n, "out");
  flux::WeightLayout const layout = weight_nn ? flux::WeightLayout::kNN : flux::WeightLayout::kNT;
  TORCH_CHECK_VALUE(flux::gemm_instance_exists(ops.types, layout, to_tile(tile)), "gemm: tile configuration ", tile,
                    " has no instance for ", flux::bindings::dtype_name(ops.types.a), " x ",
                    flux::bindings::dtype_name(ops.types.b),
                    flux::is_fp8(ops.types.a) ? (ops.types.accumulation == flux::Accumulation::kFast
                                                     ? " with fast accumulation (e4m3 x e4m3: 0, 1, 2; with e5m2: 1)"
                                                     : " with split accumulation (2: 128 x 128 tiles)")
                                              : " (0: 256 x 128, 1: 128 x 256)");
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
  p.a_scale_mode = scales.x_mode;
  p.a_scale = scales.x;
  p.b_scale_mode = scales.w_mode;
  p.b_scale = scales.w;
  TORCH_CHECK_VALUE(sm_count >= 0, "sm_count ", sm_count, " must be >= 0 (0: all SMs)");
  TORCH_CHECK_VALUE(swizzle >= 0 && swizzle <= 64, "swizzle ", swizzle, " outside [0, 64]");
  TORCH_CHECK_VALUE(stream_k_fill >= 0 && stream_k_fill <= 100, "stream_k_fill ", stream_k_fill,
                    " outside [0, 100] (0: no stream-K tail)");
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index()));
  Tensor scratch;
  p.launch = launch_options(x, sms, int(sm_count), int(swizzle), int(stream_k_fill), scratch);
  translate_errors([&] { flux::launch_gemm(p, ops.types, layout, to_tile(tile), c10::cuda::getCurrentCUDAStream()); });
}

// ---------------------------------------------------------------- the workspace object
// One per fused-op workspace (flux_layers/runtime/workspace.py makes it once, after the symmetric allocation):
// flux::WorkspaceState plus its CUDA-graph twin, the workspace whose state calls captured into a graph use.
// The ops take it by handle, an integer: passing the object itself from Python costs several times more than the
// rest of the op's argument parsing (torch converts a script object argument by its class type on every call).
struct Workspace;

class Registry {
 public:
  int64_t add(Workspace* w) {
    std::lock_guard<std::mutex> lock(mu_);
    by_handle_[next_] = w;
    return next_++;
  }
  void remove(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    by_handle_.erase(handle);
  }
  Workspace& find(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_handle_.find(handle);
    TORCH_CHECK_VALUE(it != by_handle_.end(), "no live flux_layers workspace has handle ", handle,
                      " (a workspace lives as long as its Python object)");
    return *it->second;
  }

 private:
  std::mutex mu_;
  std::unordered_map<int64_t, Workspace*> by_handle_;
  int64_t next_ = 1;
};

Registry& registry() {
  static Registry r;
  return r;
}

struct Workspace : torch::CustomClassHolder {
  // The memory the state's pointers name (symmetric storage, error record and claim, staging area), kept alive
  // here so that it outlives the state: members are destroyed in reverse order, and the state's destructor waits
  // for a release the watchdog may still have in flight on it (from Python the storage could go first).
  std::vector<Tensor> memory;
  std::unique_ptr<flux::WorkspaceState> state;
  c10::intrusive_ptr<Workspace> twin;
  int64_t handle_ = 0;
  // The stream-K tail's scratch, allocated at the first call that splits and kept: a workspace's calls are
  // ordered on the GPU (their flags require it), so one scratch serves them all.
  Tensor split_scratch;

  Workspace(int64_t kind, int64_t dtype, int64_t rank, int64_t device, int64_t max_m, int64_t inner, int64_t capacity,
            std::vector<int64_t> data_ptrs, std::vector<int64_t> flag_ptrs, std::vector<int64_t> comm_streams,
            std::vector<int64_t> error_ptrs, bool graph_protocol, double timeout_s, bool poison_outputs,
            std::string what) {
    TORCH_CHECK_VALUE(kind == 0 || kind == 1, "workspace kind ", kind, " is not 0 (all-gather) or 1 (reduce-scatter)");
    TORCH_CHECK_VALUE(dtype == 0 || dtype == 1, "workspace dtype ", dtype, " is not 0 (bf16) or 1 (fp16)");
    TORCH_CHECK_VALUE(error_ptrs.size() == 2, "error_ptrs holds {record, claim}, got ", error_ptrs.size());
    TORCH_CHECK_VALUE(timeout_s > 0, "timeout_s must be positive, got ", timeout_s);
    flux::WorkspaceConfig c;
    c.kind = static_cast<flux::WorkspaceKind>(kind);
    c.dtype = static_cast<flux::DType>(dtype);
    c.rank = int(rank);
    c.tp = int(data_ptrs.size());
    c.device = int(device);
    c.max_m = max_m;
    c.inner = inner;
    c.capacity = int(capacity);
    for (int64_t p : data_ptrs) c.data.push_back(reinterpret_cast<char*>(p));
    for (int64_t p : flag_ptrs) c.flags.push_back(reinterpret_cast<uint32_t*>(p));
    // Null peer pointers: a workspace in local memory (the NCCL transport moves its chunks).
    for (size_t q = 0; q < data_ptrs.size(); ++q)
      if (data_ptrs[q] == 0 || (q < flag_ptrs.size() && flag_ptrs[q] == 0)) c.peer_mapped = false;
    for (int64_t p : comm_streams) c.comm.push_back(reinterpret_cast<cudaStream_t>(p));
    c.error_record = reinterpret_cast<int*>(error_ptrs[0]);
    c.error_claim = reinterpret_cast<int*>(error_ptrs[1]);
    c.graph_protocol = graph_protocol;
    c.timeout_ns = uint64_t(timeout_s * 1e9);
    c.poison_outputs = poison_outputs;
    c.what = std::move(what);
    c10::cuda::CUDAGuard guard(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(device)));
    translate_errors([&] { state = std::make_unique<flux::WorkspaceState>(std::move(c)); });
    handle_ = registry().add(this);
  }
  ~Workspace() override { registry().remove(handle_); }

  int64_t handle() const { return handle_; }

  // group_order: the all-gather GEMM's shard order where the caller's transfers fix it (external mode), else empty.
  int64_t add_plan(int64_t tile, int64_t swizzle, int64_t stream_k_fill, int64_t sm_count, int64_t mode, int64_t order,
                   int64_t rows_per_chunk, bool copy_engine, int64_t chunk_cols, std::vector<int64_t> group_order) {
    TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, "mode must be 0 (pull), 1 (push) or 2 (external), got ", mode);
    TORCH_CHECK_VALUE(group_order.empty() || int64_t(group_order.size()) == state->config().tp, "group_order names ",
                      group_order.size(), " shards for a group of ", state->config().tp);
    TORCH_CHECK_VALUE(order == 0 || order == 1, "order must be 0 (mesh) or 1 (ring), got ", order);
    flux::CallPlan p;
    p.tile = to_tile(tile);
    p.swizzle = int(swizzle);
    p.stream_k_fill = int(stream_k_fill);
    p.sm_count = int(sm_count);
    p.mode = static_cast<flux::AgMode>(mode);
    p.order = static_cast<flux::AgOrder>(order);
    p.rows_per_chunk = int(rows_per_chunk);
    p.copy_engine = copy_engine;
    p.chunk_cols = int(chunk_cols);
    p.custom_group_order = !group_order.empty();
    for (size_t i = 0; i < group_order.size(); ++i) p.group_order[i] = int(group_order[i]);
    int64_t index = 0;
    translate_value_errors([&] { index = state->add_plan(p); });
    return index;
  }

  void set_twin(c10::intrusive_ptr<Workspace> t) {
    TORCH_CHECK_VALUE(t->state->config().graph_protocol, "a CUDA-graph twin must use the CUDA-graph flag protocol");
    twin = std::move(t);
  }
  void set_stage(int64_t ptr) { state->set_stage(reinterpret_cast<char*>(ptr)); }
  void keep_memory(std::vector<Tensor> tensors) {
    for (Tensor& t : tensors) memory.push_back(std::move(t));
  }
  void set_timeout(double timeout_s) {
    TORCH_CHECK_VALUE(timeout_s > 0, "timeout_s must be positive, got ", timeout_s);
    state->set_timeout_ns(uint64_t(timeout_s * 1e9));
  }
  std::string failure() const { return state->failure(); }
  void mark_failed(std::string message) { state->mark_failed(message); }
  int64_t epoch() const { return state->epoch(); }

  // ag_gemm's second output where the gathered input is not asked for: one [0, K] tensor, made once.
  const Tensor& no_gathered(const Tensor& like) {
    if (!empty_gathered.defined()) empty_gathered = at::empty({0, state->config().inner}, like.options());
    return empty_gathered;
  }
  Tensor empty_gathered;

  // The workspace a call on `stream` uses: its CUDA-graph twin while the stream is being captured.
  Workspace& for_stream(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone || state->config().graph_protocol) return *this;
    TORCH_CHECK(twin, state->config().what, " (max_m=", state->config().max_m,
                ") has no CUDA-graph twin: a fused operator's workspace (symmetric memory, a collective) cannot "
                "be created while a CUDA graph is being captured; run the captured step once eagerly first "
                "(warm-up) with CUDA graphs enabled (FLUX_LAYERS_CUDA_GRAPHS=1 or "
                "flux_layers.runtime.workspace.enable_cuda_graphs())");
    return *twin;
  }
};

// Before anything of a call is enqueued or any epoch advanced: the workspace is usable and matches the call. An
// eager call also reports a timeout its CUDA-graph twin recorded in a replay (replays run no host code).
void check_usable(const Workspace& runs, flux::WorkspaceKind kind, const Tensor& x, const char* op) {
  flux::WorkspaceState const& st = *runs.state;
  std::string failed = st.failure();
  if (failed.empty() && runs.twin) failed = runs.twin->state->failure();
  TORCH_CHECK(failed.empty(), kWorkspaceErrorTag, failed);
  auto const& c = st.config();
  TORCH_CHECK_VALUE(c.kind == kind, op, ": the workspace belongs to ", c.what);
  TORCH_CHECK_VALUE(x.device().index() == c.device, op, ": x is on ", x.device(), ", the workspace on cuda:", c.device);
  TORCH_CHECK_VALUE(!flux::is_fp8(to_dtype(x, "x")), op, ": FP8 operands are not supported by this op");
  TORCH_CHECK_VALUE(to_dtype(x, "x") == c.dtype, op, ": x dtype ", x.scalar_type(), " differs from the workspace's ",
                    c.dtype == flux::DType::kBF16 ? "bfloat16" : "float16");
}

// The start of a fused call, before anything is enqueued: the workspace (its CUDA-graph twin while the stream is
// captured), checked usable for this op and this x, and the call's plan (registered with the workspace; the twin
// runs the same plans). The caller has made x's device current.
struct CallStart {
  Workspace& runs;
  flux::CallPlan plan;
  cudaStream_t stream;
};

CallStart start_call(int64_t workspace_handle, int64_t plan_index, flux::WorkspaceKind kind, const Tensor& x,
                     const char* op) {
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream();
  Workspace& workspace = registry().find(workspace_handle);
  flux::CallPlan plan;
  translate_value_errors([&] { plan = workspace.state->plan(plan_index); });
  Workspace& runs = workspace.for_stream(stream);
  check_usable(runs, kind, x, op);
  return {runs, plan, stream};
}

// Enqueues a checked call: its epoch is taken only now (nothing rejects the call any more), and the watchdog
// watches it unless it is being captured (a CUDA-graph twin: replays run no host code to watch them).
template <class Args>
void enqueue(flux::WorkspaceState& st, Args& a, void (*launch)(const Args&)) {
  a.epoch = st.next_epoch();
  bool const watched = !st.config().graph_protocol;
  a.completion = watched ? st.completion_ring() : nullptr;
  translate_errors([&] {
    launch(a);
    if (watched) st.watch_call(a.epoch);
  });
}

}  // namespace

// The fused ops (declared in fused_calls.h): the registered ops below, and the direct calls from Python
// (fastcall.cpp).
namespace flux::bindings {

std::tuple<Tensor, Tensor> ag_gemm(const Tensor& x_shard_m, const Tensor& w, const std::optional<Tensor>& bias,
                                   int64_t workspace_handle, int64_t plan_index, bool weight_nn, bool return_gathered,
                                   bool run_gemm) {
  auto s = check_operands(x_shard_m, w, bias, weight_nn, false).shape;
  c10::cuda::CUDAGuard guard(x_shard_m.device());
  CallStart call = start_call(workspace_handle, plan_index, flux::WorkspaceKind::kAllGather, x_shard_m, "ag_gemm");
  Workspace& runs = call.runs;
  flux::WorkspaceState& st = *runs.state;
  flux::CallPlan const& plan = call.plan;
  auto const& c = st.config();
  int64_t const m = c.tp * s.m;
  TORCH_CHECK_VALUE(m <= c.max_m && s.k == c.inner, "ag_gemm: call needs M=", m, ", K=", s.k,
                    "; the workspace holds max_m=", c.max_m, ", K=", c.inner);
  int64_t const chunks = (s.m + plan.rows_per_chunk - 1) / plan.rows_per_chunk;
  TORCH_CHECK_VALUE(chunks <= c.capacity, "ag_gemm: ", s.m, " rows per shard in chunks of ", plan.rows_per_chunk,
                    " rows need ", chunks, " chunk flags, the workspace holds ", c.capacity);
  TORCH_CHECK_VALUE(!(return_gathered && plan.mode == flux::AgMode::kExternal),
                    "ag_gemm: with external transfers the caller copies the gathered input out");
  Tensor out = at::empty({m, s.n}, x_shard_m.options());
  Tensor gathered = return_gathered ? at::empty({m, s.k}, x_shard_m.options()) : runs.no_gathered(x_shard_m);
  if (c.poison_outputs) {
    out.fill_(std::numeric_limits<float>::quiet_NaN());
    if (return_gathered) gathered.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  if (s.m == 0) return {out, gathered};  // a no-op on every rank: no epoch, no flags

  flux::AgGemmArgs a;
  a.x = x_shard_m.data_ptr();
  a.ldx = x_shard_m.stride(0);
  a.w = w.data_ptr();
  a.ldw = w.stride(0);
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.gathered_out = return_gathered ? gathered.data_ptr() : nullptr;
  a.dtype = c.dtype;
  a.layout = weight_nn ? flux::WeightLayout::kNN : flux::WeightLayout::kNT;
  a.tile = plan.tile;
  a.rows_per_group = int(s.m);
  a.n = int(s.n);
  a.k = int(s.k);
  a.rank = c.rank;
  a.tp = c.tp;
  for (int q = 0; q < c.tp; ++q) {
    a.buffers[q] = c.data[q];
    a.flags[q] = c.flags[q];
  }
  a.chunk_capacity = c.capacity;
  a.rows_per_chunk = plan.rows_per_chunk;
  a.mode = plan.mode;
  a.order = plan.order;
  a.custom_group_order = plan.custom_group_order;
  for (int i = 0; i < c.tp; ++i) a.group_order[i] = plan.group_order[size_t(i)];
  a.protocol = c.graph_protocol ? flux::FlagProtocol::kCudaGraph : flux::FlagProtocol::kEpoch;
  a.timeout_ns = c.timeout_ns;
  a.error_record = c.error_record;
  a.error_claim = c.error_claim;
  a.compute = call.stream;
  a.num_comm = int(c.comm.size());
  for (size_t i = 0; i < c.comm.size(); ++i) a.comm[i] = c.comm[i];
  a.events = st.events();
  a.run_gemm = run_gemm;
  a.launch = launch_options(x_shard_m, st.sm_count(), plan.sm_count, plan.swizzle, run_gemm ? plan.stream_k_fill : 0,
                            runs.split_scratch);
  enqueue(st, a, flux::ag_gemm);
  return {out, gathered};
}

Tensor gemm_rs(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, int64_t workspace_handle,
               int64_t plan_index, bool weight_nn) {
  auto s = check_operands(x, w, bias, weight_nn, false).shape;
  c10::cuda::CUDAGuard guard(x.device());
  CallStart call = start_call(workspace_handle, plan_index, flux::WorkspaceKind::kReduceScatter, x, "gemm_rs");
  Workspace& runs = call.runs;
  flux::WorkspaceState& st = *runs.state;
  flux::CallPlan const& plan = call.plan;
  auto const& c = st.config();
  TORCH_CHECK_VALUE(s.m % c.tp == 0, "gemm_rs: M=", s.m, " rows are not divisible by the group size ", c.tp);
  TORCH_CHECK_VALUE(s.m <= c.max_m && s.n == c.inner, "gemm_rs: call needs M=", s.m, ", N=", s.n,
                    "; the workspace holds max_m=", c.max_m, ", N=", c.inner);
  bool const external = plan.mode == flux::AgMode::kExternal;
  TORCH_CHECK_VALUE(!(plan.copy_engine || external) || st.stage() != nullptr,
                    "gemm_rs: the copy-engine and external transports need the workspace's staging area");
  int64_t const rows = s.m / c.tp;
  Tensor out = at::empty({rows, s.n}, x.options());
  if (c.poison_outputs) out.fill_(std::numeric_limits<float>::quiet_NaN());
  if (rows == 0) return out;  // a no-op on every rank: no epoch, no flags

  flux::GemmRsArgs a;
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  a.w = w.data_ptr();
  a.ldw = w.stride(0);
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.dtype = c.dtype;
  a.layout = weight_nn ? flux::WeightLayout::kNN : flux::WeightLayout::kNT;
  a.tile = plan.tile;
  a.rows_per_group = int(rows);
  a.n = int(s.n);
  a.k = int(s.k);
  a.rank = c.rank;
  a.tp = c.tp;
  for (int q = 0; q < c.tp; ++q) {
    a.recv[q] = c.data[q];
    a.flags[q] = c.flags[q];
  }
  a.slot_rows = c.max_m / c.tp;
  a.flags_per_source = c.capacity;
  a.stage = plan.copy_engine || external ? st.stage() : nullptr;
  a.chunk_cols = plan.chunk_cols;
  a.external = external;
  a.num_comm = int(c.comm.size());
  for (size_t i = 0; i < c.comm.size(); ++i) a.comm[i] = c.comm[i];
  a.events = st.events();
  a.protocol = c.graph_protocol ? flux::FlagProtocol::kCudaGraph : flux::FlagProtocol::kEpoch;
  a.timeout_ns = c.timeout_ns;
  a.error_record = c.error_record;
  a.error_claim = c.error_claim;
  a.compute = call.stream;
  a.launch = launch_options(x, st.sm_count(), plan.sm_count, plan.swizzle, plan.stream_k_fill, runs.split_scratch);
  enqueue(st, a, flux::gemm_rs);
  return out;
}

}  // namespace flux::bindings

namespace {

// The word flags[index] of a checked flag operation (write_flag, wait_flag), with `value` a valid 32-bit flag.
uint32_t* flag_word(const Tensor& flags, int64_t index, int64_t value, const char* op) {
  TORCH_CHECK_VALUE(flags.is_cuda() && flags.scalar_type() == at::kInt && flags.dim() == 1 && flags.is_contiguous(), op,
                    ": flags must be a contiguous 1-D int32 CUDA tensor, got ", flags.scalar_type(), " ", flags.sizes(),
                    " on ", flags.device());
  TORCH_CHECK_VALUE(index >= 0 && index < flags.numel(), op, ": index ", index, " outside [0, ", flags.numel(), ")");
  TORCH_CHECK_VALUE(value >= 0 && value <= std::numeric_limits<int32_t>::max(), op, ": value ", value,
                    " outside [0, 2^31)");
  return reinterpret_cast<uint32_t*>(flags.data_ptr<int32_t>()) + index;
}

// flags[index] = value on the current stream, once the work queued before it has run (cuStreamWriteValue32: no
// kernel, no SM). The NCCL transport announces each received chunk to the GEMM this way.
void write_flag(Tensor flags, int64_t index, int64_t value) {
  uint32_t* const word = flag_word(flags, index, value, "write_flag");
  c10::cuda::CUDAGuard guard(flags.device());
  translate_errors([&] { flux::stream_write_u32(c10::cuda::getCurrentCUDAStream(), word, uint32_t(value)); });
}

// Holds the current stream until flags[index] >= value (cuStreamWaitValue32: no kernel, no SM). The NCCL transport
// of the reduce-scatter waits for a chunk's count this way before it sends the chunk. Unbounded on the stream: the
// workspace's watchdog releases it (it sets the flags to their maximum) when the call hangs.
void wait_flag(Tensor flags, int64_t index, int64_t value) {
  uint32_t* const word = flag_word(flags, index, value, "wait_flag");
  c10::cuda::CUDAGuard guard(flags.device());
  translate_errors([&] { flux::stream_wait_u32_geq(c10::cuda::getCurrentCUDAStream(), word, uint32_t(value)); });
}

// The fused ops' signature with nothing behind it: benchmarks/bench_overhead.py times it to separate the cost of
// calling an op from Python (argument parsing, dispatch) from the op's own host work.
void call_overhead_probe(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t, int64_t, bool, bool,
                         bool) {}

}  // namespace

TORCH_LIBRARY(flux_layers, m) {
  m.class_<Workspace>("Workspace")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, bool, double, bool,
                       std::string>())
      .def("add_plan", &Workspace::add_plan)
      .def("set_twin", &Workspace::set_twin)
      .def("set_stage", &Workspace::set_stage)
      .def("keep_memory", &Workspace::keep_memory)
      .def("set_timeout", &Workspace::set_timeout)
      .def("failure", &Workspace::failure)
      .def("mark_failed", &Workspace::mark_failed)
      .def("epoch", &Workspace::epoch)
      .def("handle", &Workspace::handle);
  m.def(
      "gemm(Tensor x, Tensor weight, Tensor? bias, Tensor? x_scale, Tensor? w_scale, Tensor(a!) out, bool weight_nn, "
      "int tile, int sm_count, int swizzle, int stream_k_fill, bool fast_accum) -> ()");
  m.def(
      "ag_gemm(Tensor x_shard_m, Tensor weight, Tensor? bias, int workspace, int plan, bool weight_nn, "
      "bool return_gathered, bool run_gemm) -> (Tensor, Tensor)");
  m.def("gemm_rs(Tensor x, Tensor weight, Tensor? bias, int workspace, int plan, bool weight_nn) -> Tensor");
  m.def("write_flag(Tensor(a!) flags, int index, int value) -> ()");
  m.def("wait_flag(Tensor flags, int index, int value) -> ()");
  m.def(
      "call_overhead_probe(Tensor x, Tensor weight, Tensor? bias, int workspace, int plan, bool weight_nn, "
      "bool return_gathered, bool run_gemm) -> ()");
}

TORCH_LIBRARY_IMPL(flux_layers, CUDA, m) {
  m.impl("gemm", &gemm);
  m.impl("ag_gemm", &flux::bindings::ag_gemm);
  m.impl("gemm_rs", &flux::bindings::gemm_rs);
  m.impl("write_flag", &write_flag);
  m.impl("wait_flag", &wait_flag);
  m.impl("call_overhead_probe", &call_overhead_probe);
}
