// AllGather + GEMM: copy-engine transfers driven from the host, per-chunk epoch flags, and the persistent
// GEMM that waits on exactly the chunk its A tile reads (csrc/kernels/gemm_sm90.cuh).
//
// One call, rank r, epoch e (flags: AgFlagLayout; under the CUDA-graph protocol e = 1, see FlagProtocol).
// Every wait here is on this rank's own memory; writes may go to a peer (P2P-mapped symmetric memory).
//   push (default): comm[0] waits done[p] >= e-1 for all p (every peer's previous GEMM stopped reading its
//                   buffer); then per peer, per chunk: copy our shard into the peer's buffer (copy engine),
//                   chunk[r][c] = e at the peer. Ring: send ours right, forward r-1, r-2, ... as they arrive.
//   pull          : compute waits done[p] >= e-1, stages our shard into our buffer (same-device copy, which
//                   may need SMs, hence before the GEMM) and announces avail[r][c] = e to our pullers; comm
//                   streams wait avail[p][c], copy from p (mesh) or the left neighbour (ring), chunk[p][c] = e.
//   compute       : the persistent GEMM (own shard at once; peers' tiles wait on chunk flags), then joins the
//                   comm streams and writes done[r] = e at every peer.
// Eager push: the GEMM itself forks and joins comm[0] (each host-side fork or join costs the host an event record
// and a stream wait, ~3 us on the lent VMs): CTA 0's producer sets started = e, which comm[0] waits for in the
// batch of its done waits; comm[0] sets sent = e after its last transfer (in the batch of its last flag where it
// can), and the GEMM's last CTA waits for that, then writes done[r] = e at every peer and the completion word.
// FP8 rows: a shard's scales reach each rank's scale region ahead of the shard's first chunk flag there, in the half
// of the epoch's parity (AgGemmArgs::scales). Eager push, mesh: the GEMM's CTA 0 stores ours into every peer before
// it sets started (GemmProblem::scale_push_dst), so no copy call carries them; otherwise a copy on the stream that
// carries the chunk.
// CUDA-graph protocol: done[p] is waited for >= 1 and cleared at once; chunk and avail are cleared after the
// join, before done is written (a peer sets them again only after it saw that write).
//   external      : the caller moves the chunks (FP8 rows: and their scales, into our scale region's half for e)
//                   and sets chunk[g][c] = e in our flags (the NCCL and hybrid transports); the
//                   op launches the GEMM alone (local buffer, local flags; CUDA-graph protocol: the chunk flags
//                   are cleared after it on the compute stream).
// Call signatures (gemm_params.h): the first flag a rank writes at a peer in a call (a chunk flag when pushing, an
// avail flag when pulled from) goes in one batch after its signature writes into the peer's sig slot for it, so the
// peer's GEMM, which waits for that flag or one written after it, compares signatures after a wait that passed.
// Mesh: every rank compares every peer's; ring: its left neighbour's (the ranks compare pairwise around the ring).
// A rank writes the slot again only after the peer's done of the previous call, as it does the data.
#include <algorithm>

#include "flux/check.h"
#include "flux/fused_ops.h"

namespace flux {

void ag_shard_order(int rank, int tp, AgOrder order, int* shard_order) {
  for (int s = 0; s < tp; ++s) shard_order[s] = order == AgOrder::kMesh ? (rank + s) % tp : (rank - s + tp) % tp;
}

namespace {

struct AgCall {
  const AgGemmArgs& a;
  AgFlagLayout flags;
  int chunks;
  size_t row_bytes;
  uint32_t signature[kSignatureWords];

  // Byte address of rows [row, ...) of shard g in rank q's gathered buffer (compact for this call's M).
  char* region(int q, int g, int row) const { return a.buffers[q] + (size_t(g) * a.rows_per_shard + row) * row_bytes; }
  int chunk_begin(int c) const { return c * a.rows_per_chunk; }
  int chunk_rows(int c) const { return std::min(a.rows_per_chunk, a.rows_per_shard - c * a.rows_per_chunk); }
  uint32_t* flag(int q, int64_t index) const { return a.flags[q] + index; }
  uint32_t* my(int64_t index) const { return a.flags[a.rank] + index; }

  // The GEMM forks and joins comm[0] (see the top of this file).
  bool kernel_forks() const { return a.mode == AgMode::kPush && !graph() && a.run_gemm; }

  // Comm streams this call issues work on (the others are neither forked nor joined: each fork or join is an event
  // record and wait that the GPU pays for on every call).
  int streams_used() const {
    if (a.order == AgOrder::kRing) return 1;
    int streams = a.tp - 1;
    if (a.mode == AgMode::kPush && chunks > 1 && a.num_comm >= 2 * (a.tp - 1)) streams *= 2;  // see push()
    return std::min(streams, a.num_comm);
  }

  // The GEMM stores our scales into the peers' regions at its start (see the top of this file).
  bool kernel_pushes_scales() const { return kernel_forks() && scaled() && a.order == AgOrder::kMesh; }

  // push(): comm[0]'s last flag write also sets our sent word (nothing follows it on comm[0]).
  bool sent_with_last_flag() const { return kernel_forks() && streams_used() == 1 && a.gathered_out == nullptr; }

  // Flag `index` = epoch at rank q; the first one of a stream at q after our signature in q's slot for us; `sent`:
  // then our sent word, in the same batch (the stream's last operation).
  void flag_at(cudaStream_t s, int q, int64_t index, bool first, bool sent = false) const {
    FlagOp ops[kSignatureWords + 2];
    int n = 0;
    if (first)
      for (int i = 0; i < kSignatureWords; ++i) ops[n++] = {flag(q, flags.signature(a.rank)) + i, signature[i]};
    ops[n++] = {flag(q, index), a.epoch};
    if (sent) ops[n++] = {my(flags.sent()), a.epoch};
    stream_write_u32_all(s, ops, n);
  }

  void copy_rows(cudaStream_t s, char* dst, const char* src, size_t src_pitch, int rows) const {
    if (src_pitch == row_bytes) {
      FLUX_CUDA_CHECK(cudaMemcpyAsync(dst, src, rows * row_bytes, cudaMemcpyDefault, s));
    } else {
      FLUX_CUDA_CHECK(cudaMemcpy2DAsync(dst, row_bytes, src, src_pitch, row_bytes, rows, cudaMemcpyDefault, s));
    }
  }
  bool graph() const { return a.protocol == FlagProtocol::kCudaGraph; }

  // Start of a call on stream s: every peer finished its previous call (stopped reading its buffer, which we
  // are about to write, and writing ours). One batch of waits (and of clears) for all peers.
  // Where the GEMM forks the stream, the same batch waits for its start.
  void wait_peers_done(cudaStream_t s) const {
    FlagOp ops[kMaxFlagOps] = {};
    int n = 0;
    if (graph() || a.epoch > 1)
      for (int q = 0; q < a.tp; ++q)
        if (q != a.rank) ops[n++] = {my(flags.done(q)), graph() ? 1u : a.epoch - 1};
    if (kernel_forks()) ops[n++] = {my(flags.started()), a.epoch};
    stream_wait_u32_geq_all(s, ops, n);
    if (!graph()) return;
    for (int i = 0; i < n; ++i) ops[i].value = 0;
    stream_write_u32_all(s, ops, n);
  }

  // End of a call on stream s, after everything that reads our flags: release the peers' next call, and mark the
  // call complete for the watchdog, in one batch of writes.
  void signal_done(cudaStream_t s) const {
    if (graph()) FLUX_CUDA_CHECK(cudaMemsetAsync(my(0), 0, size_t(flags.data_words()) * 4, s));
    FlagOp ops[kMaxFlagOps];
    int n = 0;
    for (int q = 0; q < a.tp; ++q)
      if (q != a.rank) ops[n++] = {flag(q, flags.done(a.rank)), a.epoch};
    if (a.completion != nullptr) ops[n++] = {CompletionRing::word(a.completion, a.epoch), a.epoch};
    stream_write_u32_all(s, ops, n);
  }

  const char* x_rows(int row) const { return static_cast<const char*>(a.x) + size_t(row) * a.ldx * (row_bytes / a.k); }
  size_t x_pitch() const { return size_t(a.ldx) * (row_bytes / a.k); }

  // FP8 scales (AgGemmArgs::x_scale): a shard's scales, one or one per row, at slot g of rank q's scale region (the
  // half of this call's epoch parity).
  bool scaled() const { return a.x_scale_mode != ScaleMode::kNone; }
  bool row_scales() const { return a.x_scale_mode == ScaleMode::kPerRow; }
  int scales_per_shard() const { return row_scales() ? a.rows_per_shard : 1; }
  float* scale_slot(int q, int g) const {
    return a.scales[q] + ag_scale_index(a.scale_half, a.epoch, g, scales_per_shard());
  }
  // Before chunk c of a shard on a stream, the scales that chunk's tiles read: a row-wise shard's scales of the
  // chunk's rows, or a shard's one scale ahead of the stream's first chunk (`first`). Stream order puts them ahead
  // of the chunk's flag, which the GEMM waits for before it reads them.
  void copy_scales(cudaStream_t s, float* dst_slot, const float* src_slot, int c, bool first) const {
    if (!scaled() || (!row_scales() && !first) || kernel_pushes_scales()) return;
    size_t const offset = row_scales() ? size_t(chunk_begin(c)) : 0;
    size_t const count = row_scales() ? size_t(chunk_rows(c)) : 1;
    FLUX_CUDA_CHECK(cudaMemcpyAsync(dst_slot + offset, src_slot + offset, count * sizeof(float), cudaMemcpyDefault, s));
  }
};

// Pull modes: stage our shard into our buffer (unless the caller wrote x there) and announce each chunk to
// the ranks that pull from us.
void stage_own(const AgCall& p, bool x_in_buffer, cudaStream_t stage) {
  const AgGemmArgs& a = p.a;
  const int r = a.rank, tp = a.tp, right = (r + 1) % tp;
  if (p.scaled())  // the whole shard's scales, ahead of every avail flag
    FLUX_CUDA_CHECK(cudaMemcpyAsync(p.scale_slot(r, r), a.x_scale, size_t(p.scales_per_shard()) * sizeof(float),
                                    cudaMemcpyDefault, stage));
  for (int c = 0; c < p.chunks; ++c) {
    if (!x_in_buffer)
      p.copy_rows(stage, p.region(r, r, p.chunk_begin(c)), p.x_rows(p.chunk_begin(c)), p.x_pitch(), p.chunk_rows(c));
    if (a.order == AgOrder::kMesh) {
      for (int q = 0; q < tp; ++q)
        if (q != r) p.flag_at(stage, q, p.flags.avail(r, c), c == 0);
    } else {
      p.flag_at(stage, right, p.flags.avail(r, c), c == 0);
    }
  }
}

void pull(const AgCall& p) {
  const AgGemmArgs& a = p.a;
  const int r = a.rank, tp = a.tp, right = (r + 1) % tp, left = (r - 1 + tp) % tp;
  if (a.order == AgOrder::kMesh) {
    for (int o = 1; o < tp; ++o) {
      int src = (r + o) % tp;
      cudaStream_t s = a.comm[(o - 1) % a.num_comm];
      for (int c = 0; c < p.chunks; ++c) {
        stream_wait_u32_geq(s, p.my(p.flags.avail(src, c)), a.epoch);
        p.copy_scales(s, p.scale_slot(r, src), p.scale_slot(src, src), c, c == 0);
        p.copy_rows(s, p.region(r, src, p.chunk_begin(c)), p.region(src, src, p.chunk_begin(c)), p.row_bytes,
                    p.chunk_rows(c));
        stream_write_u32(s, p.my(p.flags.chunk(src, c)), a.epoch);
      }
    }
  } else {
    cudaStream_t s = a.comm[0];
    for (int step = 1; step < tp; ++step) {
      int g = (r - step + tp) % tp;
      for (int c = 0; c < p.chunks; ++c) {
        stream_wait_u32_geq(s, p.my(p.flags.avail(g, c)), a.epoch);
        p.copy_scales(s, p.scale_slot(r, g), p.scale_slot(left, g), c, c == 0);
        p.copy_rows(s, p.region(r, g, p.chunk_begin(c)), p.region(left, g, p.chunk_begin(c)), p.row_bytes,
                    p.chunk_rows(c));
        stream_write_u32(s, p.my(p.flags.chunk(g, c)), a.epoch);
        if (step < tp - 1) stream_write_u32(s, p.flag(right, p.flags.avail(g, c)), a.epoch);
      }
    }
  }
}

// Mesh push of a shard with one scale where the GEMM does not push it (CUDA-graph protocol, transfers alone): that
// scale into every peer's slot, on comm[0] before the other comm streams fork from it, so every chunk flag of every
// stream follows it (one copy per peer, not one per stream and peer: a copy costs the host ~5 us).
void push_shard_scale(const AgCall& p, cudaStream_t s0) {
  const AgGemmArgs& a = p.a;
  if (!p.scaled() || p.row_scales() || a.order != AgOrder::kMesh || p.kernel_pushes_scales()) return;
  for (int o = 1; o < a.tp; ++o) {
    int const dst = (a.rank + o) % a.tp;
    FLUX_CUDA_CHECK(cudaMemcpyAsync(p.scale_slot(dst, a.rank), a.x_scale, sizeof(float), cudaMemcpyDefault, s0));
  }
}

void push(const AgCall& p) {
  const AgGemmArgs& a = p.a;
  const int r = a.rank, tp = a.tp, right = (r + 1) % tp;
  if (a.order == AgOrder::kMesh) {
    // With two streams per peer, a peer's chunks alternate between them: the flag write after a copy waits for
    // the copy to complete, and on one stream the next copy would wait for that write, idling the copy engine
    // between chunks (measured: ~8% of the all-gather's bandwidth with 2-4 chunks per shard).
    bool const two_per_peer = a.num_comm >= 2 * (tp - 1);
    for (int o = 1; o < tp; ++o) {
      int dst = (r + o) % tp;
      for (int c = 0; c < p.chunks; ++c) {
        cudaStream_t s = a.comm[(o - 1 + (two_per_peer && c % 2 ? tp - 1 : 0)) % a.num_comm];
        p.copy_scales(s, p.scale_slot(dst, r), a.x_scale, c, false);  // a shard's one scale: push_shard_scale
        p.copy_rows(s, p.region(dst, r, p.chunk_begin(c)), p.x_rows(p.chunk_begin(c)), p.x_pitch(), p.chunk_rows(c));
        // The first flag of each stream carries the signature: the two streams' flags may land in either order.
        bool const first = c < (two_per_peer ? 2 : 1);
        bool const last = o == tp - 1 && c == p.chunks - 1;
        p.flag_at(s, dst, p.flags.chunk(r, c), first, last && p.sent_with_last_flag());
      }
    }
  } else {
    cudaStream_t s = a.comm[0];
    for (int c = 0; c < p.chunks; ++c) {
      p.copy_scales(s, p.scale_slot(right, r), a.x_scale, c, c == 0);
      p.copy_rows(s, p.region(right, r, p.chunk_begin(c)), p.x_rows(p.chunk_begin(c)), p.x_pitch(), p.chunk_rows(c));
      bool const last = tp == 2 && c == p.chunks - 1;  // no shard to forward after ours
      p.flag_at(s, right, p.flags.chunk(r, c), c == 0, last && p.sent_with_last_flag());
    }
    for (int step = 1; step < tp - 1; ++step) {
      int g = (r - step + tp) % tp;
      for (int c = 0; c < p.chunks; ++c) {
        stream_wait_u32_geq(s, p.my(p.flags.chunk(g, c)), a.epoch);
        p.copy_scales(s, p.scale_slot(right, g), p.scale_slot(r, g), c, c == 0);
        p.copy_rows(s, p.region(right, g, p.chunk_begin(c)), p.region(r, g, p.chunk_begin(c)), p.row_bytes,
                    p.chunk_rows(c));
        bool const last = step == tp - 2 && c == p.chunks - 1;
        p.flag_at(s, right, p.flags.chunk(g, c), false, last && p.sent_with_last_flag());
      }
    }
  }
}

// gathered_out = the whole gathered input (and gathered_scale_out its scales), on comm[0] once every chunk is in
// (overlaps the GEMM's tail).
void copy_out_gathered(const AgCall& p, bool own_in_buffer) {
  const AgGemmArgs& a = p.a;
  cudaStream_t s = a.comm[0];
  char* out = static_cast<char*>(a.gathered_out);
  size_t shard_bytes = size_t(a.rows_per_shard) * p.row_bytes;
  size_t const scale_bytes = size_t(p.scales_per_shard()) * sizeof(float);
  for (int g = 0; g < a.tp; ++g) {
    float* scale_out =
        a.gathered_scale_out != nullptr ? a.gathered_scale_out + size_t(g) * p.scales_per_shard() : nullptr;
    if (g == a.rank) {
      if (own_in_buffer)
        p.copy_rows(s, out + g * shard_bytes, p.region(a.rank, g, 0), p.row_bytes, a.rows_per_shard);
      else
        p.copy_rows(s, out + g * shard_bytes, p.x_rows(0), p.x_pitch(), a.rows_per_shard);
      if (scale_out != nullptr)
        FLUX_CUDA_CHECK(cudaMemcpyAsync(scale_out, a.x_scale, scale_bytes, cudaMemcpyDefault, s));
      continue;
    }
    for (int c = 0; c < p.chunks; ++c) stream_wait_u32_geq(s, p.my(p.flags.chunk(g, c)), a.epoch);
    p.copy_rows(s, out + g * shard_bytes, p.region(a.rank, g, 0), p.row_bytes, a.rows_per_shard);
    if (scale_out != nullptr)
      FLUX_CUDA_CHECK(cudaMemcpyAsync(scale_out, p.scale_slot(a.rank, g), scale_bytes, cudaMemcpyDefault, s));
  }
}

// The persistent GEMM of a call: own shard from x at once, the others from our gathered buffer, each tile after
// the flag of the chunk its A tile reads.
GemmProblem gemm_problem(const AgCall& p) {
  const AgGemmArgs& a = p.a;
  GemmProblem g;
  g.rows_per_shard = a.rows_per_shard;
  g.n = a.n;
  g.k = a.k;
  g.num_shards = a.tp;
  if (a.custom_shard_order) {
    std::copy(a.shard_order, a.shard_order + a.tp, g.shard_order);
  } else {
    ag_shard_order(a.rank, a.tp, a.order, g.shard_order);
  }
  g.own_shard = a.rank;
  g.a = a.buffers[a.rank];
  g.lda = a.k;
  g.a_shard_stride = int64_t(a.rows_per_shard) * a.k;
  g.a_own = a.x;
  g.lda_own = a.ldx;
  g.b = a.w;
  g.ldb = a.ldw;
  g.bias = a.bias;
  for (int q = 0; q < a.tp; ++q)
    g.d[q] = static_cast<char*>(a.out) + size_t(q) * a.rows_per_shard * a.n * dtype_bytes(a.types.out);
  g.ldd = a.n;
  g.chunk_flags = p.my(p.flags.chunk(0, 0));
  g.rows_per_chunk = a.rows_per_chunk;
  g.chunks_per_shard = a.chunk_capacity;
  g.epoch = a.epoch;
  g.timeout_ns = a.timeout_ns;
  g.error_record = a.error_record;
  g.error_claim = a.error_claim;
  g.rank = a.rank;
  g.release_words = p.my(0);  // chunk, avail and done: every word a wait of this rank reads
  g.release_count = p.flags.release_words();
  g.release_snapshot = a.flags_snapshot;
  if (a.mode != AgMode::kExternal) {  // external transfers: no peer writes here, nothing to compare
    g.peer_signatures = p.my(p.flags.signature(0));
    int const left = (a.rank - 1 + a.tp) % a.tp;
    for (int q = 0; q < a.tp; ++q)
      if (q != a.rank && (a.order == AgOrder::kMesh || q == left)) g.signature_sources |= 1u << q;
    std::copy(p.signature, p.signature + kSignatureWords, g.signature);
  }
  if (p.scaled()) {  // each source's scales from our scale region, our own from x_scale
    g.a_scale_mode = a.x_scale_mode;
    g.a_scale = p.scale_slot(a.rank, 0);
    g.a_scale_shard_stride = p.scales_per_shard();
    g.a_scale_own = a.x_scale;
  }
  if (p.kernel_pushes_scales()) {
    g.scale_push_src = a.x_scale;
    g.scale_push_count = p.scales_per_shard();
    for (int q = 0; q < a.tp; ++q)
      if (q != a.rank) g.scale_push_dst[q] = p.scale_slot(q, a.rank);
  }
  g.b_scale_mode = a.w_scale_mode;
  g.b_scale = a.w_scale;
  if (p.kernel_forks()) {
    g.started_flag = p.my(p.flags.started());
    g.sent_flag = p.my(p.flags.sent());
    g.finished_ctas = p.my(p.flags.finished());
    for (int q = 0; q < a.tp; ++q)
      if (q != a.rank) g.done_out[q] = p.flag(q, p.flags.done(a.rank));
    if (a.completion != nullptr) g.completion_word = CompletionRing::word(a.completion, a.epoch);
  }
  g.launch = a.launch;
  return g;
}

}  // namespace

void check_ag_gemm_args(const AgGemmArgs& a) {
  FLUX_CHECK(a.tp >= 2 && a.tp <= kMaxTp, "tp ", a.tp, " outside [2, ", kMaxTp, "]");
  FLUX_CHECK(a.rank >= 0 && a.rank < a.tp, "rank ", a.rank, " outside [0, ", a.tp, ")");
  FLUX_CHECK(a.num_comm >= 1, "at least one communication stream is needed");
  FLUX_CHECK(a.rows_per_chunk > 0, "rows_per_chunk must be positive, got ", a.rows_per_chunk);
  FLUX_CHECK(a.chunk_capacity > 0, "the workspace holds no chunk flags");
  FLUX_CHECK(a.events != nullptr, "the workspace's events are missing");
  FLUX_CHECK(!is_fp8(a.dtype) || a.scales[a.rank] != nullptr, "an FP8 all-gather needs the workspace's scale region");
  if (a.mode == AgMode::kExternal) return;  // local buffer, flags and scales only
  for (int q = 0; q < a.tp; ++q)
    FLUX_CHECK(a.buffers[q] != nullptr && a.flags[q] != nullptr, "copy-engine transfers need rank ", q,
               "'s buffer and flags mapped");
}

void end_external_ag_gemm(const AgGemmArgs& a) {
  FLUX_CHECK(a.mode == AgMode::kExternal, "only a call whose caller moves the chunks (external mode) ends apart");
  // The watchdog sees the call's end; transfers that never arrive make the GEMM's own waits time out.
  if (a.completion != nullptr) stream_write_u32(a.compute, CompletionRing::word(a.completion, a.epoch), a.epoch);
}

void ag_gemm(const AgGemmArgs& a) {
  if (a.rows_per_shard == 0) return;
  AgCall p{a,
           AgFlagLayout{a.tp, a.chunk_capacity},
           (a.rows_per_shard + a.rows_per_chunk - 1) / a.rows_per_chunk,
           size_t(a.k) * dtype_bytes(a.dtype),
           {a.epoch, uint32_t(a.rows_per_shard),
            signature_shape_word(0, int(a.layout), int(a.mode) * 2 + int(a.order), a.n)}};

  if (a.mode == AgMode::kExternal) {
    if (a.run_gemm) launch_gemm(gemm_problem(p), a.types, a.layout, a.tile, a.compute);
    if (p.graph()) FLUX_CUDA_CHECK(cudaMemsetAsync(p.my(0), 0, size_t(p.flags.data_words()) * 4, a.compute));
    // The call's end is the caller's to enqueue (end_external_ag_gemm), once its transfers are. A stream write
    // here waits for the GEMM, and with it here, under a single hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), the
    // transfers the GEMM waits for did not run until the GEMM gave up (docs/design.md section 7).
    return;
  }
  cudaEvent_t* const ev = a.events;
  cudaEvent_t ready = ev[1];
  cudaStream_t s0 = a.comm[0];
  int const used = p.streams_used();
  bool x_in_buffer = a.x == p.region(a.rank, a.rank, 0) && a.ldx == a.k;
  if (a.mode == AgMode::kPull) {
    // Pull: our shard must sit in our symmetric buffer before anyone pulls it. The staging copy is
    // same-device, which the driver may run on SMs; it therefore goes on the compute stream before the
    // persistent GEMM (which holds every SM until its chunks arrive). Write x into input_buffer() to skip it.
    p.wait_peers_done(a.compute);
    stage_own(p, x_in_buffer, a.compute);
    FLUX_CUDA_CHECK(cudaEventRecord(ready, a.compute));
    for (int i = 0; i < used; ++i) FLUX_CUDA_CHECK(cudaStreamWaitEvent(a.comm[i], ready, 0));
    if (a.run_gemm) launch_gemm(gemm_problem(p), a.types, a.layout, a.tile, a.compute);
    pull(p);
  } else {
    // Push: peer-to-peer copies only (copy engines); the GEMM does not wait for the previous call's peers. It is
    // enqueued before the comm stream's handshake wait: with a single hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1)
    // a wait queued ahead of it would hold its own-shard tiles until the peer's previous call ended, and a peer that
    // died inside that call would hold the queue for good, where the GEMM's bounded waits give up and release it.
    if (p.kernel_forks()) {
      launch_gemm(gemm_problem(p), a.types, a.layout, a.tile, a.compute);
    } else {
      FLUX_CUDA_CHECK(cudaEventRecord(ev[0], a.compute));
      if (a.run_gemm) launch_gemm(gemm_problem(p), a.types, a.layout, a.tile, a.compute);
      FLUX_CUDA_CHECK(cudaStreamWaitEvent(s0, ev[0], 0));
    }
    p.wait_peers_done(s0);
    push_shard_scale(p, s0);
    if (used > 1) FLUX_CUDA_CHECK(cudaEventRecord(ready, s0));
    for (int i = 1; i < used; ++i) FLUX_CUDA_CHECK(cudaStreamWaitEvent(a.comm[i], ready, 0));
    push(p);
  }

  // Join the comm streams back into the compute stream only now, so nothing above waits on them.
  for (int i = 1; i < used; ++i) {
    FLUX_CUDA_CHECK(cudaEventRecord(ev[2 + i], a.comm[i]));
    FLUX_CUDA_CHECK(cudaStreamWaitEvent(s0, ev[2 + i], 0));
  }
  if (a.gathered_out != nullptr) copy_out_gathered(p, a.mode == AgMode::kPull);
  if (p.kernel_forks()) {  // the GEMM's last CTA joins comm[0] and signals the end (see the top of this file)
    if (!p.sent_with_last_flag()) stream_write_u32(s0, p.my(p.flags.sent()), a.epoch);
    return;
  }
  FLUX_CUDA_CHECK(cudaEventRecord(ev[2], s0));
  FLUX_CUDA_CHECK(cudaStreamWaitEvent(a.compute, ev[2], 0));
  p.signal_done(a.compute);
}

}  // namespace flux
