// torch binding of the op library: the native workspace (NativeWorkspace, a torch custom class around
// flux::WorkspaceState), the fused calls' tensor checks and argument marshalling, then the torch-free launchers of
// csrc/runtime and csrc/kernels; and what Python reads of the runtime's layouts and codes (codes,
// ag/rs_workspace_layout, the workspace's flag_index). Registered with TORCH_LIBRARY (no Python C API here;
// fastcall.cpp calls the fused ops from Python through the stable ABI). Bad arguments raise ValueError
// (TORCH_CHECK_VALUE); CUDA failures raise RuntimeError; a workspace that failed raises WorkspaceFailed and a captured
// call without a CUDA-graph twin NoGraphTwin (fused_calls.h), which each path turns into its Python type.
// Everything a call checks is checked before its epoch advances, so a rejected call leaves the ranks in step.
#include <ATen/ATen.h>
#include <ATen/cuda/CachingHostAllocator.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "flux/append_only_table.h"
#include "flux/check.h"
#include "flux/fused_ops.h"
#include "flux/gemm_dispatch.h"
#include "flux/workspace_layout.h"
#include "flux/workspace_state.h"
#include "fused_calls.h"
#include "operands.h"

namespace {

using at::Tensor;

using flux::bindings::check_operands;
using flux::bindings::check_out;
using flux::bindings::MatmulShape;
using flux::bindings::Operands;
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
void use_split_scratch(flux::LaunchOptions& o, const Tensor& like, int sms, Tensor& scratch) {
  if (o.split_max_fill_pct <= 0) return;
  if (!scratch.defined()) scratch = at::empty({flux::split_workspace_bytes(sms)}, like.options().dtype(at::kByte));
  o.split_workspace = scratch.data_ptr();
  o.split_workspace_bytes = scratch.numel();
}

flux::LaunchOptions launch_options(const Tensor& like, int sms, int sm_count, int swizzle, int stream_k_fill,
                                   Tensor& scratch) {
  flux::LaunchOptions o;
  o.sm_count = sm_count;
  o.swizzle_m = swizzle;
  o.split_max_fill_pct = stream_k_fill;
  use_split_scratch(o, like, sms, scratch);
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
  p.rows_per_shard = int(s.m);
  p.n = int(s.n);
  p.k = int(s.k);
  p.num_shards = 1;
  p.own_shard = 0;
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

// ---------------------------------------------------------------- names and layouts Python reads
// The names Python passes for the runtime's codes, and what codes() exports: the one table of both (Python keeps no
// copy of a code; tests/cpu/test_native_seam.py checks that none comes back).
struct NamedCode {
  const char* kind;
  const char* name;
  int code;
};
constexpr NamedCode kNamedCodes[] = {
    {"dtype", "bfloat16", int(flux::DType::kBF16)},
    {"dtype", "float16", int(flux::DType::kFP16)},
    {"dtype", "float8_e4m3fn", int(flux::DType::kE4M3)},
    {"dtype", "float8_e5m2", int(flux::DType::kE5M2)},
    {"workspace_kind", "ag_gemm", int(flux::WorkspaceKind::kAllGather)},
    {"workspace_kind", "gemm_rs", int(flux::WorkspaceKind::kReduceScatter)},
    {"ag_mode", "pull", int(flux::AgMode::kPull)},
    {"ag_mode", "push", int(flux::AgMode::kPush)},
    {"ag_mode", "external", int(flux::AgMode::kExternal)},
    {"ag_order", "mesh", int(flux::AgOrder::kMesh)},
    {"ag_order", "ring", int(flux::AgOrder::kRing)},
    {"rs_transport", "epilogue", int(flux::RsTransport::kEpilogue)},
    {"rs_transport", "copy_engine", int(flux::RsTransport::kCopyEngine)},
    {"rs_transport", "external", int(flux::RsTransport::kExternal)},
    {"rs_transport", "hybrid", int(flux::RsTransport::kHybrid)},
    {"accumulation", "split", int(flux::Accumulation::kSplit)},
    {"accumulation", "fast", int(flux::Accumulation::kFast)},
};

int code_of(const char* kind, const std::string& name) {
  std::string known;
  for (NamedCode const& c : kNamedCodes) {
    if (std::strcmp(c.kind, kind) != 0) continue;
    if (name == c.name) return c.code;
    known += (known.empty() ? "'" : ", '") + std::string(c.name) + "'";
  }
  TORCH_CHECK_VALUE(false, kind, " must be one of ", known, ", got '", name, "'");
}

template <class Enum>
Enum named(const char* kind, const std::string& name) {
  return static_cast<Enum>(code_of(kind, name));
}

// "kind.name" -> code, e.g. "ag_mode.push" -> 1.
c10::Dict<std::string, int64_t> codes() {
  c10::Dict<std::string, int64_t> out;
  for (NamedCode const& c : kNamedCodes) out.insert(std::string(c.kind) + "." + c.name, c.code);
  return out;
}

c10::Dict<std::string, int64_t> sizes_dict(flux::WorkspaceSizes const& s) {
  c10::Dict<std::string, int64_t> out;
  out.insert("data_bytes", s.data_bytes);
  out.insert("flag_words", s.flag_words);
  out.insert("handshake_begin", s.handshake_begin);
  out.insert("handshake_words", s.handshake_words);
  out.insert("capacity", s.capacity);
  out.insert("slot_rows", s.slot_rows);
  out.insert("stage_bytes", s.stage_bytes);
  out.insert("scale_offset", s.scale_offset);
  return out;
}

void check_size(int64_t tp, int64_t max_m, int64_t inner) {
  TORCH_CHECK_VALUE(tp >= 2 && tp <= flux::kMaxTp, "tp ", tp, " outside [2, ", flux::kMaxTp, "]");
  TORCH_CHECK_VALUE(max_m > 0 && max_m % tp == 0, "max_m ", max_m, " must be a positive multiple of tp ", tp);
  TORCH_CHECK_VALUE(inner > 0, "the inner size ", inner, " must be positive");
}

// What one rank of an all-gather workspace of this size holds (flux::WorkspaceSizes, by field name): Python
// allocates it before the native workspace exists.
c10::Dict<std::string, int64_t> ag_workspace_layout(int64_t tp, int64_t max_m, int64_t k, int64_t chunk_capacity,
                                                    std::string dtype) {
  check_size(tp, max_m, k);
  TORCH_CHECK_VALUE(chunk_capacity > 0, "chunk_capacity ", chunk_capacity, " must be positive");
  return sizes_dict(
      flux::ag_workspace_sizes(int(tp), max_m, k, int(chunk_capacity), named<flux::DType>("dtype", dtype)));
}

c10::Dict<std::string, int64_t> rs_workspace_layout(int64_t tp, int64_t max_m, int64_t n, int64_t min_tile,
                                                    std::string dtype) {
  check_size(tp, max_m, n);
  TORCH_CHECK_VALUE(min_tile > 0, "min_tile ", min_tile, " must be positive");
  return sizes_dict(flux::rs_workspace_sizes(int(tp), max_m, n, int(min_tile), named<flux::DType>("dtype", dtype)));
}

// ---------------------------------------------------------------- the native workspace
// One per fused-op workspace (flux_layers/runtime/workspace.py makes it once, after the symmetric allocation):
// flux::WorkspaceState plus its CUDA-graph twin, the workspace whose state calls captured into a graph use.
// The ops take it by handle, an integer: passing the object itself from Python costs several times more than the
// rest of the op's argument parsing (torch converts a script object argument by its class type on every call).
struct NativeWorkspace;

// Handle -> live workspace, read without a lock on every call (handles are never reused).
class Registry {
 public:
  int64_t add(NativeWorkspace* w) {
    std::lock_guard<std::mutex> lock(mu_);
    return table_.push([&](std::atomic<NativeWorkspace*>& entry) { entry.store(w, std::memory_order_relaxed); }) + 1;
  }
  void remove(int64_t handle) {
    if (std::atomic<NativeWorkspace*>* entry = table_.find(handle - 1))
      entry->store(nullptr, std::memory_order_release);
  }
  NativeWorkspace& find(int64_t handle) const {
    std::atomic<NativeWorkspace*> const* entry = table_.find(handle - 1);
    NativeWorkspace* const w = entry != nullptr ? entry->load(std::memory_order_acquire) : nullptr;
    TORCH_CHECK_VALUE(w != nullptr, "no live flux_layers workspace has handle ", handle,
                      " (a workspace lives as long as its Python object)");
    return *w;
  }

 private:
  std::mutex mu_;
  flux::AppendOnlyTable<std::atomic<NativeWorkspace*>> table_;
};

Registry& registry() {
  static Registry r;
  return r;
}

[[noreturn]] void throw_workspace_failed(std::string why) {
  throw flux::bindings::WorkspaceFailed({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::move(why));
}

struct NativeWorkspace : torch::CustomClassHolder {
  // The memory the state's pointers name (symmetric storage, error record and claim, staging area), kept alive
  // here so that it outlives the state: members are destroyed in reverse order, and the state's destructor waits
  // for a release the watchdog may still have in flight on it (from Python the storage could go first).
  std::vector<Tensor> memory;
  std::unique_ptr<flux::WorkspaceState> state;
  c10::intrusive_ptr<NativeWorkspace> twin;
  int64_t handle_ = 0;
  // The stream-K tail's scratch, allocated at the first call that splits and kept: a workspace's calls are
  // ordered on the GPU (their flags require it), so one scratch serves them all.
  Tensor split_scratch;
  // ag_gemm's second output where the gathered input is not asked for: one [0, K] tensor, made once.
  Tensor empty_gathered;
  // One registration at a time, here and on the twin, so that a plan has the same index on both.
  std::mutex plans_mu;

  NativeWorkspace(std::string kind, std::string dtype, int64_t rank, int64_t device, int64_t max_m, int64_t inner,
                  int64_t capacity, std::vector<int64_t> data_ptrs, std::vector<int64_t> flag_ptrs,
                  std::vector<int64_t> comm_streams, std::vector<int64_t> error_ptrs, bool graph_protocol,
                  double timeout_s, bool poison_outputs, std::string what) {
    flux::WorkspaceConfig c;
    c.kind = named<flux::WorkspaceKind>("workspace_kind", kind);
    c.dtype = named<flux::DType>("dtype", dtype);
    TORCH_CHECK_VALUE(!flux::is_fp8(c.dtype) || c.kind == flux::WorkspaceKind::kAllGather,
                      "a reduce-scatter "
                      "workspace holds partials in the output dtype (bfloat16 or float16), got ",
                      dtype);
    TORCH_CHECK_VALUE(error_ptrs.size() == 2, "error_ptrs holds {record, claim}, got ", error_ptrs.size());
    TORCH_CHECK_VALUE(timeout_s > 0, "timeout_s must be positive, got ", timeout_s);
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
  ~NativeWorkspace() override { close(); }

  // Frees the state (its destructor synchronizes with the device: a pending release, cudaFreeHost) and takes the
  // handle out of the registry; the memory stays until this object goes. Python calls it, with the GIL released as
  // for every method of a torch class, once no call on this workspace or its twin is in flight
  // (flux_layers/runtime/workspace.py Workspace.close): a destructor run from Python would hold the GIL through
  // that synchronization, and a Python thread that GPU work waits on (the host-staged stand-in) would never run.
  void close() {
    registry().remove(handle_);
    if (twin) twin->close();
    state.reset();
  }

  int64_t handle() const { return handle_; }
  flux::WorkspaceState& live() const {
    TORCH_CHECK_VALUE(state != nullptr, "this flux_layers workspace was closed");
    return *state;
  }
  const flux::WorkspaceConfig& config() const { return live().config(); }

  // A plan's fields by name (flux_layers/runtime/call_plan.py mirrors the names). shard_order: the GEMM's shard
  // order where the caller's transfers fix it (external mode), else empty.
  int64_t add_ag_plan(int64_t tile, int64_t swizzle, int64_t stream_k_fill, int64_t sm_count, std::string mode,
                      std::string order, int64_t rows_per_chunk, std::vector<int64_t> shard_order,
                      std::string accumulation) {
    TORCH_CHECK_VALUE(config().kind == flux::WorkspaceKind::kAllGather, config().what,
                      ": an all-gather plan needs an all-gather workspace");
    TORCH_CHECK_VALUE(shard_order.empty() || int64_t(shard_order.size()) == config().tp, "shard_order names ",
                      shard_order.size(), " shards for a group of ", config().tp);
    flux::CallPlan p = kernel_plan(tile, swizzle, stream_k_fill, sm_count, accumulation);
    p.mode = named<flux::AgMode>("ag_mode", mode);
    p.order = named<flux::AgOrder>("ag_order", order);
    p.rows_per_chunk = int(rows_per_chunk);
    p.custom_shard_order = !shard_order.empty();
    for (size_t i = 0; i < shard_order.size(); ++i) p.shard_order[i] = int(shard_order[i]);
    return add_plan(p);
  }

  int64_t add_rs_plan(int64_t tile, int64_t swizzle, int64_t stream_k_fill, int64_t sm_count, std::string transport,
                      int64_t chunk_cols, int64_t node_size, std::string accumulation) {
    TORCH_CHECK_VALUE(config().kind == flux::WorkspaceKind::kReduceScatter, config().what,
                      ": a reduce-scatter plan needs a reduce-scatter workspace");
    flux::CallPlan p = kernel_plan(tile, swizzle, stream_k_fill, sm_count, accumulation);
    p.transport = named<flux::RsTransport>("rs_transport", transport);
    p.chunk_cols = int(chunk_cols);
    p.node_size = int(node_size);
    return add_plan(p);
  }

  // The index in this rank's flag words of one word of a region: all-gather "chunk" / "avail" (rank = the shard,
  // chunk), "done" / "signature" (rank = the peer); reduce-scatter "flag" (rank = the source), "count" (rank = the
  // destination), "consumed" / "signature" (rank = the peer). workspace_layout.h.
  int64_t flag_index(std::string region, int64_t rank, int64_t chunk) const {
    auto const& c = config();
    TORCH_CHECK_VALUE(rank >= 0 && rank < c.tp, "flag_index: rank ", rank, " outside [0, ", c.tp, ")");
    TORCH_CHECK_VALUE(chunk >= 0 && chunk < c.capacity, "flag_index: chunk ", chunk, " outside [0, ", c.capacity, ")");
    int const q = int(rank);
    if (c.kind == flux::WorkspaceKind::kAllGather) {
      flux::AgFlagLayout const f{c.tp, c.capacity};
      if (region == "chunk") return f.chunk(q, int(chunk));
      if (region == "avail") return f.avail(q, int(chunk));
      if (region == "done") return f.done(q);
      if (region == "signature") return f.signature(q);
    } else {
      flux::RsFlagLayout const f{c.tp, c.capacity};
      if (region == "flag") return f.flag(q, chunk);
      if (region == "count") return f.count(q, chunk);
      if (region == "consumed") return f.consumed(q);
      if (region == "signature") return f.signature(q);
    }
    TORCH_CHECK_VALUE(false, "flag_index: ", c.what, " has no flag region '", region, "'");
  }

  // All-gather of FP8 rows: where shard g's scales of a call of epoch `epoch` start in a rank's scale region (floats
  // from its start), for calls of `per_shard` scales per shard (1, or the shard's rows). workspace_layout.h.
  int64_t scale_index(int64_t epoch, int64_t shard, int64_t per_shard) const {
    auto const& c = config();
    TORCH_CHECK_VALUE(c.kind == flux::WorkspaceKind::kAllGather && flux::is_fp8(c.dtype), "scale_index: ", c.what,
                      " holds no FP8 scales");
    TORCH_CHECK_VALUE(shard >= 0 && shard < c.tp, "scale_index: shard ", shard, " outside [0, ", c.tp, ")");
    TORCH_CHECK_VALUE(per_shard >= 1 && c.tp * per_shard <= c.max_m, "scale_index: ", per_shard,
                      " scales per shard do not fit the workspace's ", c.max_m, " (max_m) per half");
    return flux::ag_scale_index(c.max_m, uint32_t(epoch), int(shard), per_shard);
  }

  // The staging slot (reduce-scatter) of this rank's partial of dst's rows.
  int64_t stage_slot(int64_t dst) const {
    auto const& c = config();
    TORCH_CHECK_VALUE(c.kind == flux::WorkspaceKind::kReduceScatter && dst >= 0 && dst < c.tp && dst != c.rank,
                      "stage_slot: ", c.what, " has no staging slot for rank ", dst);
    return flux::RsFlagLayout::stage_slot(c.rank, c.tp, int(dst));
  }

  // The twin runs every plan of this workspace under the same index: the plans registered so far are registered
  // with it now, later ones with both.
  void set_twin(c10::intrusive_ptr<NativeWorkspace> t) {
    std::lock_guard<std::mutex> lock(plans_mu);
    TORCH_CHECK_VALUE(t->config().graph_protocol, "a CUDA-graph twin must use the CUDA-graph flag protocol");
    TORCH_CHECK_VALUE(t->live().plan_count() == 0, "a CUDA-graph twin must be new (it holds plans)");
    translate_value_errors([&] {
      for (int64_t i = 0; i < live().plan_count(); ++i) t->live().add_plan(live().planned(i)->plan);
    });
    twin = std::move(t);
  }
  void set_stage(int64_t ptr) { live().set_stage(reinterpret_cast<char*>(ptr)); }
  void keep_memory(std::vector<Tensor> tensors) {
    for (Tensor& t : tensors) memory.push_back(std::move(t));
  }
  void set_timeout(double timeout_s) {
    TORCH_CHECK_VALUE(timeout_s > 0, "timeout_s must be positive, got ", timeout_s);
    live().set_timeout_ns(uint64_t(timeout_s * 1e9));
  }
  std::string failure() const { return live().failure(); }
  void mark_failed(std::string message) { live().mark_failed(message); }
  int64_t epoch() const { return live().epoch(); }

  // The end of an external-transfer call of plan `plan` and epoch `epoch` (the NCCL and hybrid transports) on the
  // current stream, which the caller enqueues once its transfers joined that stream (flux::end_external_ag_gemm,
  // end_external_gemm_rs: why it is not enqueued with the GEMM).
  void end_external_call(int64_t plan, int64_t epoch) {
    flux::PlannedCall const& c = planned(plan);
    TORCH_CHECK_VALUE(epoch > 0 && epoch <= live().epoch(), "end_external_call: epoch ", epoch, " is not a call of ",
                      config().what, " (its last epoch is ", live().epoch(), ")");
    c10::cuda::CUDAGuard guard(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(config().device)));
    cudaStream_t const stream = c10::cuda::getCurrentCUDAStream();
    translate_errors([&] {
      if (config().kind == flux::WorkspaceKind::kAllGather) {
        flux::AgGemmArgs a = c.ag;
        a.epoch = uint32_t(epoch);
        a.compute = stream;
        flux::end_external_ag_gemm(a);
      } else {
        flux::GemmRsArgs a = c.rs;
        a.epoch = uint32_t(epoch);
        a.compute = stream;
        flux::end_external_gemm_rs(a);
      }
    });
  }

  const Tensor& no_gathered(const Tensor& like) {
    if (!empty_gathered.defined()) empty_gathered = at::empty({0, config().inner}, like.options());
    return empty_gathered;
  }
  // ag_gemm's third output where no gathered scales are asked for: one empty float tensor, made once.
  const Tensor& no_scale(const Tensor& like) {
    if (!empty_scale.defined()) empty_scale = at::empty({0}, like.options().dtype(at::kFloat));
    return empty_scale;
  }
  Tensor empty_scale;

  // The workspace a call on `stream` uses: its CUDA-graph twin while the stream is being captured.
  NativeWorkspace& for_stream(cudaStream_t stream) {
    if (config().graph_protocol) return *this;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) return *this;
    if (!twin) {
      std::ostringstream os;
      os << config().what << " (max_m=" << config().max_m
         << ") has no CUDA-graph twin: a fused operator's workspace (symmetric memory, a collective) cannot be "
            "created while a CUDA graph is being captured; run the captured step once eagerly first (warm-up) with "
            "CUDA graphs enabled (FLUX_LAYERS_CUDA_GRAPHS=1 or flux_layers.runtime.workspace.enable_cuda_graphs())";
      throw flux::bindings::NoGraphTwin({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, os.str());
    }
    return *twin;
  }

  // The plan's registered call, on this workspace or its twin (the same index on both).
  const flux::PlannedCall& planned(int64_t index) const {
    const flux::PlannedCall* p = state->planned(index);
    TORCH_CHECK_VALUE(p != nullptr, "plan ", index, " was not registered with ", config().what, " (",
                      state->plan_count(), " plans)");
    return *p;
  }

 private:
  static flux::CallPlan kernel_plan(int64_t tile, int64_t swizzle, int64_t stream_k_fill, int64_t sm_count,
                                    const std::string& accumulation) {
    flux::CallPlan p;
    p.accumulation = named<flux::Accumulation>("accumulation", accumulation);
    p.tile = to_tile(tile);
    p.swizzle = int(swizzle);
    p.stream_k_fill = int(stream_k_fill);
    p.sm_count = int(sm_count);
    return p;
  }

  int64_t add_plan(const flux::CallPlan& p) {
    std::lock_guard<std::mutex> lock(plans_mu);
    translate_value_errors([&] {
      state->check_plan(p);
      if (twin) twin->state->check_plan(p);
    });
    int64_t index = 0;
    translate_errors([&] {
      index = state->add_plan(p);
      if (twin) FLUX_CHECK(twin->state->add_plan(p) == index, "the CUDA-graph twin's plans went out of step");
    });
    return index;
  }
};

// ---------------------------------------------------------------- the fused calls
// What ag_gemm and gemm_rs share, in call order: the operands checked, x's device made current, the workspace that
// runs the call (its CUDA-graph twin while the stream is captured) checked usable for this op and this x, and the
// call's registered plan with its prefilled arguments. Each check once; the epoch is taken, and the call's flags
// and transfers enqueued, only in enqueue(), after every check.
struct FusedCall {
  FusedCall(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, int64_t workspace_handle,
            int64_t plan_index, bool weight_nn, flux::WorkspaceKind kind, const char* op)
      : x(x),
        w(w),
        bias(bias),
        weight_nn(weight_nn),
        ops(check_operands(x, w, bias, weight_nn, false)),
        shape(ops.shape),
        guard(x.device()),
        stream(c10::cuda::getCurrentCUDAStream()),
        runs(registry().find(workspace_handle).for_stream(stream)),
        planned(runs.planned(plan_index)),
        config(runs.config()) {
    // An eager call also reports a failure its CUDA-graph twin recorded in a replay (replays run no host code).
    if (runs.state->failed() || (runs.twin && runs.twin->state->failed())) {
      std::string why = runs.state->failure();
      throw_workspace_failed(why.empty() && runs.twin ? runs.twin->state->failure() : why);
    }
    TORCH_CHECK_VALUE(config.kind == kind, op, ": the workspace belongs to ", config.what);
    TORCH_CHECK_VALUE(x.device().index() == config.device, op, ": x is on ", x.device(),
                      ", the workspace on cuda:", config.device);
    // The all-gather's workspace holds x's rows, the reduce-scatter's the partials (the output dtype).
    flux::DType const held = kind == flux::WorkspaceKind::kAllGather ? ops.types.a : ops.types.out;
    TORCH_CHECK_VALUE(held == config.dtype, op, ": the call's ",
                      kind == flux::WorkspaceKind::kAllGather ? "gathered rows" : "partials", " are ",
                      flux::bindings::dtype_name(held), ", the workspace holds ",
                      flux::bindings::dtype_name(config.dtype));
    if (flux::is_fp8(ops.types.a)) ops.types.accumulation = planned.plan.accumulation;
    flux::WeightLayout const layout = weight_nn ? flux::WeightLayout::kNN : flux::WeightLayout::kNT;
    TORCH_CHECK_VALUE(flux::gemm_instance_exists(ops.types, layout, planned.plan.tile), op, ": the plan's tile ",
                      int(planned.plan.tile), " has no GEMM instance for ", flux::bindings::dtype_name(ops.types.a),
                      " x ", flux::bindings::dtype_name(ops.types.b),
                      ops.types.accumulation == flux::Accumulation::kFast ? " (fast accumulation)" : "");
  }

  // An output of the call: allocated straight from the caching allocator on the current stream (no op dispatch),
  // NaN where the workspace poisons its outputs (tests).
  Tensor output(at::IntArrayRef sizes, at::ScalarType dtype) const {
    Tensor t = at::detail::empty_cuda(sizes, dtype, x.device(), std::nullopt);
    if (config.poison_outputs) t.fill_(std::numeric_limits<float>::quiet_NaN());
    return t;
  }

  // The call's arguments: its plan's prefilled ones and its operands.
  template <class Args>
  Args arguments(Args const& prefilled, const Tensor& out) const {
    Args a = prefilled;
    a.x = x.data_ptr();
    a.ldx = x.stride(0);
    a.w = w.data_ptr();
    a.ldw = w.stride(0);
    a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
    a.out = out.data_ptr();
    a.layout = weight_nn ? flux::WeightLayout::kNN : flux::WeightLayout::kNT;
    a.n = int(shape.n);
    a.k = int(shape.k);
    a.types = ops.types;
    a.x_scale_mode = scales.x_mode;
    a.x_scale = scales.x;
    a.w_scale_mode = scales.w_mode;
    a.w_scale = scales.w;
    a.compute = stream;
    a.timeout_ns = runs.state->timeout_ns();
    return a;
  }

  // Enqueues the checked call: its epoch is taken only now (nothing rejects the call any more), and the watchdog
  // watches it unless it is being captured (a CUDA-graph twin: replays run no host code to watch them).
  template <class Args>
  void enqueue(Args& a, void (*launch)(const Args&)) {
    use_split_scratch(a.launch, x, runs.state->sm_count(), runs.split_scratch);
    flux::WorkspaceState& st = *runs.state;
    translate_errors([&] {
      a.epoch = st.next_epoch();
      launch(a);
      if (a.completion != nullptr) st.watch_call(a.epoch);
    });
  }

  const Tensor& x;
  const Tensor& w;
  const std::optional<Tensor>& bias;
  bool const weight_nn;
  Operands ops;  // the accumulation is the plan's
  MatmulShape const shape;
  flux::bindings::Scales scales;     // FP8: set by the op (check_scales) before arguments()
  c10::cuda::CUDAGuard const guard;  // x's device, current for the rest of the call
  cudaStream_t const stream;
  NativeWorkspace& runs;
  flux::PlannedCall const& planned;
  flux::WorkspaceConfig const& config;
};

}  // namespace

// The fused ops (declared in fused_calls.h): the registered ops below, and the direct calls from Python
// (fastcall.cpp).
namespace flux::bindings {

namespace {

// ag_gemm with or without FP8 scales: (out [M, N], gathered [M, K] or the workspace's [0, K], gathered scales [tp]
// or [M, 1] (FP8 with return_gathered) or an empty float tensor).
std::tuple<Tensor, Tensor, Tensor> ag_gemm_call(const Tensor& x_shard_m, const Tensor& w,
                                                const std::optional<Tensor>& bias, const std::optional<Tensor>& x_scale,
                                                const std::optional<Tensor>& w_scale, int64_t workspace_handle,
                                                int64_t plan_index, bool weight_nn, bool return_gathered,
                                                bool run_gemm) {
  FusedCall call(x_shard_m, w, bias, workspace_handle, plan_index, weight_nn, WorkspaceKind::kAllGather, "ag_gemm");
  MatmulShape const& s = call.shape;
  WorkspaceConfig const& c = call.config;
  CallPlan const& plan = call.planned.plan;
  call.scales = check_scales(call.ops, x_shard_m, x_scale, w_scale, s.m, "ag_gemm");
  int64_t const m = c.tp * s.m;
  TORCH_CHECK_VALUE(m <= c.max_m && s.k == c.inner, "ag_gemm: call needs M=", m, ", K=", s.k,
                    "; the workspace holds max_m=", c.max_m, ", K=", c.inner);
  int64_t const chunks = (s.m + plan.rows_per_chunk - 1) / plan.rows_per_chunk;
  TORCH_CHECK_VALUE(chunks <= c.capacity, "ag_gemm: ", s.m, " rows per shard in chunks of ", plan.rows_per_chunk,
                    " rows need ", chunks, " chunk flags, the workspace holds ", c.capacity);
  TORCH_CHECK_VALUE(!(return_gathered && plan.mode == AgMode::kExternal),
                    "ag_gemm: with external transfers the caller copies the gathered input out");
  bool const scaled = call.scales.x_mode != ScaleMode::kNone;
  Tensor out = call.output({m, s.n}, call.ops.out_dtype);
  Tensor gathered = return_gathered ? call.output({m, s.k}, x_shard_m.scalar_type()) : call.runs.no_gathered(x_shard_m);
  Tensor gathered_scale =
      return_gathered && scaled
          ? call.output(call.scales.x_mode == ScaleMode::kPerRow ? at::IntArrayRef{m, 1} : at::IntArrayRef{c.tp},
                        at::kFloat)
          : call.runs.no_scale(x_shard_m);
  if (s.m == 0) return {out, gathered, gathered_scale};  // a no-op on every rank: no epoch, no flags

  AgGemmArgs a = call.arguments(call.planned.ag, out);
  a.rows_per_shard = int(s.m);
  a.gathered_out = return_gathered ? gathered.data_ptr() : nullptr;
  a.gathered_scale_out = return_gathered && scaled ? gathered_scale.data_ptr<float>() : nullptr;
  a.run_gemm = run_gemm;
  if (!run_gemm) a.launch.split_max_fill_pct = 0;
  call.enqueue(a, flux::ag_gemm);
  return {out, gathered, gathered_scale};
}

Tensor gemm_rs_call(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                    const std::optional<Tensor>& x_scale, const std::optional<Tensor>& w_scale,
                    int64_t workspace_handle, int64_t plan_index, bool weight_nn) {
  FusedCall call(x, w, bias, workspace_handle, plan_index, weight_nn, WorkspaceKind::kReduceScatter, "gemm_rs");
  MatmulShape const& s = call.shape;
  WorkspaceConfig const& c = call.config;
  call.scales = check_scales(call.ops, x, x_scale, w_scale, s.m, "gemm_rs");
  TORCH_CHECK_VALUE(s.m % c.tp == 0, "gemm_rs: M=", s.m, " rows are not divisible by the group size ", c.tp);
  TORCH_CHECK_VALUE(s.m <= c.max_m && s.n == c.inner, "gemm_rs: call needs M=", s.m, ", N=", s.n,
                    "; the workspace holds max_m=", c.max_m, ", N=", c.inner);
  int64_t const rows = s.m / c.tp;
  Tensor out = call.output({rows, s.n}, call.ops.out_dtype);
  if (rows == 0) return out;  // a no-op on every rank: no epoch, no flags

  GemmRsArgs a = call.arguments(call.planned.rs, out);
  a.rows_per_shard = int(rows);
  call.enqueue(a, flux::gemm_rs);
  return out;
}

}  // namespace

std::tuple<Tensor, Tensor> ag_gemm(const Tensor& x_shard_m, const Tensor& w, const std::optional<Tensor>& bias,
                                   int64_t workspace_handle, int64_t plan_index, bool weight_nn, bool return_gathered,
                                   bool run_gemm) {
  auto [out, gathered, scale] = ag_gemm_call(x_shard_m, w, bias, std::nullopt, std::nullopt, workspace_handle,
                                             plan_index, weight_nn, return_gathered, run_gemm);
  return {out, gathered};
}

Tensor gemm_rs(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, int64_t workspace_handle,
               int64_t plan_index, bool weight_nn) {
  return gemm_rs_call(x, w, bias, std::nullopt, std::nullopt, workspace_handle, plan_index, weight_nn);
}

std::tuple<Tensor, Tensor, Tensor> ag_gemm_fp8(const Tensor& x_shard_m, const Tensor& w,
                                               const std::optional<Tensor>& bias, const std::optional<Tensor>& x_scale,
                                               const std::optional<Tensor>& w_scale, int64_t workspace_handle,
                                               int64_t plan_index, bool weight_nn, bool return_gathered,
                                               bool run_gemm) {
  return ag_gemm_call(x_shard_m, w, bias, x_scale, w_scale, workspace_handle, plan_index, weight_nn, return_gathered,
                      run_gemm);
}

Tensor gemm_rs_fp8(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                   const std::optional<Tensor>& x_scale, const std::optional<Tensor>& w_scale, int64_t workspace_handle,
                   int64_t plan_index, bool weight_nn) {
  return gemm_rs_call(x, w, bias, x_scale, w_scale, workspace_handle, plan_index, weight_nn);
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

namespace flux::bindings {

void typed_error_probe(std::string which) {
  if (which == "workspace_failed") throw_workspace_failed("typed_error_probe: a failed workspace");
  if (which == "no_graph_twin")
    throw NoGraphTwin({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "typed_error_probe: no CUDA-graph twin");
  TORCH_CHECK_VALUE(false, "typed_error_probe: which must be 'workspace_failed' or 'no_graph_twin', got '", which, "'");
}

}  // namespace flux::bindings

TORCH_LIBRARY(flux_layers, m) {
  m.class_<NativeWorkspace>("NativeWorkspace")
      .def(torch::init<std::string, std::string, int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, bool, double, bool,
                       std::string>(),
           "",
           {torch::arg("kind"), torch::arg("dtype"), torch::arg("rank"), torch::arg("device"), torch::arg("max_m"),
            torch::arg("inner"), torch::arg("capacity"), torch::arg("data_ptrs"), torch::arg("flag_ptrs"),
            torch::arg("comm_streams"), torch::arg("error_ptrs"), torch::arg("graph_protocol"), torch::arg("timeout_s"),
            torch::arg("poison_outputs"), torch::arg("what")})
      .def("add_ag_plan", &NativeWorkspace::add_ag_plan, "",
           {torch::arg("tile"), torch::arg("swizzle"), torch::arg("stream_k_fill"), torch::arg("sm_count"),
            torch::arg("mode"), torch::arg("order"), torch::arg("rows_per_chunk"), torch::arg("shard_order"),
            torch::arg("accumulation")})
      .def("add_rs_plan", &NativeWorkspace::add_rs_plan, "",
           {torch::arg("tile"), torch::arg("swizzle"), torch::arg("stream_k_fill"), torch::arg("sm_count"),
            torch::arg("transport"), torch::arg("chunk_cols"), torch::arg("node_size"), torch::arg("accumulation")})
      .def("flag_index", &NativeWorkspace::flag_index, "",
           {torch::arg("region"), torch::arg("rank"), torch::arg("chunk")})
      .def("stage_slot", &NativeWorkspace::stage_slot, "", {torch::arg("dst")})
      .def("scale_index", &NativeWorkspace::scale_index, "",
           {torch::arg("epoch"), torch::arg("shard"), torch::arg("per_shard")})
      .def("set_twin", &NativeWorkspace::set_twin)
      .def("set_stage", &NativeWorkspace::set_stage)
      .def("keep_memory", &NativeWorkspace::keep_memory)
      .def("set_timeout", &NativeWorkspace::set_timeout)
      .def("failure", &NativeWorkspace::failure)
      .def("mark_failed", &NativeWorkspace::mark_failed)
      .def("epoch", &NativeWorkspace::epoch)
      .def("end_external_call", &NativeWorkspace::end_external_call, "", {torch::arg("plan"), torch::arg("epoch")})
      .def("handle", &NativeWorkspace::handle)
      .def("close", &NativeWorkspace::close);
  m.def(
      "gemm(Tensor x, Tensor weight, Tensor? bias, Tensor? x_scale, Tensor? w_scale, Tensor(a!) out, bool weight_nn, "
      "int tile, int sm_count, int swizzle, int stream_k_fill, bool fast_accum) -> ()");
  m.def(
      "ag_gemm(Tensor x_shard_m, Tensor weight, Tensor? bias, int workspace, int plan, bool weight_nn, "
      "bool return_gathered, bool run_gemm) -> (Tensor, Tensor)");
  m.def("gemm_rs(Tensor x, Tensor weight, Tensor? bias, int workspace, int plan, bool weight_nn) -> Tensor");
  m.def(
      "ag_gemm_fp8(Tensor x_shard_m, Tensor weight, Tensor? bias, Tensor? x_scale, Tensor? w_scale, int workspace, "
      "int plan, bool weight_nn, bool return_gathered, bool run_gemm) -> (Tensor, Tensor, Tensor)");
  m.def(
      "gemm_rs_fp8(Tensor x, Tensor weight, Tensor? bias, Tensor? x_scale, Tensor? w_scale, int workspace, int plan, "
      "bool weight_nn) -> Tensor");
  m.def("write_flag(Tensor(a!) flags, int index, int value) -> ()");
  m.def("wait_flag(Tensor flags, int index, int value) -> ()");
  m.def(
      "call_overhead_probe(Tensor x, Tensor weight, Tensor? bias, int workspace, int plan, bool weight_nn, "
      "bool return_gathered, bool run_gemm) -> ()");
  m.def("codes() -> Dict(str, int)", &codes);
  m.def("ag_workspace_layout(int tp, int max_m, int k, int chunk_capacity, str dtype) -> Dict(str, int)",
        &ag_workspace_layout);
  m.def("rs_workspace_layout(int tp, int max_m, int n, int min_tile, str dtype) -> Dict(str, int)",
        &rs_workspace_layout);
  m.def("typed_error_probe(str which) -> ()", &flux::bindings::typed_error_probe);
}

TORCH_LIBRARY_IMPL(flux_layers, CUDA, m) {
  m.impl("gemm", &gemm);
  m.impl("ag_gemm", &flux::bindings::ag_gemm);
  m.impl("gemm_rs", &flux::bindings::gemm_rs);
  m.impl("ag_gemm_fp8", &flux::bindings::ag_gemm_fp8);
  m.impl("gemm_rs_fp8", &flux::bindings::gemm_rs_fp8);
  m.impl("write_flag", &write_flag);
  m.impl("wait_flag", &wait_flag);
  m.impl("call_overhead_probe", &call_overhead_probe);
}
