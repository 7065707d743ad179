// Host-side orchestration of the fused operators (torch-free). The Python workspace owns the symmetric
// buffers, flags and streams and passes raw pointers/handles; these functions issue the copy-engine
// transfers, the stream memory operations and the GEMM launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flux/gemm_dispatch.h"
#include "flux/gemm_params.h"
#include "flux/workspace_layout.h"

namespace flux {

// Events a call records and waits on; each workspace owns its set (a recorded event is only waited on within
// the call that recorded it, and cudaStreamWaitEvent captures the event's state when it is called).
constexpr int kEventsPerCall = 12;

// kExternal: the caller moves the chunks into this rank's gathered buffer and sets this rank's chunk flags (the
// NCCL transport, flux_layers/runtime/multinode/nccl_transport.py, on a stream it forked from the compute stream before
// the call). The op launches the GEMM on the local buffer and flags and enqueues no copy, no handshake and no
// write to a peer: the workspace may hold local memory only (WorkspaceConfig::peer_mapped false), and the order
// of calls on the buffer is the caller's streams' order.
enum class AgMode : int { kPull = 0, kPush = 1, kExternal = 2 };
enum class AgOrder : int { kMesh = 0, kRing = 1 };

// Flag protocols (the workspace picks one for its lifetime; flux_layers/runtime/workspace.py):
//   epoch      : eager calls. A flag is set for call e when it holds a value >= e (counted on the host per
//                workspace); nothing is cleared, so back-to-back calls cannot race on a reset.
//   cuda graph : capturable calls, whose values must not depend on a host counter. A set flag holds 1
//                (epoch = 1 on every call). Each flag is cleared by the rank that waits on it before that rank
//                lets its producer go on: the start-of-call handshake words (done / consumed) are cleared
//                right after the wait, the data flags (chunk / avail / reduce-scatter tile flags) at the end of
//                the call, before the handshake write that allows the next call's producer to set them. The
//                handshake words start set (1), standing for "the previous call finished".
enum class FlagProtocol : int { kEpoch = 0, kCudaGraph = 1 };

// How a reduce-scatter plan moves the partials of the peers' rows (csrc/runtime/gemm_rs.cpp): the epilogue's stores
// into the peers' receive slots, the copy engine from a local staging area, the caller (the NCCL transport) from
// that staging area, or two-level (the hybrid transport, RsTwoLevel in workspace_layout.h): the epilogue's stores
// inside the node, and the caller's transfers of the collected node partials between nodes.
enum class RsTransport : int { kEpilogue = 0, kCopyEngine = 1, kExternal = 2, kHybrid = 3 };

struct AgGemmArgs {
  // operands (this rank)
  const void* x = nullptr;  // [Mg, K] own rows, row stride ldx elements
  int64_t ldx = 0;
  const void* w = nullptr;  // [N, K] (kNT) or [K, N] (kNN)
  int64_t ldw = 0;
  const void* bias = nullptr;    // [N] or null
  void* out = nullptr;           // [tp * Mg, N] contiguous
  void* gathered_out = nullptr;  // [tp * Mg, K] contiguous copy of the gathered input, or null (kExternal: null)
  DType dtype = DType::kBF16;    // of x and the gathered buffer (the workspace's)
  GemmTypes types;               // the GEMM's operand types and accumulation (the call's)
  // FP8: x's scale (this rank's shard: one element, ScaleMode::kPerShard, or one per row, kPerRow) travels with its
  // rows into every rank's scale region ([tp] or [tp][Mg] floats, compact for the call's Mg, in the half of the
  // epoch's parity), from which the GEMM applies each source's scale to its rows; W's scale (one, or one per output
  // column) is read where it is. Two halves, so that a GEMM that pushes its scales at its start (eager push, mesh:
  // GemmProblem::scale_push_dst) writes the half that no peer still reads: our call e starts after our call e - 1
  // saw the peers' done of e - 2, the last call that read the half of e's parity.
  ScaleMode x_scale_mode = ScaleMode::kNone;
  const float* x_scale = nullptr;
  ScaleMode w_scale_mode = ScaleMode::kNone;
  const float* w_scale = nullptr;
  float* scales[kMaxTp] = {nullptr};    // every rank's scale region (null: a 16-bit workspace)
  int64_t scale_half = 0;               // floats in each half of a scale region (the workspace's max_m)
  float* gathered_scale_out = nullptr;  // [tp] or [tp * Mg] copy of the gathered scales, or null
  WeightLayout layout = WeightLayout::kNT;
  TileConfig tile = TileConfig::k256x128;
  int rows_per_shard = 0;  // Mg = M / tp
  int n = 0;
  int k = 0;
  // workspace (all ranks)
  int rank = 0;
  int tp = 1;
  char* buffers[kMaxTp] = {nullptr};    // gathered buffer of every rank: [max_M, K], row stride K
  uint32_t* flags[kMaxTp] = {nullptr};  // flag words of every rank (AgFlagLayout)
  int chunk_capacity = 0;
  int rows_per_chunk = 0;
  AgMode mode = AgMode::kPull;
  AgOrder order = AgOrder::kMesh;
  // The GEMM's shard order (own shard first, then the chunks' arrival order) where the caller's transfers set it
  // (kExternal); else ag_shard_order(rank, tp, order).
  bool custom_shard_order = false;
  int shard_order[kMaxTp] = {0};
  FlagProtocol protocol = FlagProtocol::kEpoch;
  uint32_t epoch = 0;  // 1 under FlagProtocol::kCudaGraph
  uint64_t timeout_ns = 0;
  int* error_record = nullptr;
  int* error_claim = nullptr;
  uint32_t* flags_snapshot = nullptr;  // GemmProblem::release_snapshot
  LaunchOptions launch;                // of the GEMM
  cudaStream_t compute = nullptr;
  cudaStream_t comm[kMaxTp] = {nullptr};  // at least one; mesh uses up to tp - 1
  int num_comm = 0;
  cudaEvent_t* events = nullptr;  // kEventsPerCall events of the workspace
  bool run_gemm = true;           // false: the transfers alone (benchmarks time the copy-engine all-gather this way)
  // Host-mapped words (CompletionRing) the end of the call writes its epoch to: the watchdog's view of completion.
  // Null: the call is not watched (CUDA-graph twin).
  uint32_t* completion = nullptr;
};

// What is fixed for a workspace and a plan (ranks, pointers, streams, events, chunking), checked once when the plan
// is registered with the workspace (WorkspaceState::add_plan); flux::Error if it does not hold.
void check_ag_gemm_args(const AgGemmArgs& args);

// out = all_gather(x) @ op(w) + bias with copy-engine transfers overlapped with the GEMM. `args`: a checked
// template (check_ag_gemm_args) with a call's operands, which the caller has checked against it (its rows fit the
// workspace, its chunks the chunk flags), and an epoch from WorkspaceState::next_epoch.
void ag_gemm(const AgGemmArgs& args);

// The end of an external-mode call (its completion word), on args.compute, which the caller enqueues once its
// transfers are enqueued and joined into that stream: ag_gemm enqueues nothing behind its GEMM in that mode, since
// under a single hardware queue the transfers the GEMM waits for did not run behind a stream write that waits for
// the GEMM (docs/design.md section 7). `args`: the call's (its epoch).
void end_external_ag_gemm(const AgGemmArgs& args);

// The shard order the GEMM walks for this rank: own shard, then in arrival order.
void ag_shard_order(int rank, int tp, AgOrder order, int* shard_order);

struct GemmRsArgs {
  const void* x = nullptr;  // [M, K] (K is this rank's shard of the reduction), row stride ldx
  int64_t ldx = 0;
  const void* w = nullptr;
  int64_t ldw = 0;
  const void* bias = nullptr;  // [N], added once after the sum
  void* out = nullptr;         // [Mg, N] contiguous: rows [rank * Mg, (rank + 1) * Mg) of the sum
  DType dtype = DType::kBF16;  // of the partials and out (the workspace's)
  GemmTypes types;             // the GEMM's operand types and accumulation (FP8 operands: out bf16)
  // FP8: x's scale (one element, or one per row of x: ScaleMode::kPerRow) and W's (one, or one per output column);
  // each rank scales its own partials before they travel.
  ScaleMode x_scale_mode = ScaleMode::kNone;
  const float* x_scale = nullptr;
  ScaleMode w_scale_mode = ScaleMode::kNone;
  const float* w_scale = nullptr;
  WeightLayout layout = WeightLayout::kNT;
  TileConfig tile = TileConfig::k256x128;
  int rows_per_shard = 0;
  int n = 0;
  int k = 0;
  int rank = 0;
  int tp = 1;
  char* recv[kMaxTp] = {nullptr};       // receive buffer of every rank: [tp slots][slot_rows][N]
  int64_t slot_rows = 0;                // rows per slot (max Mg)
  uint32_t* flags[kMaxTp] = {nullptr};  // flag words of every rank: flag[tp][per_source], consumed[tp],
                                        // count[tp][per_source]
  int flags_per_source = 0;
  // Copy-engine transport (see gemm_rs.cpp): local staging area [tp - 1][slot_rows][N] and one comm stream per
  // peer (at least one); null stage: the epilogue stores straight into the peers' receive slots.
  char* stage = nullptr;
  int chunk_cols = 0;  // columns per copy-engine chunk (0: default; external: N, full-width chunks)
  // External transfers (the NCCL transport, flux_layers/runtime/multinode/nccl_rs_transport.py): the kernel runs as
  // with the copy engine (partials into the local staging area, per-chunk counts), but the op moves nothing: comm[0] is
  // the caller's transfer stream, forked here from the compute stream after the counts are cleared and before the
  // kernel, on which the caller waits for each chunk's count, sends it, receives the peers' partials into this
  // rank's receive slots and raises this rank's flag for each. No handshake, no write to a peer: only this rank's
  // recv and flags pointers are used (a workspace in local memory). Epoch protocol only.
  bool external = false;
  // Two-level (RsTransport::kHybrid; RsTwoLevel): ranks per node (0: one level). As with external transfers, comm[0]
  // is the caller's transfer stream, forked after the counts are cleared: it sends the staged node partials (the
  // collected blocks) and receives the other nodes' into this rank's slots of their collectors, raising the flag of
  // each chunk; inside the node the epilogue stores into the peers' slots (node peers mapped, the others need not
  // be), with the consumed handshake, which this rank answers at its node peers after the kernel.
  int node_size = 0;
  cudaStream_t comm[kMaxTp] = {nullptr};
  int num_comm = 0;
  FlagProtocol protocol = FlagProtocol::kEpoch;
  uint32_t epoch = 0;  // 1 under FlagProtocol::kCudaGraph
  uint64_t timeout_ns = 0;
  int* error_record = nullptr;
  int* error_claim = nullptr;
  uint32_t* flags_snapshot = nullptr;  // GemmProblem::release_snapshot
  LaunchOptions launch;
  cudaStream_t compute = nullptr;
  cudaEvent_t* events = nullptr;   // kEventsPerCall events of the workspace
  uint32_t* completion = nullptr;  // as AgGemmArgs::completion
};

// As check_ag_gemm_args, for the reduce-scatter.
void check_gemm_rs_args(const GemmRsArgs& args);

// out = reduce_scatter(x @ op(w)) + bias: tiles reach the owning rank's receive slot (stored there by the
// epilogue, staged locally and moved by the copy engine, or staged locally and moved by the caller) and are
// reduced there by the owner's GEMM epilogue (deterministic order). `args` as for ag_gemm (its rows fit a slot).
void gemm_rs(const GemmRsArgs& args);

// As end_external_ag_gemm, for an external or two-level reduce-scatter (two-level: with the consumed words at the
// node's peers).
void end_external_gemm_rs(const GemmRsArgs& args);

// The destination order of this rank's tiles: rank+1, rank+2, ..., own rows last.
void rs_shard_order(int rank, int tp, int* shard_order);

// Stream memory operations through driver entry points (no link against libcuda).
void stream_write_u32(cudaStream_t stream, uint32_t* address, uint32_t value);
void stream_wait_u32_geq(cudaStream_t stream, const uint32_t* address, uint32_t value);

// Several flag writes (or waits, each for a value >= its own) in one driver call (cuStreamBatchMemOp): a call
// costs the host about as much as one stream memory operation, so a call's handshake with all its peers costs
// one. Each is ordered after all prior work of the stream, as the single operations above.
struct FlagOp {
  uint32_t* address;
  uint32_t value;
};
constexpr int kMaxFlagOps = kMaxTp + 1;
void stream_write_u32_all(cudaStream_t stream, const FlagOp* writes, int count);

// *flag = value after the call signature `signature` (kSignatureWords words, gemm_params.h) is written into the
// slot at `slot`, in one batch: the signature reaches the peer before the flag.
void stream_write_signed_flag(cudaStream_t stream, uint32_t* slot, const uint32_t* signature, uint32_t* flag,
                              uint32_t value);
void stream_wait_u32_geq_all(cudaStream_t stream, const FlagOp* waits, int count);

// Where the end of each call of a workspace writes its epoch (host-mapped memory, read by the watchdog without a
// CUDA call): word epoch % kSlots, so calls that complete out of order (on different streams) each leave their
// own mark, and a call is complete once its word holds its epoch or a later one.
struct CompletionRing {
  static constexpr int kSlots = 256;
  static uint32_t* word(uint32_t* ring, uint32_t epoch) { return ring + epoch % kSlots; }
};

}  // namespace flux
