// Where every word of a fused-operator workspace lives, and what a workspace of a given shape holds: the one source
// of these layouts. csrc/runtime reads and writes the flags through them; flux_layers/runtime/workspace.py allocates
// what ag_workspace_sizes / rs_workspace_sizes say and finds single words through the native workspace's flag_index
// (both exported by csrc/bindings/ops.cpp). Torch-free and CUDA-free (tests/cpu/schedule_dump.cpp compiles it).
#pragma once

#include <cstdint>

#include "flux/gemm_params.h"

namespace flux {

// Flag words of one rank in the all-gather workspace (uint32):
//   chunk[g][c] : rows chunk c of shard g are in this rank's gathered buffer     (the GEMM waits on these)
//   avail[g][c] : chunk (g, c) can be pulled from this rank's source rank          (pull modes)
//   done[p]     : rank p finished its previous call (its reads of our buffer and its writes into it)
//   started     : this rank's GEMM of the call started, so x is ready  (eager push: GemmProblem::started_flag)
//   sent        : this rank's comm stream finished the call's transfers  (eager push: GemmProblem::sent_flag)
//   sig[p][kSignatureWords] : rank p's call signature (gemm_params.h), written before its first flag here
//   finished    : the GEMM's count of finished CTAs (GemmProblem::finished_ctas; the kernel's own, never released)
struct AgFlagLayout {
  int tp;
  int chunk_capacity;  // chunks per shard the workspace was sized for
  int64_t chunk(int g, int c) const { return int64_t(g) * chunk_capacity + c; }
  int64_t avail(int g, int c) const { return int64_t(tp) * chunk_capacity + int64_t(g) * chunk_capacity + c; }
  int64_t done(int p) const { return 2 * int64_t(tp) * chunk_capacity + p; }
  int64_t started() const { return done(tp); }
  int64_t sent() const { return done(tp) + 1; }
  int64_t signature(int p) const { return sent() + 1 + int64_t(p) * kSignatureWords; }
  int64_t finished() const { return signature(tp); }
  int64_t data_words() const { return 2 * int64_t(tp) * chunk_capacity; }  // chunk and avail: cleared per call
  // chunk, avail, done, started and sent: every word a wait reads
  int64_t release_words() const { return data_words() + tp + 2; }
  int64_t words() const { return finished() + 1; }
};

// Flag words of one rank in the reduce-scatter workspace (uint32; csrc/runtime/gemm_rs.cpp):
//   flag[src][c]  : src's partial of chunk (or tile) c of our rows is in our receive slot for src
//   consumed[p]   : rank p finished reading its receive slot for us (its previous call)
//   count[dst][c] : our tiles of dst's rows staged in chunk c (copy-engine and external transports)
//   sig[src][kSignatureWords] : src's call signature
struct RsFlagLayout {
  int tp;
  int64_t flags_per_source;
  int64_t flag(int src, int64_t c) const { return int64_t(src) * flags_per_source + c; }
  int64_t consumed(int p) const { return int64_t(tp) * flags_per_source + p; }
  int64_t count(int dst, int64_t c) const { return int64_t(tp) * flags_per_source + tp + dst * flags_per_source + c; }
  int64_t signature(int p) const { return 2 * int64_t(tp) * flags_per_source + tp + int64_t(p) * kSignatureWords; }
  int64_t release_words() const { return 2 * int64_t(tp) * flags_per_source + tp; }  // flag, consumed and count
  int64_t words() const { return signature(tp); }
  // Enough per-source flags for tiles of min_tile rows and columns (the smallest of any configuration), the tiles
  // along M padded to whole clusters as the schedule pads them.
  static int64_t flags_per_source_for(int64_t slot_rows, int64_t n, int min_tile) {
    int64_t const tiles_m = (slot_rows + min_tile - 1) / min_tile;
    return (tiles_m + kClusterM - 1) / kClusterM * kClusterM * ((n + min_tile - 1) / min_tile);
  }
  // The staging slot (copy-engine and external transports) of this rank's partial of dst's rows: dst's step in the
  // kernel's destination order (rank + 1 first), so that tp - 1 slots serve every destination.
  static int stage_slot(int rank, int tp, int dst) { return (dst - rank - 1 + tp) % tp; }
};

// Two-level reduce-scatter (the hybrid transport: the epilogue's stores inside a node, the caller's transfers between
// nodes; csrc/runtime/gemm_rs.cpp) of tp ranks in nodes of node_size, rank = node * node_size + local. Block b, the
// rows rank b owns, is (m, j). Rank r = (n, i) does with its tile of block b:
//   b == r          : own rows: adds its node peers' partials (local order), then the other nodes' node partials
//                     (node order), and stores the sum (the output);
//   m == n, j != i  : stores it into b's receive slot r (inside the node);
//   m != n, j != i  : stores it into the collector (n, j)'s receive slot (m, i);
//   m != n, j == i  : collects it: adds its node peers' partials of b (local order) and stages the sum, the node's
//                     partial of b, for the caller to send to b (it lands in b's slot r).
// So every slot q != r of rank r has one writer per call: q = (n, i'): that peer's partial of our rows; q = (m, i),
// m != n: node m's node partial of our rows (from the collector q, by the caller's transfers); q = (m, i'), m != n,
// i' != i: (n, i')'s partial of block (m, i), which we collect. The GEMM walks the other nodes' blocks first, node
// n + 1, n + 2, ..., each node's from local index i + 1 on, the collected one last, then its own node's, its own
// block last (transfer_plan.rs_gemm_order): a tile that waits for partials comes after the peers' tiles it waits
// for at the same place of their walks.
struct RsTwoLevel {
  int shard_order[kMaxTp] = {0};  // the GEMM's block order
  int dest[kMaxTp] = {0};         // block b: the rank whose slot dest_slot its tile goes to; -1: own or collected
  int dest_slot[kMaxTp] = {0};
  uint32_t collected = 0;           // bit b: block b is collected here (staged for the caller)
  int partial_slot[kMaxTp] = {0};   // this rank's slots that the reduced blocks add, each block's in summation order
  int first_partial[kMaxTp] = {0};  // block b adds partial_slot[first_partial[b] .. + partial_count[b])
  int partial_count[kMaxTp] = {0};
  int num_partials = 0;
  int partial_source[kMaxTp] = {0};  // the rank partial_slot[s] comes from: its writer in the node, or the collector
  uint32_t from_caller = 0;          // bit s: partial_slot[s] arrives by the caller's transfers (a node partial)

  static RsTwoLevel make(int rank, int tp, int node_size) {
    RsTwoLevel t;
    int const nodes = tp / node_size, n = rank / node_size, i = rank % node_size;
    auto at = [&](int node, int local) { return (node % nodes) * node_size + local % node_size; };
    int step = 0;
    for (int k = 1; k <= nodes; ++k)
      for (int s = 1; s <= node_size; ++s) t.shard_order[step++] = at(n + k, i + s);
    for (int b = 0; b < tp; ++b) {
      int const m = b / node_size, j = b % node_size;
      t.dest[b] = b == rank || (m != n && j == i) ? -1 : m == n ? b : at(n, j);
      t.dest_slot[b] = m == n ? rank : at(m, i);
      if (m != n && j == i) t.collected |= 1u << b;
      if (b != rank && !(t.collected >> b & 1u)) continue;
      t.first_partial[b] = t.num_partials;
      for (int l = 0; l < node_size; ++l)  // the node peers' partials: (n, l)'s in slot (n, l) or (m, l)
        if (l != i) {
          t.partial_source[t.num_partials] = at(n, l);
          t.partial_slot[t.num_partials++] = at(m, l);
        }
      if (b == rank)
        for (int o = 0; o < nodes; ++o)  // the other nodes' node partials, from their collectors (o, i)
          if (o != n) {
            t.from_caller |= 1u << t.num_partials;
            t.partial_source[t.num_partials] = at(o, i);
            t.partial_slot[t.num_partials++] = at(o, i);
          }
      t.partial_count[b] = t.num_partials - t.first_partial[b];
    }
    return t;
  }
};

// What one rank of a workspace holds. The flags follow the data in one allocation; the handshake words (all-gather
// done, reduce-scatter consumed) start set under the CUDA-graph protocol (FlagProtocol, fused_ops.h).
struct WorkspaceSizes {
  int64_t data_bytes = 0;  // all-gather: the gathered buffer [max_m, K]; reduce-scatter: receive slots [tp][slot][N]
  int64_t flag_words = 0;
  int64_t handshake_begin = 0;
  int64_t handshake_words = 0;
  int64_t capacity = 0;     // chunks per shard (all-gather) or flags per source (reduce-scatter)
  int64_t slot_rows = 0;    // reduce-scatter: rows of a receive or staging slot (max_m / tp)
  int64_t stage_bytes = 0;  // reduce-scatter: the local staging area [tp - 1][slot][N] of its copy-engine transport
  // all-gather of FP8 rows: the byte offset in the data of the scale region, two halves of max_m floats (a call's
  // gathered scales, [tp] or [tp][Mg], in the half of its epoch's parity: AgGemmArgs::scale_half); 0: none (16-bit
  // rows)
  int64_t scale_offset = 0;
};

// All-gather of FP8 rows: where shard g's scales start in a rank's scale region (floats from its start), for a call of
// epoch `epoch` with `per_shard` scales per shard (1, or the shard's rows): the call's scales sit in the half of its
// epoch's parity, compact ([tp] or [tp][Mg]). Halves of max_m floats (AgGemmArgs::scale_half says why two).
inline int64_t ag_scale_index(int64_t max_m, uint32_t epoch, int g, int64_t per_shard) {
  return int64_t(epoch & 1u) * max_m + int64_t(g) * per_shard;
}

inline WorkspaceSizes ag_workspace_sizes(int tp, int64_t max_m, int64_t k, int chunk_capacity, DType dtype) {
  AgFlagLayout const f{tp, chunk_capacity};
  WorkspaceSizes s;
  s.data_bytes = max_m * k * dtype_bytes(dtype);
  if (is_fp8(dtype)) {
    s.scale_offset = (s.data_bytes + 255) / 256 * 256;
    s.data_bytes = s.scale_offset + 2 * max_m * int64_t(sizeof(float));
  }
  s.flag_words = f.words();
  s.handshake_begin = f.done(0);
  s.handshake_words = tp;
  s.capacity = chunk_capacity;
  return s;
}

inline WorkspaceSizes rs_workspace_sizes(int tp, int64_t max_m, int64_t n, int min_tile, DType dtype) {
  WorkspaceSizes s;
  s.slot_rows = max_m / tp;
  s.capacity = RsFlagLayout::flags_per_source_for(s.slot_rows, n, min_tile);
  RsFlagLayout const f{tp, s.capacity};
  s.data_bytes = tp * s.slot_rows * n * dtype_bytes(dtype);
  s.flag_words = f.words();
  s.handshake_begin = f.consumed(0);
  s.handshake_words = tp;
  s.stage_bytes = (tp - 1) * s.slot_rows * n * dtype_bytes(dtype);
  return s;
}

}  // namespace flux
