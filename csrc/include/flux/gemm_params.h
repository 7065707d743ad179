// Plain-C description of one launch of the persistent GEMM (csrc/kernels/gemm_sm90.cuh). Torch-free: the
// binding layer fills it from tensors, the kernels read it. One struct serves the three uses:
//
//   plain GEMM   : num_shards = 1, own_shard = 0 (A = a_own), d[0] = output
//   AllGather+GEMM: shard g = rows of source rank g; own_shard = rank reads x directly (a_own), other shards
//                  read the gathered buffer `a` and wait on chunk_flags before loading
//   GEMM+ReduceScatter: shard g = rows owned by destination rank g; d[g] = g's receive slot for this rank,
//                  except rs_own_shard, whose tiles add the peers' partials and go to the output
//
// Rows of a shard are [0, rows_per_shard); a tile never straddles shards (TMA clips at the shard edge), so
// rows_per_shard need not be a multiple of the tile.
#pragma once

#include <cstdint>

namespace flux {

// The constants below are the one source of their Python mirrors (flux_layers/runtime/schedules.py); a CPU test
// compiles this header and compares (tests/cpu/test_schedules.py, test_constants_match_the_cpp_headers).
constexpr int kMaxTp = 8;  // largest TP size supported

// Tiles are 128 bytes deep along K (64 elements of bf16/fp16, 128 of FP8).
enum class TileConfig : int {
  k256x128 = 0,  // 256 x 128 tiles, cluster 2 x 1 (B multicast), cooperative
  k128x256 = 1,  // 128 x 256 tiles, cluster 2 x 1
  k128x128 = 2,  // 128 x 128 tiles, cluster 2 x 1: FP8 with split accumulation (two accumulator fragments fit)
};
constexpr int kNumTileConfigs = 3;

constexpr int tile_m(TileConfig c) { return c == TileConfig::k256x128 ? 256 : 128; }
constexpr int tile_n(TileConfig c) { return c == TileConfig::k128x256 ? 256 : 128; }
constexpr int kClusterM = 2;

// A last, partial wave is split along K while it keeps at most this percentage of the clusters busy.
constexpr int kDefaultSplitMaxFillPct = 75;

enum class DType : int { kBF16 = 0, kFP16 = 1, kE4M3 = 2, kE5M2 = 3 };
constexpr bool is_fp8(DType d) { return d == DType::kE4M3 || d == DType::kE5M2; }
constexpr int dtype_bytes(DType d) { return is_fp8(d) ? 1 : 2; }

// FP8 accumulation: kSplit promotes the tensor cores' partial sums into fp32 accumulators every k tile (CUTLASS's
// FP8 mainloop); kFast lets the tensor cores accumulate all of K (fewer registers, less precise). 16-bit operands
// always accumulate in fp32 (kSplit names them).
enum class Accumulation : int { kSplit = 0, kFast = 1 };

// How the epilogue scales the fp32 accumulators of an FP8 GEMM (scales are fp32 in device memory, read by the
// kernel: no host sync, capturable), before the bias and before a reduce-scatter adds the peers' partials.
//   A (x): kNone; kPerShard, one scale per shard (a tensor-wise scale: every shard reads the same element, stride
//          0; an all-gather's per-shard scales: one per source rank); kPerRow, one per row of each shard.
//   B (W): kNone; kPerShard, one scale for all of W, this rank's shard of the weight (tensor-wise); kPerRow, one
//          per output column (W's rows in the 'nt' layout).
enum class ScaleMode : int { kNone = 0, kPerShard = 1, kPerRow = 2 };
enum class WeightLayout : int { kNT = 0 /* W [N, K]: x @ W^T */, kNN = 1 /* W [K, N]: x @ W */ };

// Error codes written into GemmProblem::error_record[0] when a bounded wait times out, or when a peer's call
// differs from this rank's.
enum WaitError : int {
  kNoError = 0,
  kChunkTimeout = 1,
  kTileTimeout = 2,
  kConsumedTimeout = 3,
  kSplitTimeout = 4,       // a stream-K reducer waited too long for a partial of its own grid (a kernel bug)
  kSignatureMismatch = 5,  // a peer's call signature (below) differs from this rank's
  kSentTimeout = 6,        // an all-gather's last CTA waited too long for its own comm stream's transfers
};

// The error record: host-mapped int[kErrorRecordWords], written once by the first failing waiter (error_claim):
//   {code, rank, index, epoch, observed flag}: a timed-out wait (index: the flag's, see describe_record);
//   {kSignatureMismatch, rank, peer, epoch, peer's signature words 0-2, this rank's words 1-2}.
constexpr int kErrorRecordWords = 9;

// A fused call's signature: what the ranks of a group must agree on, call by call. Each rank writes its signature
// into every peer it sends to (the peer's signature slot for it) before the first flag of the call there; the
// peer's kernel compares it with its own after that flag, so ranks whose calls went out of step (the same shapes
// in a different order, a skipped call) stop at once with both calls named instead of exchanging mismatched data.
//   word 0: the epoch (1 under the CUDA-graph flag protocol)
//   word 1: rows per rank (Mg)
//   word 2: the other dimension the ranks share (N per rank for AllGather+GEMM, K per rank for GEMM+ReduceScatter)
//           << 6 | transport << 2 | weight layout << 1 | op (0: ag_gemm, 1: gemm_rs)
// transport: ag_gemm: AgMode * 2 + AgOrder (pull/push x mesh/ring); gemm_rs: RsTransport (0 epilogue, 1 copy engine,
// 3 two-level).
// A dimension of 2^26 or more is written as 2^26 - 1 (never rejected: a call is checked before its epoch advances).
constexpr int kSignatureWords = 3;
constexpr int64_t kMaxSignatureDim = int64_t(1) << 26;  // the dimension's bits in word 2
constexpr uint32_t signature_shape_word(int op, int layout, int transport, int64_t dim) {
  return uint32_t(dim < kMaxSignatureDim ? dim : kMaxSignatureDim - 1) << 6 | uint32_t(transport & 15) << 2 |
         uint32_t(layout & 1) << 1 | uint32_t(op & 1);
}
constexpr int signature_op(uint32_t word2) { return int(word2 & 1u); }
constexpr int signature_layout(uint32_t word2) { return int(word2 >> 1 & 1u); }
constexpr int signature_transport(uint32_t word2) { return int(word2 >> 2 & 15u); }
constexpr int64_t signature_dim(uint32_t word2) { return int64_t(word2 >> 6); }

// How the persistent grid runs one problem; the fused operators' arguments carry the same struct.
struct LaunchOptions {
  int sm_count = 0;   // CTAs resident at once (persistent grid); 0: all SMs of the device
  int swizzle_m = 0;  // tiles along M visited together (L2 locality); 0: default
  // Stream-K tail (tile_schedule.cuh StreamK): scratch for the fp32 partials of split tiles and their flags,
  // stream-ordered (allocated for this launch); null or too small: whole tiles only.
  void* split_workspace = nullptr;
  int64_t split_workspace_bytes = 0;
  // The last wave is split only while it keeps at most this percentage of the clusters busy (StreamK::make).
  int split_max_fill_pct = kDefaultSplitMaxFillPct;
};

struct GemmProblem {
  // ---- shape
  int rows_per_shard = 0;  // Mg
  int n = 0;
  int k = 0;
  int num_shards = 1;
  int shard_order[kMaxTp] = {0};  // step -> shard (the tile order; see flux_layers/runtime/schedules.py)
  int own_shard = 0;              // shard whose A rows are a_own (-1: none)

  // ---- operands (element pointers; leading dimensions in elements)
  const void* a = nullptr;  // shard-batched A: shard g, row i at a + g * a_shard_stride + i * lda
  int64_t lda = 0;
  int64_t a_shard_stride = 0;
  const void* a_own = nullptr;  // [Mg, K] with leading dimension lda_own
  int64_t lda_own = 0;
  const void* b = nullptr;  // W: [N, K] (kNT) or [K, N] (kNN), leading dimension ldb
  int64_t ldb = 0;
  const void* bias = nullptr;   // [N] (the output dtype) or null; added once per output element
  void* d[kMaxTp] = {nullptr};  // destination of shard g: [Mg, N], leading dimension ldd
  int64_t ldd = 0;

  // ---- FP8 scales (ScaleMode above): out = (x @ W^T) * a_scale(row) * b_scale(col) + bias. A shard's A scales
  // start at a_scale + shard * a_scale_shard_stride; the own shard's (own_shard) at a_scale_own where set.
  ScaleMode a_scale_mode = ScaleMode::kNone;
  const float* a_scale = nullptr;
  int64_t a_scale_shard_stride = 0;
  const float* a_scale_own = nullptr;
  ScaleMode b_scale_mode = ScaleMode::kNone;
  const float* b_scale = nullptr;

  // ---- AllGather: per-chunk readiness flags, chunk_flags[g * chunks_per_shard + c] >= epoch
  // (flags: csrc/include/flux/fused_ops.h FlagProtocol; the kernel only compares them with `epoch`)
  const uint32_t* chunk_flags = nullptr;
  int rows_per_chunk = 0;
  int chunks_per_shard = 0;
  // Eager push all-gather (csrc/runtime/ag_gemm.cpp): the kernel's start and end stand in for the fork and join of
  // the comm stream, which would cost the host an event record and a stream wait each. CTA 0's producer sets
  // started_flag = epoch (x is ready: the comm stream waits for it before it copies x); the last CTA to finish
  // (finished_ctas counts them and is 0 between calls) waits for sent_flag >= epoch (the comm stream's transfers,
  // which read x, are complete), then sets every done_out (the peers' done word for this rank) and completion_word
  // to epoch. Null: none of this (the host forks and joins).
  // FP8 rows (mesh order): before started_flag, CTA 0's producer warp copies this rank's scale_push_count x scales
  // from scale_push_src into scale_push_dst[q], its slot in peer q's scale region (null for itself), so that every
  // chunk flag the comm stream writes after its wait for started follows them and no copy call carries them.
  uint32_t* started_flag = nullptr;
  const float* scale_push_src = nullptr;
  float* scale_push_dst[kMaxTp] = {nullptr};
  int scale_push_count = 0;
  const uint32_t* sent_flag = nullptr;
  uint32_t* finished_ctas = nullptr;
  uint32_t* done_out[kMaxTp] = {nullptr};
  uint32_t* completion_word = nullptr;

  // ---- ReduceScatter
  int rs_own_shard = -1;  // shard of this rank's rows (the output; bias added there); -1: not a reduce-scatter
  // Shards whose tiles add partials from this rank's receive slots before their store: the own shard and, in a
  // two-level plan (RsTwoLevel, workspace_layout.h), the blocks this rank collects for its node. Bit g: shard g.
  uint32_t rs_reduce_mask = 0;
  // The partials, in one array of this rank's receive slots: reduced shard g adds rs_partials[rs_first_partial[g]
  // .. + rs_partial_count[g]) in that order (deterministic), each after its flags rs_partial_flags[s][chunk].
  const void* rs_partials[kMaxTp] = {nullptr};
  int rs_num_partials = 0;
  const uint32_t* rs_partial_flags[kMaxTp] = {nullptr};
  int8_t rs_first_partial[kMaxTp] = {0};
  int8_t rs_partial_count[kMaxTp] = {0};
  // The rank slot s comes from (its writer, or the collector that sent it): its call signature is compared after
  // the first flag of the slot where signature_sources says it signs, and a timeout names it.
  int8_t rs_partial_source[kMaxTp] = {0};
  uint32_t rs_partial_staged_grid = 0;  // bit s: slot s's flags are per chunk of the staged grid (below)
  // Shards whose tiles are staged locally and counted (bit g: copy-engine and external transports, every peer's;
  // two-level: the collected blocks): d[g] is this rank's staging slot for g, and every finished tile adds 1 to
  // rs_stage_counters[g * rs_flags_per_source + chunk of the staged grid]; the copy engine or the caller waits
  // for a chunk's count and moves it. The other shards' tiles go straight into their destination's slot (d[g])
  // and raise its flag there, rs_signal[g][chunk of the signal grid].
  uint32_t rs_staged_mask = 0;
  uint32_t* rs_stage_counters = nullptr;
  uint32_t* rs_signal[kMaxTp] = {nullptr};
  // Shard g's destination rank (the owner, or in a two-level plan the node's collector): before the first tile
  // into its slots, rs_consumed[rs_dest[g]] >= epoch-1 (its previous call read them: epilogue stores, epoch flags;
  // null when a host-side stream already waited), and rs_signature_out[g] (its signature slot for this rank; null:
  // the host writes it, or there is none) is written.
  int8_t rs_dest[kMaxTp] = {0};
  const uint32_t* rs_consumed = nullptr;
  uint32_t* rs_signature_out[kMaxTp] = {nullptr};
  int rs_flags_per_source = 0;  // capacity of each source's flag array (one flag per chunk must fit)
  // Chunks: the unit a flag or a count covers. Tile (m, n) of a shard lies in chunk rs_chunk_index(m, n, ...)
  // (tile_schedule.cuh) of a grid the host sets from its RsChunkGrid: the signal grid (a tile per chunk: the
  // epilogue transport's stores) and the staged grid (the copy engine's or the caller's chunks); where only one
  // applies both are the same.
  int rs_chunk_tiles_m = 0;
  int rs_chunk_tiles_n = 0;
  int rs_chunks_n = 0;
  int rs_staged_chunk_tiles_m = 0;
  int rs_staged_chunk_tiles_n = 0;
  int rs_staged_chunks_n = 0;

  // ---- synchronisation common to both
  uint32_t epoch = 0;
  uint64_t timeout_ns = 0;
  int* error_record = nullptr;  // host-mapped int[kErrorRecordWords]: the first failure (see kErrorRecordWords)
  int* error_claim = nullptr;   // device int: claimed (non-zero) by the first waiter that fails
  int rank = 0;
  // Call signatures (kSignatureWords): peer_signatures[s * kSignatureWords + i] is what rank s wrote here for its
  // call; after a flag of rank s's, the kernel compares it with `signature` where bit s of signature_sources is set.
  const uint32_t* peer_signatures = nullptr;
  uint32_t signature_sources = 0;
  uint32_t signature[kSignatureWords] = {0, 0, 0};
  // This rank's flag words that its stream and kernel waits read (null: none). The waiter that claims the error
  // record sets them all to their maximum from the device, and so does a call that starts on a workspace that
  // already failed: every wait queued behind it returns without the host, even where a blocked stream wait holds
  // the only hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) and the host's release could not get through.
  uint32_t* release_words = nullptr;
  int64_t release_count = 0;
  // Host-mapped [release_count] (null: none): the waiter that claims the error record copies release_words here
  // before it releases them, so the host can tell every peer this rank still waited for (a peer named by a timeout
  // may itself be stuck behind another; WorkspaceState::describe_record).
  uint32_t* release_snapshot = nullptr;

  // ---- launch
  LaunchOptions launch;
};

// Bytes of split_workspace that any launch on a device with `sm_count` SMs can use: one flag and one fp32
// tile of partials per CTA (no tile configuration has more than 32768 accumulators per CTA).
constexpr int64_t kSplitTileFloats = 128 * 256;
inline int64_t split_flags_bytes(int ctas) { return (int64_t(ctas) * 4 + 255) / 256 * 256; }
inline int64_t split_workspace_bytes(int ctas) {
  return split_flags_bytes(ctas) + int64_t(ctas) * kSplitTileFloats * 4;
}

}  // namespace flux
