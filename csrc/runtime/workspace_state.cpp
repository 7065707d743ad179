#include "flux/workspace_state.h"

#include <algorithm>

#include <chrono>
#include <cstring>
#include <memory>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "flux/check.h"

namespace flux {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One thread per process polls every live workspace. It is never joined: it sleeps between polls and ends with
// the process (a workspace unregisters itself before it is destroyed).
class Watchdog {
 public:
  static Watchdog& instance() {
    static Watchdog* const dog = new Watchdog();  // never destroyed: no teardown race at exit
    return *dog;
  }
  void add(WorkspaceState* w) {
    std::lock_guard<std::mutex> lock(mu_);
    states_.insert(w);
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
  }
  void remove(WorkspaceState* w) {
    std::lock_guard<std::mutex> lock(mu_);
    states_.erase(w);
  }

 private:
  void run() {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::lock_guard<std::mutex> lock(mu_);
      for (WorkspaceState* w : states_) w->poll();
    }
  }
  std::mutex mu_;
  std::unordered_set<WorkspaceState*> states_;
  bool started_ = false;
};

const char* wait_error(int code) {
  switch (code) {
    case kChunkTimeout:
      return "a copy-engine chunk of the all-gather";
    case kTileTimeout:
      return "a peer's partial tile of the reduce-scatter";
    case kConsumedTimeout:
      return "a peer to release its receive slots (previous call)";
    case kSplitTimeout:
      return "a stream-K partial of its own grid";
    case kSentTimeout:
      return "its own copy-engine transfers (its comm stream waits for its peers' previous call)";
    default:
      return "an unknown wait";
  }
}

// One rank's call from its signature words 1-2 (gemm_params.h), e.g. "gemm_rs(M=512, K=256, nt, epilogue stores)".
std::string describe_call(uint32_t rows_word, uint32_t shape_word, int tp) {
  int const op = signature_op(shape_word);
  int const transport = signature_transport(shape_word);
  std::ostringstream os;
  os << (op == 0 ? "ag_gemm" : "gemm_rs") << "(M=" << int64_t(rows_word) * tp << ", " << (op == 0 ? "N" : "K")
     << " per rank=" << signature_dim(shape_word) << ", " << (signature_layout(shape_word) ? "nn" : "nt") << ", ";
  if (op == 0) {
    os << (transport / 2 == int(AgMode::kPush) ? "push" : "pull") << " "
       << (transport % 2 == int(AgOrder::kRing) ? "ring" : "mesh");
  } else {
    os << (transport == int(RsTransport::kCopyEngine) ? "copy engine"
           : transport == int(RsTransport::kHybrid)   ? "two-level, hybrid"
                                                      : "epilogue stores");
  }
  os << ")";
  return os.str();
}
}  // namespace

WorkspaceState::WorkspaceState(WorkspaceConfig config) : cfg_(std::move(config)), timeout_ns_(cfg_.timeout_ns) {
  FLUX_CHECK(cfg_.tp >= 2 && cfg_.tp <= kMaxTp, "tp ", cfg_.tp, " outside [2, ", kMaxTp, "]");
  FLUX_CHECK(cfg_.rank >= 0 && cfg_.rank < cfg_.tp, "rank ", cfg_.rank, " outside [0, ", cfg_.tp, ")");
  FLUX_CHECK(int(cfg_.data.size()) == cfg_.tp && int(cfg_.flags.size()) == cfg_.tp, "a workspace of ", cfg_.tp,
             " ranks needs as many data and flag pointers, got ", cfg_.data.size(), " and ", cfg_.flags.size());
  for (int q = 0; q < cfg_.tp; ++q)
    FLUX_CHECK(!(cfg_.peer_mapped || q == cfg_.rank) || (cfg_.data[q] != nullptr && cfg_.flags[q] != nullptr), "rank ",
               q, "'s buffer or flags are null");
  FLUX_CHECK(!cfg_.comm.empty() && cfg_.comm.size() <= size_t(kMaxTp), "1 to ", kMaxTp,
             " communication streams are needed, got ", cfg_.comm.size());
  FLUX_CHECK(cfg_.error_record != nullptr && cfg_.error_claim != nullptr, "the error record is missing");
  FLUX_CHECK(cfg_.max_m > 0 && cfg_.inner > 0 && cfg_.capacity > 0, "bad workspace size: max_m ", cfg_.max_m,
             ", inner ", cfg_.inner, ", capacity ", cfg_.capacity);
  int current = 0;
  FLUX_CUDA_CHECK(cudaGetDevice(&current));
  FLUX_CHECK(current == cfg_.device, "workspace for device ", cfg_.device, " made while device ", current,
             " is current");
  FLUX_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, cfg_.device));
  for (auto& e : events_) FLUX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  FLUX_CUDA_CHECK(cudaStreamCreateWithFlags(&release_stream_, cudaStreamNonBlocking));
  if (!cfg_.graph_protocol) {
    size_t const bytes = CompletionRing::kSlots * sizeof(uint32_t);
    FLUX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&completion_host_), bytes, cudaHostAllocMapped));
    std::memset(completion_host_, 0, bytes);
    FLUX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&completion_device_), completion_host_, 0));
    size_t const snapshot_bytes = size_t(release_words()) * sizeof(uint32_t);
    FLUX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&snapshot_host_), snapshot_bytes, cudaHostAllocMapped));
    std::memset(snapshot_host_, 0, snapshot_bytes);
    FLUX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&snapshot_device_), snapshot_host_, 0));
  }
  FLUX_CUDA_CHECK(cudaEventCreateWithFlags(&release_done_, cudaEventDisableTiming));
  Watchdog::instance().add(this);
}

WorkspaceState::~WorkspaceState() {
  Watchdog::instance().remove(this);
  // No throw from a destructor: a failure here leaks an event or a stream. A pending release must not write into
  // flags that are freed after this object.
  if (release_pending_) cudaEventSynchronize(release_done_);
  if (release_done_ != nullptr) cudaEventDestroy(release_done_);
  if (flags_host_ != nullptr) cudaFreeHost(flags_host_);
  for (auto& e : events_)
    if (e != nullptr) cudaEventDestroy(e);
  if (completion_host_ != nullptr) cudaFreeHost(completion_host_);
  if (snapshot_host_ != nullptr) cudaFreeHost(snapshot_host_);
  if (release_stream_ != nullptr) cudaStreamDestroy(release_stream_);
}

int64_t WorkspaceState::release_words() const {
  return cfg_.kind == WorkspaceKind::kAllGather ? AgFlagLayout{cfg_.tp, cfg_.capacity}.release_words()
                                                : RsFlagLayout{cfg_.tp, cfg_.capacity}.release_words();
}

void WorkspaceState::watch_call(uint32_t epoch) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  watched_.push_back({epoch, now_ns()});
}

bool WorkspaceState::completed(uint32_t epoch) const {
  uint32_t const mark = *static_cast<volatile uint32_t*>(CompletionRing::word(completion_host_, epoch));
  return static_cast<int32_t>(mark - epoch) >= 0;  // its own epoch, or a call CompletionRing::kSlots later
}

void WorkspaceState::poll() {
  if (cfg_.graph_protocol) return keep_twin_released();
  std::lock_guard<std::mutex> lock(watch_mu_);
  while (!watched_.empty() && completed(watched_.front().epoch)) {
    watched_.pop_front();
    if (!watched_.empty()) watched_.front().since_ns = std::max(watched_.front().since_ns, now_ns());
  }
  if (released_) return;
  // Marked failed from the host (mark_failed: Python's Workspace.release, the host-staged stand-in's failure): release
  // here, on this thread, so that the thread that marked it makes no CUDA call.
  if (failed_flag_.load(std::memory_order_acquire)) {
    if (cudaSetDevice(cfg_.device) != cudaSuccess) return;
    released_ = true;
    release_flags_async();
    return;
  }
  // A kernel wait that timed out: its call ended (the kernel gave up), but stream waits of the same call on comm
  // streams that the compute stream did not join may still wait for the peer. Release them too.
  bool const kernel_timed_out = static_cast<volatile int*>(cfg_.error_record)[0] != 0;
  if (watched_.empty() && !kernel_timed_out) return;
  // The kernels' own waits time out at timeout_ns and say precisely what they waited for; the grace leaves them
  // the first word. The stream waits have no bound but this one.
  int64_t const grace_ns = 2'000'000'000;
  bool const overdue = !watched_.empty() && now_ns() - watched_.front().since_ns > int64_t(timeout_ns()) + grace_ns;
  if (!kernel_timed_out && !overdue) return;
  // The watchdog's thread serves every workspace of the process: make this one's device current first.
  if (cudaSetDevice(cfg_.device) != cudaSuccess) return;
  release(watched_.empty() ? epoch_.load() : watched_.front().epoch);
}

std::vector<std::string> WorkspaceState::lagging_peers(const std::vector<uint32_t>& f, uint32_t epoch) const {
  auto before = [&](uint32_t v, uint32_t e) { return static_cast<int32_t>(v - e) < 0; };
  bool const ag = cfg_.kind == WorkspaceKind::kAllGather;
  AgFlagLayout const ag_flags{cfg_.tp, cfg_.capacity};
  RsFlagLayout const rs_flags{cfg_.tp, cfg_.capacity};
  std::vector<std::string> behind;
  for (int p = 0; p < cfg_.tp; ++p) {
    if (p == cfg_.rank || !cfg_.peer_mapped) continue;  // local memory: no handshake words (external transfers)
    int64_t const handshake = ag ? ag_flags.done(p) : rs_flags.consumed(p);
    if (epoch > 1 && before(f[size_t(handshake)], epoch - 1)) {
      std::ostringstream os;
      os << "rank " << p << " to finish its previous call (epoch " << epoch - 1 << ")";
      behind.push_back(os.str());
    }
  }
  for (int p = 0; p < cfg_.tp; ++p) {  // the first chunk (or tile) of a call is always used
    int64_t const first = ag ? ag_flags.chunk(p, 0) : rs_flags.flag(p, 0);
    if (p != cfg_.rank && before(f[size_t(first)], epoch)) {
      std::ostringstream os;
      os << "rank " << p << "'s " << (ag ? "first chunk" : "first partial tile") << " of this call";
      behind.push_back(os.str());
    }
  }
  return behind;
}

std::string WorkspaceState::lagging_peer(const std::vector<uint32_t>& f, uint32_t epoch) const {
  std::vector<std::string> const behind = lagging_peers(f, epoch);
  return behind.empty() ? "its peers (every flag of this call arrived: the GPU may be stalled by other work)"
                        : behind.front();
}

void WorkspaceState::release_flags_async() {
  // The error claim first: a kernel whose waits the flags below release then yields NaN (gemm_sm90.cuh call_failed)
  // instead of numbers computed from data that never arrived, and a kernel still waiting gives up at its next check.
  // 0x7f7f7f7f is no error code: the record stays as it was (the failure's message is mark_failed's).
  cudaMemsetAsync(cfg_.error_claim, 0x7f, sizeof(int), release_stream_);
  // Every wait on this rank's flags returns (epoch comparisons are wrap-safe: 0x7f7f7f7f is ahead of any epoch).
  cudaMemsetAsync(cfg_.flags[cfg_.rank], 0x7f, size_t(release_words()) * 4, release_stream_);
  release_pending_ = cudaEventRecord(release_done_, release_stream_) == cudaSuccess;
}

void WorkspaceState::release(uint32_t epoch) {
  released_ = true;
  int64_t const words = release_words();
  std::string waits_for = "its peers";
  // Read this rank's flags to name the peer, waiting at most 0.2 s: where a blocked stream wait holds the only
  // hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) the copy waits behind it (the kernels' own release, by the
  // device, is what unblocks such a queue).
  if (flags_host_ == nullptr &&
      cudaHostAlloc(reinterpret_cast<void**>(&flags_host_), size_t(words) * 4, cudaHostAllocDefault) != cudaSuccess)
    flags_host_ = nullptr;
  if (flags_host_ != nullptr &&
      cudaMemcpyAsync(flags_host_, cfg_.flags[cfg_.rank], size_t(words) * 4, cudaMemcpyDeviceToHost, release_stream_) ==
          cudaSuccess &&
      cudaEventRecord(release_done_, release_stream_) == cudaSuccess) {
    bool copied = false;
    for (int i = 0; i < 200 && !copied; ++i) {
      copied = cudaEventQuery(release_done_) == cudaSuccess;
      if (!copied) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (copied) {
      waits_for = lagging_peer(std::vector<uint32_t>(flags_host_, flags_host_ + words), epoch);
    } else {
      waits_for = "its peers (the device did not answer within 0.2 s: a stream wait holds its hardware queue)";
    }
  }
  std::ostringstream os;
  os << cfg_.what << ": rank " << cfg_.rank << " timed out after " << double(timeout_ns()) * 1e-9 << " s waiting for "
     << waits_for << " (epoch " << epoch << "; the call did not finish, watchdog). A peer rank "
     << "did not enter the call, crashed, or is slower than FLUX_LAYERS_TIMEOUT_S allows. Its waits were released so "
        "that the process can shut down: outputs of that call are invalid and this workspace cannot be used again.";
  mark_failed(os.str());
  release_flags_async();  // not waited for (see above)
}

void WorkspaceState::keep_twin_released() {
  if (failure().empty()) return;
  // One release in flight at a time, and never a wait for it here: with a single hardware queue
  // (CUDA_DEVICE_MAX_CONNECTIONS=1) it may be stuck behind a blocked stream wait, and this thread serves every
  // workspace of the process.
  if (release_pending_ && cudaEventQuery(release_done_) == cudaErrorNotReady) return;
  if (cudaSetDevice(cfg_.device) != cudaSuccess) return;
  if (!released_) mark_failed(cfg_.what + ": released after a failed replay");  // keeps a recorded failure
  released_ = true;
  release_flags_async();
}

void WorkspaceState::check_plan(const CallPlan& plan) { plan_call(plan); }

int64_t WorkspaceState::add_plan(const CallPlan& plan) {
  PlannedCall planned = plan_call(plan);
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.push([&](PlannedCall& entry) { entry = planned; });
}

namespace {

// What both argument structs take from the workspace and the plan, whatever the op.
template <class Args>
void prefill(Args& a, const WorkspaceConfig& cfg, const CallPlan& plan, cudaEvent_t* events, uint32_t* completion,
             uint32_t* flags_snapshot) {
  a.dtype = cfg.dtype;
  a.types.accumulation = plan.accumulation;  // the operand types are the call's (csrc/bindings/ops.cpp)
  a.tile = plan.tile;
  a.rank = cfg.rank;
  a.tp = cfg.tp;
  for (int q = 0; q < cfg.tp; ++q) a.flags[q] = cfg.flags[size_t(q)];
  a.protocol = cfg.graph_protocol ? FlagProtocol::kCudaGraph : FlagProtocol::kEpoch;
  a.error_record = cfg.error_record;
  a.error_claim = cfg.error_claim;
  a.flags_snapshot = flags_snapshot;
  a.launch.sm_count = plan.sm_count;
  a.launch.swizzle_m = plan.swizzle;
  a.launch.split_max_fill_pct = plan.stream_k_fill;
  a.num_comm = int(cfg.comm.size());
  for (size_t i = 0; i < cfg.comm.size(); ++i) a.comm[i] = cfg.comm[i];
  a.events = events;
  a.completion = completion;
}

}  // namespace

PlannedCall WorkspaceState::plan_call(const CallPlan& plan) {
  FLUX_CHECK(plan.stream_k_fill >= 0 && plan.stream_k_fill <= 100, "stream_k_fill ", plan.stream_k_fill,
             " outside [0, 100]");
  FLUX_CHECK(plan.swizzle >= 0 && plan.swizzle <= 64, "swizzle ", plan.swizzle, " outside [0, 64]");
  FLUX_CHECK(plan.sm_count >= 0, "sm_count ", plan.sm_count, " must be >= 0 (0: all SMs)");
  FLUX_CHECK(int(plan.tile) >= 0 && int(plan.tile) < kNumTileConfigs, "tile config ", int(plan.tile), " outside [0, ",
             kNumTileConfigs, ")");
  PlannedCall c;
  c.plan = plan;
  // Eager calls are watched (their ends write the completion ring); a CUDA-graph twin's replays are not.
  uint32_t* const completion = cfg_.graph_protocol ? nullptr : completion_device_;
  if (cfg_.kind == WorkspaceKind::kAllGather) {
    FLUX_CHECK(plan.rows_per_chunk > 0, "rows_per_chunk must be positive, got ", plan.rows_per_chunk);
    FLUX_CHECK(int(plan.mode) >= 0 && int(plan.mode) <= int(AgMode::kExternal), "unknown all-gather mode ",
               int(plan.mode));
    FLUX_CHECK(int(plan.order) >= 0 && int(plan.order) <= int(AgOrder::kRing), "unknown all-gather order ",
               int(plan.order));
    FLUX_CHECK(cfg_.peer_mapped || plan.mode == AgMode::kExternal, cfg_.what,
               ": a workspace in local memory only serves calls whose caller moves the chunks (external mode)");
    if (plan.custom_shard_order) {
      std::array<bool, kMaxTp> seen{};
      bool ok = plan.shard_order[0] == cfg_.rank;
      for (int s = 0; s < cfg_.tp && ok; ++s) {
        int const g = plan.shard_order[size_t(s)];
        ok = g >= 0 && g < cfg_.tp && !seen[size_t(g)];
        if (ok) seen[size_t(g)] = true;
      }
      FLUX_CHECK(ok, "shard_order must list the ", cfg_.tp, " shards once each, this rank's (", cfg_.rank, ") first");
    }
    AgGemmArgs& a = c.ag;
    prefill(a, cfg_, plan, events_.data(), completion, snapshot_device_);
    for (int q = 0; q < cfg_.tp; ++q) a.buffers[q] = cfg_.data[size_t(q)];
    int64_t const scale_offset =
        ag_workspace_sizes(cfg_.tp, cfg_.max_m, cfg_.inner, cfg_.capacity, cfg_.dtype).scale_offset;
    if (scale_offset > 0) {
      a.scale_half = cfg_.max_m;
      for (int q = 0; q < cfg_.tp; ++q)
        a.scales[q] =
            cfg_.data[size_t(q)] != nullptr ? reinterpret_cast<float*>(cfg_.data[size_t(q)] + scale_offset) : nullptr;
    }
    a.chunk_capacity = cfg_.capacity;
    a.rows_per_chunk = plan.rows_per_chunk;
    a.mode = plan.mode;
    a.order = plan.order;
    a.custom_shard_order = plan.custom_shard_order;
    for (int i = 0; i < cfg_.tp; ++i) a.shard_order[i] = plan.shard_order[size_t(i)];
    check_ag_gemm_args(a);
  } else {
    FLUX_CHECK(plan.chunk_cols >= 0, "chunk_cols ", plan.chunk_cols, " must be >= 0 (0: default)");
    FLUX_CHECK(int(plan.transport) >= 0 && int(plan.transport) <= int(RsTransport::kHybrid),
               "unknown reduce-scatter transport ", int(plan.transport));
    bool const external = plan.transport == RsTransport::kExternal;
    bool const hybrid = plan.transport == RsTransport::kHybrid;
    bool const staged = plan.transport != RsTransport::kEpilogue;
    FLUX_CHECK(!staged || stage_ != nullptr, "the copy-engine, external and hybrid transports need the staging area");
    FLUX_CHECK(cfg_.peer_mapped || external || hybrid, cfg_.what,
               ": a workspace not mapped by every peer only serves calls whose caller moves the partials (external "
               "and hybrid transports)");
    FLUX_CHECK(!(external || hybrid) || !cfg_.graph_protocol, cfg_.what, ": external transfers run eagerly only");
    FLUX_CHECK(hybrid == (plan.node_size > 0), "node_size ", plan.node_size,
               ": a two-level plan (transport 'hybrid') needs the node size, the other transports none");
    GemmRsArgs& a = c.rs;
    prefill(a, cfg_, plan, events_.data(), completion, snapshot_device_);
    for (int q = 0; q < cfg_.tp; ++q) a.recv[q] = cfg_.data[size_t(q)];
    a.slot_rows = cfg_.max_m / cfg_.tp;
    a.flags_per_source = cfg_.capacity;
    a.stage = staged ? stage_ : nullptr;
    a.chunk_cols = plan.chunk_cols;
    a.external = external;
    a.node_size = plan.node_size;
    check_gemm_rs_args(a);
  }
  return c;
}

std::string WorkspaceState::describe_record() const {
  volatile const int* rec = cfg_.error_record;  // written by the device through the host mapping
  int const code = rec[0];
  if (code == 0) return {};
  // The rank whose data or release was awaited, from the wait's index (gemm_sm90.cuh): chunk flags are
  // [source][chunk], partial-tile waits are numbered source << 24 | chunk, and a consumed wait's index is the
  // destination.
  int const index = rec[2];
  if (code == kSignatureMismatch) {
    std::ostringstream os;
    os << cfg_.what << ": the ranks' calls went out of step: rank " << rec[1] << "'s call "
       << describe_call(uint32_t(rec[7]), uint32_t(rec[8]), cfg_.tp) << " (epoch " << rec[3] << ") met rank " << index
       << "'s call " << describe_call(uint32_t(rec[5]), uint32_t(rec[6]), cfg_.tp) << " (epoch " << rec[4] << "). ";
    // A peer ahead of this rank made more calls, or was released after its own failure: a released workspace's
    // waits all return, so the calls it had already enqueued run through and sign epochs this rank has not reached
    // (a survivor of a peer's death beside a rank that learnt of it first meets exactly that).
    if (uint32_t(rec[4]) > uint32_t(rec[3]))
      os << "Rank " << index << " is ahead: it made more fused calls than this rank, or its workspace failed (a peer "
         << "died or timed out) and was released, which runs the calls it had already enqueued through without "
            "waiting; its own error then names that failure. ";
    os << "Every rank must make the same fused calls in the same order (call signatures compared on the device). "
       << "Outputs of that call are invalid and this workspace cannot be used again (workspace.reset() on every "
          "rank brings the group back).";
    return os.str();
  }
  int peer = -1;
  if (code == kChunkTimeout && cfg_.capacity > 0) peer = index / cfg_.capacity;
  if (code == kTileTimeout) peer = index >> 24;
  if (code == kConsumedTimeout) peer = index;
  std::ostringstream os;
  os << cfg_.what << ": rank " << rec[1] << " timed out after " << double(timeout_ns()) * 1e-9 << " s waiting for "
     << wait_error(code);
  if (peer >= 0) os << " from rank " << peer;
  os << " (index " << index << ", epoch " << rec[3] << ", flag held " << rec[4] << "). ";
  // A rank's transfers to every peer queue behind its own waits, so with more than two ranks the peer this rank
  // waited for may be a survivor stuck behind the rank that failed (seen at TP 4 and 8: survivors naming one another).
  if (peer >= 0 && cfg_.tp > 2) {
    os << "Rank " << peer << " may itself be stuck waiting for another rank: each rank's error names the peer it "
       << "waited for";
    // The snapshot is written by the claiming waiter before rec[0] (sync_primitives.cuh). Reduce-scatters over
    // external transfers are left out: the two-level plan's partial tiles come from the node and the collectors only.
    bool const every_peer_writes = cfg_.peer_mapped || cfg_.kind == WorkspaceKind::kAllGather;
    if (snapshot_host_ != nullptr && every_peer_writes) {
      volatile const uint32_t* snap = snapshot_host_;
      std::vector<uint32_t> const flags(snap, snap + release_words());
      std::vector<std::string> const behind = lagging_peers(flags, uint32_t(rec[3]));
      for (size_t i = 0; i < behind.size(); ++i)
        os << (i == 0 ? "; when it gave up, this rank still waited for " : ", ") << behind[i];
    }
    os << ". ";
  }
  os << "A peer rank did not enter the call, crashed, or is slower than FLUX_LAYERS_TIMEOUT_S allows. "
     << "Outputs of that call are invalid and this workspace cannot be used again.";
  return os.str();
}

std::string WorkspaceState::failure() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.empty()) return failed_;
  }
  return describe_record();
}

void WorkspaceState::mark_failed(const std::string& message) {
  std::string recorded = describe_record();
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.empty()) failed_ = recorded.empty() ? message : recorded;
  failed_flag_.store(true, std::memory_order_release);
}

}  // namespace flux
