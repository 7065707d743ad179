// The long-lived host-side state of one fused-operator workspace (torch-free). Everything a call needs that does
// not change from call to call lives here, fixed when the workspace is made: the peers' buffer and flag pointers,
// the communication streams, the events of a call, the error record, the flag protocol, the epoch counter and
// the kernel/transfer plans registered for the shapes seen so far. A call passes its tensors, a plan index and
// this object (csrc/bindings/ops.cpp), so nothing is marshalled, looked up or decided twice per call.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "flux/fused_ops.h"

namespace flux {

enum class WorkspaceKind : int { kAllGather = 0, kReduceScatter = 1 };

// How one call runs, fixed per (shape, settings) and registered once (WorkspaceState::add_plan).
struct CallPlan {
  TileConfig tile = TileConfig::k128x256;
  int swizzle = 0;
  int stream_k_fill = 0;  // 0: no stream-K tail
  int sm_count = 0;       // 0: every SM
  // all-gather: the direction; kExternal (either op): the caller moves the data (the NCCL transport)
  AgMode mode = AgMode::kPush;
  AgOrder order = AgOrder::kMesh;
  int rows_per_chunk = 0;
  bool custom_group_order = false;  // the GEMM's shard order below, not the one `order` implies (kExternal)
  std::array<int, kMaxGroups> group_order{};
  // reduce-scatter
  bool copy_engine = false;
  int chunk_cols = 0;
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
  uint64_t timeout_ns = 0;
  bool poison_outputs = false;  // fill outputs with NaN before launching (tests)
  std::string what;             // "ag_gemm" / "gemm_rs" (+ " (CUDA-graph twin)"), for messages
};

// Every wait of a fused call is bounded. The kernels bound their own (device-side timeout, error record). The
// stream waits (cuStreamWaitValue32) cannot be bounded by the driver, so a watchdog thread watches each call's
// completion (the epoch its last operation writes into a host-mapped CompletionRing, no CUDA call on either
// side): a call that has not finished timeout_ns after it could start (its enqueue, or the end of the workspace's
// previous call, whichever is later), or a kernel wait that timed out, is taken as hung: the watchdog names the
// peer this rank waits for, records the failure, and sets this rank's flags to their maximum so that every wait
// returns, including stream waits on comm streams the compute stream no longer waits for, and the process can
// shut down (outputs of that call are garbage; the workspace refuses further calls).
// A CUDA-graph twin is not watched call by call (its replays run no host code), but once it failed (a wait of a
// replay timed out, a signature differed, or it was released) the watchdog keeps its flags at their maximum: every
// replay clears its handshake words, so without a peer that still replays the next replay would wait for ever. So
// later replays run through (their GEMM yields NaN, gemm_sm90.cuh) instead of hanging, until the host reports the
// failure (workspace.check_graph_replays(), the next eager call).
class WorkspaceState {
 public:
  explicit WorkspaceState(WorkspaceConfig config);
  ~WorkspaceState();
  WorkspaceState(const WorkspaceState&) = delete;
  WorkspaceState& operator=(const WorkspaceState&) = delete;

  const WorkspaceConfig& config() const { return cfg_; }
  int sm_count() const { return sms_; }

  int add_plan(const CallPlan& plan);
  const CallPlan& plan(int64_t index) const;

  // "" while usable; else why not (a timed-out wait recorded by a kernel, or mark_failed's message).
  std::string failure() const;
  void mark_failed(const std::string& message);
  // The value this call's flags are set to: the next epoch (epoch protocol) or 1 (CUDA-graph protocol). Take it
  // only once nothing can reject the call any more: every rank must advance its counter on the same calls.
  uint32_t next_epoch();
  uint32_t epoch() const { return epoch_.load(); }
  void set_timeout_ns(uint64_t ns) { cfg_.timeout_ns = ns; }
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
  void release(uint32_t epoch);
  void keep_twin_released();
  int64_t flag_words() const;

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
  void release_flags_async();

  WorkspaceConfig cfg_;
  int sms_ = 0;
  std::array<cudaEvent_t, kEventsPerCall> events_{};
  std::atomic<uint32_t> epoch_{0};
  mutable std::mutex mu_;  // plans_ and failed_
  std::deque<CallPlan> plans_;
  std::string failed_;
  char* stage_ = nullptr;  // reduce-scatter copy-engine staging area (caller-owned)
};

}  // namespace flux
