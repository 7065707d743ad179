// The long-lived host-side state of one fused-operator workspace (torch-free). Everything a call needs that does
// not change from call to call lives here, fixed when the workspace is made: the peers' buffer and flag pointers,
// the communication streams, the events of a call, the error record, the flag protocol, the epoch counter and
// the call plans registered for the shapes seen so far. A call passes its tensors, a plan index and
// this object (csrc/bindings/ops.cpp), so nothing is marshalled, looked up or decided twice per call.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "flux/append_only_table.h"
#include "flux/check.h"
#include "flux/fused_ops.h"

namespace flux {

enum class WorkspaceKind : int { kAllGather = 0, kReduceScatter = 1 };

// How one call runs, fixed per (shape, settings) and registered once (WorkspaceState::add_plan). Python fills it by
// name (the native workspace's add_ag_plan / add_rs_plan, csrc/bindings/ops.cpp; flux_layers/runtime/call_plan.py).
struct CallPlan {
  TileConfig tile = TileConfig::k128x256;
  int swizzle = 0;
  int stream_k_fill = 0;                             // 0: no stream-K tail
  int sm_count = 0;                                  // 0: every SM
  Accumulation accumulation = Accumulation::kSplit;  // FP8 operands' accumulation (16-bit: fp32 either way)
  // all-gather: the direction; kExternal: the caller moves the chunks (the NCCL transport)
  AgMode mode = AgMode::kPush;
  AgOrder order = AgOrder::kMesh;
  int rows_per_chunk = 0;
  bool custom_shard_order = false;  // the GEMM's shard order below, not the one `order` implies (kExternal)
  std::array<int, kMaxTp> shard_order{};
  // reduce-scatter
  RsTransport transport = RsTransport::kEpilogue;
  int chunk_cols = 0;  // columns per copy-engine chunk (0: default)
  int node_size = 0;   // kHybrid: ranks per node of the two-level plan (RsTwoLevel); 0 otherwise
};

// A registered plan and the argument struct of its calls (the one of the workspace's kind), filled in when the plan
// is registered with everything but what a call brings: its operands and sizes, its stream, its epoch, the timeout
// and the stream-K scratch (csrc/bindings/ops.cpp).
struct PlannedCall {
  CallPlan plan;
  AgGemmArgs ag;
  GemmRsArgs rs;
};

struct WorkspaceConfig {
  WorkspaceKind kind = WorkspaceKind::kAllGather;
  DType dtype = DType::kBF16;
  int rank = 0;
  int tp = 0;
  int device = 0;
  int64_t max_m = 0;               // rows of the largest call (all ranks together)
  int64_t inner = 0;               // K (all-gather) or N (reduce-scatter)
  int capacity = 0;                // chunks per shard (all-gather) or flags per source (reduce-scatter)
  std::vector<char*> data;         // every rank's data buffer (only this rank's where !peer_mapped)
  std::vector<uint32_t*> flags;    // every rank's flag words (only this rank's where !peer_mapped)
  bool peer_mapped = true;         // false: local memory, peers' pointers null (AgMode::kExternal plans only)
  std::vector<cudaStream_t> comm;  // owned by the caller, outlive this object
  int* error_record = nullptr;     // host-mapped int[kErrorRecordWords] (gemm_params.h)
  int* error_claim = nullptr;      // device int
  bool graph_protocol = false;
  uint64_t timeout_ns = 0;      // at construction; WorkspaceState::timeout_ns() from then on
  bool poison_outputs = false;  // fill outputs with NaN before launching (tests)
  std::string what;             // "ag_gemm" / "gemm_rs" (+ " (CUDA-graph twin)"), for messages
};

// Every wait of a fused call is bounded. The kernels bound their own (device-side timeout, error record). The
// stream waits (cuStreamWaitValue32) cannot be bounded by the driver, so a watchdog thread watches each call's
// completion (the epoch its last operation writes into a host-mapped CompletionRing, no CUDA call on either
// side): a call that has not finished timeout_ns after it could start (its enqueue, or the end of the workspace's
// previous call, whichever is later), or a kernel wait that timed out, is taken as hung: the watchdog names the
// peer this rank waits for, records the failure, sets the error claim (the kernels of the calls enqueued on the
// workspace yield NaN for every tile whose mainloop ends from then on) and then this rank's flags to their maximum so
// that every wait returns, including stream waits on comm streams the compute stream no longer waits for, and the
// process can shut down (outputs of those calls are invalid; the workspace refuses further calls). A workspace marked
// failed from the host (mark_failed) is released the same way at the watchdog's next poll, so that the marking thread
// makes no CUDA call. A CUDA-graph twin is not watched call by call (its replays run no host code), but once it failed
// (a wait of a replay timed out, a signature differed, or it was released) the watchdog keeps its flags at their
// maximum: every replay clears its handshake words, so without a peer that still replays the next replay would wait for
// ever. So later replays run through (their GEMM yields NaN, gemm_sm90.cuh) instead of hanging, until the host reports
// the failure (workspace.check_graph_replays(), the next eager call).
class WorkspaceState {
 public:
  explicit WorkspaceState(WorkspaceConfig config);
  ~WorkspaceState();
  WorkspaceState(const WorkspaceState&) = delete;
  WorkspaceState& operator=(const WorkspaceState&) = delete;

  const WorkspaceConfig& config() const { return cfg_; }
  int sm_count() const { return sms_; }

  // flux::Error where `plan` cannot run on this workspace (the invariants of the plan, and of the arguments its
  // calls get, checked once here rather than per call).
  void check_plan(const CallPlan& plan);
  int64_t add_plan(const CallPlan& plan);
  // Null where no plan has that index. Lock-free: called on every call.
  const PlannedCall* planned(int64_t index) const { return plans_.find(index); }
  int64_t plan_count() const { return plans_.size(); }

  // Whether the workspace refuses calls (a timed-out wait recorded by a kernel, calls out of step, mark_failed); a
  // read of two words, on every call. failure() says why.
  bool failed() const {
    return failed_flag_.load(std::memory_order_acquire) || static_cast<volatile const int*>(cfg_.error_record)[0] != 0;
  }
  std::string failure() const;
  // Refuse calls from now on, for `message` (a failure recorded earlier is kept); the watchdog releases the workspace
  // at its next poll. No CUDA call: any thread may mark a workspace failed.
  void mark_failed(const std::string& message);
  // The value this call's flags are set to: the next epoch (epoch protocol) or 1 (CUDA-graph protocol). Take it
  // only once nothing can reject the call any more: every rank must advance its counter on the same calls.
  uint32_t next_epoch() {
    if (cfg_.graph_protocol) return 1;
    uint32_t const e = epoch_.fetch_add(1) + 1;
    FLUX_CHECK(e < (1u << 31) - 1, cfg_.what, ": epoch counter exhausted; create a new workspace");
    return e;
  }
  uint32_t epoch() const { return epoch_.load(); }
  uint64_t timeout_ns() const { return timeout_ns_.load(std::memory_order_relaxed); }
  void set_timeout_ns(uint64_t ns) { timeout_ns_.store(ns, std::memory_order_relaxed); }
  // The reduce-scatter's staging area: set before the first plan that stages (checked by check_plan).
  void set_stage(char* stage) { stage_ = stage; }
  char* stage() const { return stage_; }
  cudaEvent_t* events() { return events_.data(); }

  // The host-mapped CompletionRing the end of each eager call writes its epoch to (device address).
  uint32_t* completion_ring() const { return completion_device_; }
  // After a call's work is enqueued (not under capture: replays are not watched).
  void watch_call(uint32_t epoch);
  // The watchdog's check (its thread): retire finished calls, release a hung one; keep a failed twin released.
  void poll();

 private:
  std::string describe_record() const;
  std::string lagging_peer(const std::vector<uint32_t>& flags, uint32_t epoch) const;
  std::vector<std::string> lagging_peers(const std::vector<uint32_t>& flags, uint32_t epoch) const;
  void release(uint32_t epoch);
  void keep_twin_released();
  int64_t release_words() const;

  bool completed(uint32_t epoch) const;

  struct Watched {
    uint32_t epoch;
    int64_t since_ns;  // when the call could start: its enqueue or the end of the previous call
  };
  std::mutex watch_mu_;
  std::deque<Watched> watched_;
  uint32_t* completion_host_ = nullptr;  // CompletionRing::kSlots words, host-mapped
  uint32_t* completion_device_ = nullptr;
  cudaStream_t release_stream_ = nullptr;  // non-blocking: not held up by the streams it unblocks
  bool released_ = false;
  // After the last release's memset: a release is issued only once the previous one finished, and never waited for
  // without a bound (a stream wait may hold the only hardware queue; this thread serves every workspace).
  cudaEvent_t release_done_ = nullptr;
  bool release_pending_ = false;
  uint32_t* flags_host_ = nullptr;  // pinned copy of this rank's flags (to name the peer a hung call waits for)
  // Host-mapped, release_words() words: this rank's flags as the kernel's waiter that claimed the error record saw
  // them (GemmProblem::release_snapshot); eager workspaces only.
  uint32_t* snapshot_host_ = nullptr;
  uint32_t* snapshot_device_ = nullptr;
  void release_flags_async();
  PlannedCall plan_call(const CallPlan& plan);

  WorkspaceConfig cfg_;
  int sms_ = 0;
  std::array<cudaEvent_t, kEventsPerCall> events_{};
  std::atomic<uint32_t> epoch_{0};
  std::atomic<uint64_t> timeout_ns_{0};
  mutable std::mutex mu_;  // plan registration and failed_
  AppendOnlyTable<PlannedCall> plans_;
  std::string failed_;
  std::atomic<bool> failed_flag_{false};  // failed_ is set
  char* stage_ = nullptr;                 // reduce-scatter copy-engine staging area (caller-owned)
};

}  // namespace flux
