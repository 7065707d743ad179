// GEMM + ReduceScatter. The persistent GEMM walks the destination shards rank+1, rank+2, ..., own rows last;
// a tile of own rows waits for the peers' flags and adds their partials in rank order, so the result is the
// same bits on every run. How a peer's partial reaches it is the transport:
//
//   epilogue        : the epilogue stores each tile of a peer's rows straight into that peer's receive slot
//                     (NVLink P2P) and raises a per-tile flag there;
//   copy engine     : the epilogue stores it into a local staging area (tp - 1 slots, one per peer in shard
//                     order) and counts it into its chunk (a panel of the tile schedule x a strip of
//                     columns, so chunks complete one after another); a comm stream per peer waits for each
//                     chunk's count, copies it into the peer's receive slot and raises the peer's flag for
//                     it. The SMs never wait on NVLink.
//   external        : the kernel as with the copy engine, but the caller moves the chunks (the NCCL transport,
//                     flux_layers/runtime/multinode/nccl_rs_transport.py) on comm[0], its transfer stream, forked here
//                     after the counts are cleared and before the kernel: per chunk it waits for the count, sends the
//                     chunk, receives the peer's partial of our rows into our receive slot and raises our flag for
//                     it. Chunks are full-width (chunk_cols = N), so each is contiguous rows in both slots, which
//                     NCCL sends in place. No handshake and no write to a peer: the receives are posted on a stream
//                     that follows our previous call's GEMM, so nothing lands in a slot still being read.
//
//   two-level       : (the hybrid transport; RsTwoLevel, workspace_layout.h) the epilogue stores a tile of a
//                     block of this node into its owner's slot, and one of another node's block into the slot of
//                     this node's collector of it; the collector adds the node's partials of the blocks it
//                     collects and stages the sum (counted per full-width chunk), which the caller sends on comm[0]
//                     (forked as for external transfers) to the owner, where it lands in the collector's slot and
//                     the caller raises its flag per chunk. The owner adds its node's partials, then the other
//                     nodes' node partials in node order.
//
// After the kernel, consumed[r] = e is written at every peer (not external; two-level: at the node's peers, with the
// call's end that the caller enqueues after its transfers, end_external_gemm_rs): our receive slots are free again.
// CUDA-graph protocol (FlagProtocol, e = 1): consumed[d] is waited for on a stream and cleared at once (for
// the epilogue transport on the compute stream before the kernel, which then skips its own wait); our tile flags are
// cleared after the kernel, before consumed is written (a peer sets them again only after it saw that write).
// Flag words of one rank: flag[src][flags_per_source] (set for us by src), consumed[tp] (set by each peer),
// count[dst][flags_per_source] (our tiles of dst's rows per chunk; copy-engine transport, cleared per call),
// sig[src][kSignatureWords] (src's call signature, gemm_params.h): RsFlagLayout (workspace_layout.h).
// Call signatures: before its first flag at a destination, a rank writes its signature into the destination's
// slot for it (epilogue transport: each CTA, after its consumed wait; copy engine: in one batch with the first chunk's
// flag), and the destination's kernel compares it with its own after each partial's flag. Not external.
#include <cuda_runtime.h>  // before tile_schedule.cuh: defines __host__ / __device__ for the host compiler

#include <algorithm>

#include "../kernels/tile_schedule.cuh"
#include "flux/check.h"
#include "flux/fused_ops.h"

namespace flux {

void rs_shard_order(int rank, int tp, int* shard_order) {
  for (int s = 0; s < tp; ++s) shard_order[s] = (rank + 1 + s) % tp;
}

void check_gemm_rs_args(const GemmRsArgs& a) {
  FLUX_CHECK(a.tp >= 2 && a.tp <= kMaxTp, "tp ", a.tp, " outside [2, ", kMaxTp, "]");
  FLUX_CHECK(a.rank >= 0 && a.rank < a.tp, "rank ", a.rank, " outside [0, ", a.tp, ")");
  FLUX_CHECK(a.slot_rows > 0 && a.flags_per_source > 0, "the workspace holds no receive slot or flags");
  FLUX_CHECK(a.events != nullptr, "the workspace's events are missing");
  bool const graph = a.protocol == FlagProtocol::kCudaGraph;
  bool const two_level = a.node_size > 0;
  bool const caller_moves = a.external || two_level;  // the caller moves (some) staged partials on comm[0]
  bool const copy_engine = a.stage != nullptr && !caller_moves;
  FLUX_CHECK(!(copy_engine || caller_moves) || a.num_comm >= 1, "the copy-engine and external transports need a ",
             "communication stream");
  FLUX_CHECK(!caller_moves || a.stage != nullptr, "external transfers need the local staging area");
  FLUX_CHECK(!caller_moves || !graph, "external transfers run under the epoch protocol only");
  FLUX_CHECK(!two_level || (a.node_size < a.tp && a.tp % a.node_size == 0), "a two-level plan needs nodes of ",
             a.node_size, " ranks to divide the group of ", a.tp, " into two or more");
  for (int q = 0; q < a.tp; ++q) {
    bool const mapped = q == a.rank || (two_level ? q / a.node_size == a.rank / a.node_size : !a.external);
    FLUX_CHECK(!mapped || (a.recv[q] != nullptr && a.flags[q] != nullptr), "rank ", q,
               "'s receive buffer or flags are not mapped (a workspace in local memory serves external transfers "
               "only; a two-level plan's, mapped inside the node, two-level ones)");
  }
}

void end_external_gemm_rs(const GemmRsArgs& a) {
  bool const two_level = a.node_size > 0;
  FLUX_CHECK(a.external || two_level, "only a call whose caller moves the partials (external or two-level) ends apart");
  // Two-level: our slots are free again for the node's peers (the caller's receives of the next call follow this
  // call's kernel by the fork). Both: the call is complete for the watchdog; partials that never arrive make the
  // GEMM's own waits time out. One batch.
  RsFlagLayout const layout{a.tp, a.flags_per_source};
  FlagOp done[kMaxFlagOps];
  int n = 0;
  if (two_level)
    for (int q = a.rank / a.node_size * a.node_size; q < (a.rank / a.node_size + 1) * a.node_size; ++q)
      if (q != a.rank) done[n++] = {a.flags[q] + layout.consumed(0) + a.rank, a.epoch};
  if (a.completion != nullptr) done[n++] = {CompletionRing::word(a.completion, a.epoch), a.epoch};
  if (n > 0) stream_write_u32_all(a.compute, done, n);
}

void gemm_rs(const GemmRsArgs& a) {
  if (a.rows_per_shard == 0) return;
  bool const graph = a.protocol == FlagProtocol::kCudaGraph;
  bool const two_level = a.node_size > 0;
  bool const external = a.external;  // a two-level plan's workspace sets node_size instead
  bool const copy_engine = a.stage != nullptr && !external && !two_level;
  const int r = a.rank;
  const size_t elem = size_t(dtype_bytes(a.dtype));  // partials travel in the output dtype
  const size_t slot_bytes = size_t(a.slot_rows) * a.n * elem;
  RsFlagLayout const layout{a.tp, a.flags_per_source};
  int const transport = int(two_level     ? RsTransport::kHybrid
                            : copy_engine ? RsTransport::kCopyEngine
                                          : RsTransport::kEpilogue);
  uint32_t const signature[kSignatureWords] = {a.epoch, uint32_t(a.rows_per_shard),
                                               signature_shape_word(1, int(a.layout), transport, a.k)};
  auto signature_slot = [&](int d) { return a.flags[d] + layout.signature(r); };
  auto consumed = [&](int q) { return a.flags[q] + layout.consumed(0); };
  uint32_t* const counts = a.flags[r] + layout.count(0, 0);
  // Stream-side wait for peer d to have finished reading its receive slots (its previous call).
  auto wait_consumed = [&](cudaStream_t s, int d) {
    if (graph) {
      stream_wait_u32_geq(s, consumed(r) + d, 1);
      stream_write_u32(s, consumed(r) + d, 0);
    } else if (a.epoch > 1) {
      stream_wait_u32_geq(s, consumed(r) + d, a.epoch - 1);
    }
  };

  GemmProblem g;
  g.rows_per_shard = a.rows_per_shard;
  g.n = a.n;
  g.k = a.k;
  g.num_shards = a.tp;
  RsTwoLevel const roles = two_level ? RsTwoLevel::make(r, a.tp, a.node_size) : RsTwoLevel{};
  if (two_level) {
    std::copy(roles.shard_order, roles.shard_order + a.tp, g.shard_order);
  } else {
    rs_shard_order(r, a.tp, g.shard_order);
  }
  g.own_shard = -1;
  g.a = a.x;  // shard d = rows [d * Mg, (d + 1) * Mg) of x
  g.lda = a.ldx;
  g.a_shard_stride = int64_t(a.rows_per_shard) * a.ldx;
  g.b = a.w;
  g.ldb = a.ldw;
  g.bias = a.bias;
  // Staging slot of destination d (copy engine): its step in the shard order, so tp - 1 slots serve every rank.
  auto stage_slot = [&](int d) { return a.stage + size_t(RsFlagLayout::stage_slot(r, a.tp, d)) * slot_bytes; };
  bool const staged = copy_engine || external;  // every peer's tiles staged (two-level: the collected blocks')
  g.ldd = a.n;
  g.rs_own_shard = r;
  if (two_level) {
    // RsTwoLevel's routes: a block of this node to its owner's slot r, another node's to this node's collector
    // of it (its slot of the block's node and our local index), a collected one staged; the reduced blocks add
    // their slots in its order, the node partials' flags per chunk of the staged grid.
    g.rs_staged_mask = roles.collected;
    for (int d = 0; d < a.tp; ++d) {
      int const dest = roles.dest[d];
      g.d[d] = d == r     ? a.out
               : dest < 0 ? static_cast<void*>(stage_slot(d))
                          : static_cast<void*>(a.recv[dest] + size_t(roles.dest_slot[d]) * slot_bytes);
      g.rs_dest[d] = int8_t(dest < 0 ? d : dest);
      if (dest >= 0) {
        g.rs_signal[d] = a.flags[dest] + layout.flag(roles.dest_slot[d], 0);
        g.rs_signature_out[d] = a.flags[dest] + layout.signature(r);
      }
      g.rs_first_partial[d] = int8_t(roles.first_partial[d]);
      g.rs_partial_count[d] = int8_t(roles.partial_count[d]);
      if (roles.partial_count[d] > 0) g.rs_reduce_mask |= 1u << d;
    }
    g.rs_num_partials = roles.num_partials;
    for (int s = 0; s < roles.num_partials; ++s) {
      g.rs_partials[s] = a.recv[r] + size_t(roles.partial_slot[s]) * slot_bytes;
      g.rs_partial_flags[s] = a.flags[r] + layout.flag(roles.partial_slot[s], 0);
      g.rs_partial_source[s] = int8_t(roles.partial_source[s]);
    }
    g.rs_partial_staged_grid = roles.from_caller;
  } else {
    for (int d = 0; d < a.tp; ++d) {
      char* peer_slot = staged ? stage_slot(d) : a.recv[d] + size_t(r) * slot_bytes;
      g.d[d] = d == r ? a.out : static_cast<void*>(peer_slot);
      g.rs_dest[d] = int8_t(d);
      if (staged && d != r) g.rs_staged_mask |= 1u << d;
    }
    int i = 0;
    for (int src = 0; src < a.tp; ++src) {
      if (src == r) continue;
      g.rs_partials[i] = a.recv[r] + size_t(src) * slot_bytes;
      g.rs_partial_flags[i] = a.flags[r] + layout.flag(src, 0);
      g.rs_partial_source[i] = int8_t(src);
      ++i;
    }
    g.rs_num_partials = i;
    g.rs_reduce_mask = 1u << r;
    g.rs_first_partial[r] = 0;
    g.rs_partial_count[r] = int8_t(i);
    if (!external)  // staged tiles are counted, not signalled; a peer's flags may not be mapped
      for (int d = 0; d < a.tp; ++d) g.rs_signal[d] = a.flags[d] + layout.flag(r, 0);
  }
  g.rs_consumed = graph || external ? nullptr : consumed(r);
  g.rs_flags_per_source = a.flags_per_source;
  g.epoch = a.epoch;
  g.timeout_ns = a.timeout_ns;
  g.error_record = a.error_record;
  g.error_claim = a.error_claim;
  g.rank = r;
  g.launch = a.launch;
  // FP8: each rank scales its own partials (shard g = the rows x holds for destination g).
  g.a_scale_mode = a.x_scale_mode;
  g.a_scale = a.x_scale;
  g.a_scale_shard_stride = a.x_scale_mode == ScaleMode::kPerRow ? a.rows_per_shard : 0;
  g.b_scale_mode = a.w_scale_mode;
  g.b_scale = a.w_scale;
  g.release_words = a.flags[r];  // flag, consumed and count: every word a wait of this rank reads
  g.release_count = layout.release_words();
  g.release_snapshot = a.flags_snapshot;
  if (!external) {  // two-level: the node's peers sign their calls (the caller's transfers carry no signature)
    g.peer_signatures = a.flags[r] + layout.signature(0);
    for (int q = 0; q < a.tp; ++q)
      if (q != r && (!two_level || q / a.node_size == r / a.node_size)) g.signature_sources |= 1u << q;
    std::copy(signature, signature + kSignatureWords, g.signature);
    if (!copy_engine && !two_level)
      for (int d = 0; d < a.tp; ++d)
        if (d != r) g.rs_signature_out[d] = signature_slot(d);
  }

  cudaEvent_t* const ev = a.events;
  TileSchedule const sched = TileSchedule::make(g, tile_m(a.tile), tile_n(a.tile), kClusterM);
  // The signal grid (per tile: the epilogue's stores) and the staged grid (the copy engine's chunks, or the
  // caller's: full-width); a one-level transport uses one of them for everything.
  RsChunkGrid const per_tile = RsChunkGrid::per_tile(sched, a.rows_per_shard, tile_m(a.tile), tile_n(a.tile));
  RsChunkGrid const chunked = RsChunkGrid::make(sched, a.rows_per_shard, tile_m(a.tile), tile_n(a.tile),
                                                external || two_level ? a.n : a.chunk_cols);
  RsChunkGrid const grid = staged ? chunked : per_tile;
  RsChunkGrid const signal_grid = two_level ? per_tile : grid;
  RsChunkGrid const staged_grid = two_level ? chunked : grid;
  g.rs_chunk_tiles_m = signal_grid.chunk_tiles_m;
  g.rs_chunk_tiles_n = signal_grid.chunk_tiles_n;
  g.rs_chunks_n = signal_grid.chunks_n;
  g.rs_staged_chunk_tiles_m = staged_grid.chunk_tiles_m;
  g.rs_staged_chunk_tiles_n = staged_grid.chunk_tiles_n;
  g.rs_staged_chunks_n = staged_grid.chunks_n;
  if (staged || two_level) {
    g.rs_stage_counters = counts;
    // The previous call's copies (or sends) of the staging area finished before its end (joined below, or by the
    // caller for external transfers).
    FLUX_CUDA_CHECK(cudaMemsetAsync(counts, 0, size_t(a.tp) * a.flags_per_source * 4, a.compute));
    FLUX_CUDA_CHECK(cudaEventRecord(ev[0], a.compute));
    // External and two-level: the caller's transfer stream starts after the counts are cleared (its waits must not
    // see the previous call's counts) and before the kernel (the kernel waits for what that stream receives).
    if (external || two_level) FLUX_CUDA_CHECK(cudaStreamWaitEvent(a.comm[0], ev[0], 0));
  } else if (graph) {
    FlagOp waits[kMaxFlagOps];
    int n = 0;
    for (int d = 0; d < a.tp; ++d)
      if (d != r) waits[n++] = {consumed(r) + d, 1};
    stream_wait_u32_geq_all(a.compute, waits, n);
    for (int i = 0; i < n; ++i) waits[i].value = 0;
    stream_write_u32_all(a.compute, waits, n);
  }
  // The kernel goes first: its counts are what the copy streams wait on, and with a single hardware queue
  // (CUDA_DEVICE_MAX_CONNECTIONS=1) a wait queued ahead of it would never be released.
  launch_gemm(g, a.types, a.layout, a.tile, a.compute);

  // External and two-level: the caller joins its transfer stream and then enqueues the call's end
  // (end_external_gemm_rs), as the all-gather does (ag_gemm.cpp): a stream write here would wait for the GEMM and,
  // under a single hardware queue, the transfers the GEMM waits for did not run behind one.
  if (external || two_level) return;

  if (copy_engine) {
    const size_t row_bytes = size_t(a.n) * elem;
    for (int step = 0; step + 1 < a.tp; ++step) {
      int const d = g.shard_order[step];
      cudaStream_t s = a.comm[step % a.num_comm];
      FLUX_CUDA_CHECK(cudaStreamWaitEvent(s, ev[0], 0));
      wait_consumed(s, d);
      for (int cm = 0; cm < grid.chunks_m; ++cm) {
        int const row0 = cm * grid.chunk_tiles_m * grid.tile_m;
        int const rows = std::min(a.rows_per_shard, row0 + grid.chunk_tiles_m * grid.tile_m) - row0;
        for (int cn = 0; cn < grid.chunks_n; ++cn) {
          int const col0 = cn * grid.chunk_tiles_n * grid.tile_n;
          int const cols = std::min(a.n, col0 + grid.chunk_tiles_n * grid.tile_n) - col0;
          int const c = grid.index(cm, cn);
          size_t const offset = size_t(row0) * row_bytes + size_t(col0) * elem;
          stream_wait_u32_geq(s, a.flags[r] + layout.count(d, c), grid.tiles_in(cm, cn));
          FLUX_CUDA_CHECK(cudaMemcpy2DAsync(a.recv[d] + size_t(r) * slot_bytes + offset, row_bytes,
                                            stage_slot(d) + offset, row_bytes, size_t(cols) * elem, rows,
                                            cudaMemcpyDefault, s));
          uint32_t* const flag = a.flags[d] + layout.flag(r, c);
          if (cm == 0 && cn == 0) {  // the first flag at d: after our signature there, in one batch
            stream_write_signed_flag(s, signature_slot(d), signature, flag, a.epoch);
          } else {
            stream_write_u32(s, flag, a.epoch);
          }
        }
      }
    }
    // Join: the next call may overwrite the staging area and clear the counts.
    for (int j = 0; j < std::min(a.num_comm, a.tp - 1); ++j) {
      FLUX_CUDA_CHECK(cudaEventRecord(ev[1 + j], a.comm[j]));
      FLUX_CUDA_CHECK(cudaStreamWaitEvent(a.compute, ev[1 + j], 0));
    }
  }

  if (graph) FLUX_CUDA_CHECK(cudaMemsetAsync(a.flags[r], 0, size_t(a.tp) * a.flags_per_source * 4, a.compute));
  // Our receive slots are free again (at every peer), and the call is complete (for the watchdog): one batch.
  FlagOp done[kMaxFlagOps];
  int n = 0;
  for (int q = 0; q < a.tp; ++q)
    if (q != r) done[n++] = {consumed(q) + r, a.epoch};
  if (a.completion != nullptr) done[n++] = {CompletionRing::word(a.completion, a.epoch), a.epoch};
  stream_write_u32_all(a.compute, done, n);
}

}  // namespace flux
