#include "flux/workspace_state.h"

#include <sstream>

#include "flux/check.h"

namespace flux {

namespace {
const char* wait_error(int code) {
  switch (code) {
    case kChunkTimeout: return "a copy-engine chunk of the all-gather";
    case kTileTimeout: return "a peer's partial tile of the reduce-scatter";
    case kConsumedTimeout: return "a peer to release its receive slots (previous call)";
    case kSplitTimeout: return "a stream-K partial of its own grid";
    default: return "an unknown wait";
  }
}
}  // namespace

WorkspaceState::WorkspaceState(WorkspaceConfig config) : cfg_(std::move(config)) {
  FLUX_CHECK(cfg_.tp >= 2 && cfg_.tp <= kMaxGroups, "tp ", cfg_.tp, " outside [2, ", kMaxGroups, "]");
  FLUX_CHECK(cfg_.rank >= 0 && cfg_.rank < cfg_.tp, "rank ", cfg_.rank, " outside [0, ", cfg_.tp, ")");
  FLUX_CHECK(int(cfg_.data.size()) == cfg_.tp && int(cfg_.flags.size()) == cfg_.tp, "a workspace of ", cfg_.tp,
             " ranks needs as many data and flag pointers, got ", cfg_.data.size(), " and ", cfg_.flags.size());
  for (int q = 0; q < cfg_.tp; ++q)
    FLUX_CHECK(cfg_.data[q] != nullptr && cfg_.flags[q] != nullptr, "rank ", q, "'s buffer or flags are null");
  FLUX_CHECK(!cfg_.comm.empty() && cfg_.comm.size() <= size_t(kMaxGroups), "1 to ", kMaxGroups,
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
}

WorkspaceState::~WorkspaceState() {
  for (auto& e : events_)
    if (e != nullptr) cudaEventDestroy(e);  // no throw from a destructor; a failure here leaks one event
}

int WorkspaceState::add_plan(const CallPlan& plan) {
  FLUX_CHECK(plan.stream_k_fill >= 0 && plan.stream_k_fill <= 100, "stream_k_fill ", plan.stream_k_fill,
             " outside [0, 100]");
  FLUX_CHECK(plan.swizzle >= 0 && plan.swizzle <= 64, "swizzle ", plan.swizzle, " outside [0, 64]");
  FLUX_CHECK(plan.sm_count >= 0, "sm_count ", plan.sm_count, " must be >= 0 (0: all SMs)");
  FLUX_CHECK(int(plan.tile) >= 0 && int(plan.tile) < kNumTileConfigs, "tile config ", int(plan.tile),
             " outside [0, ", kNumTileConfigs, ")");
  if (cfg_.kind == WorkspaceKind::kAllGather) {
    FLUX_CHECK(plan.rows_per_chunk > 0, "rows_per_chunk must be positive, got ", plan.rows_per_chunk);
  } else {
    FLUX_CHECK(plan.chunk_cols >= 0, "chunk_cols ", plan.chunk_cols, " must be >= 0 (0: default)");
    FLUX_CHECK(!plan.copy_engine || stage_ != nullptr, "the copy-engine transport needs the staging area");
  }
  std::lock_guard<std::mutex> lock(mu_);
  plans_.push_back(plan);
  return int(plans_.size()) - 1;
}

const CallPlan& WorkspaceState::plan(int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  FLUX_CHECK(index >= 0 && index < int64_t(plans_.size()), "plan ", index, " was not registered with ", cfg_.what,
             " (", plans_.size(), " plans)");
  return plans_[size_t(index)];  // a deque: references stay valid as plans are added
}

std::string WorkspaceState::describe_record() const {
  volatile const int* rec = cfg_.error_record;  // written by the device through the host mapping
  int const code = rec[0];
  if (code == 0) return {};
  std::ostringstream os;
  os << cfg_.what << ": rank " << rec[1] << " timed out after " << double(cfg_.timeout_ns) * 1e-9
     << " s waiting for " << wait_error(code) << " (index " << rec[2] << ", epoch " << rec[3] << ", flag held "
     << rec[4] << "). A peer rank did not enter the call, crashed, or is slower than FLUX_LAYERS_TIMEOUT_S allows. "
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
}

uint32_t WorkspaceState::next_epoch() {
  if (cfg_.graph_protocol) return 1;
  uint32_t const e = epoch_.fetch_add(1) + 1;
  FLUX_CHECK(e < (1u << 31) - 1, cfg_.what, ": epoch counter exhausted; create a new workspace");
  return e;
}

}  // namespace flux
