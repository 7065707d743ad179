// GEMM + ReduceScatter: the persistent GEMM stores each finished tile of a peer's rows straight into that
// peer's receive slot (NVLink P2P) and raises a per-tile flag there; the tiles of this rank's own rows come
// last and add the peers' partials (waiting on their flags) in a fixed order, so the result is the same bits
// on every run. After the kernel, consumed[r] = e is written at every peer: our receive slots are free again.
//
// Flag words of one rank: tile[src][flags_per_source] (set by src), then consumed[tp] (set by each peer).
#include "flux/check.h"
#include "flux/fused_ops.h"

namespace flux {

void rs_group_order(int rank, int tp, int* group_order) {
  for (int s = 0; s < tp; ++s) group_order[s] = (rank + 1 + s) % tp;
}

void gemm_rs(const GemmRsArgs& a) {
  FLUX_CHECK(a.tp >= 2 && a.tp <= kMaxGroups, "tp ", a.tp, " outside [2, ", kMaxGroups, "]");
  FLUX_CHECK(a.rank >= 0 && a.rank < a.tp, "rank ", a.rank, " outside [0, ", a.tp, ")");
  FLUX_CHECK(a.rows_per_group <= a.slot_rows, "M / tp = ", a.rows_per_group, " exceeds the workspace slot of ",
             a.slot_rows, " rows");
  FLUX_CHECK(a.epoch > 0, "epochs start at 1");
  if (a.rows_per_group == 0) return;
  const int r = a.rank;
  const size_t elem = 2;
  const size_t slot_bytes = size_t(a.slot_rows) * a.n * elem;
  auto consumed = [&](int q) { return a.flags[q] + int64_t(a.tp) * a.flags_per_source; };

  GemmProblem g;
  g.rows_per_group = a.rows_per_group;
  g.n = a.n;
  g.k = a.k;
  g.num_groups = a.tp;
  rs_group_order(r, a.tp, g.group_order);
  g.own_group = -1;
  g.a = a.x;  // group d = rows [d * Mg, (d + 1) * Mg) of x
  g.lda = a.ldx;
  g.a_group_stride = int64_t(a.rows_per_group) * a.ldx;
  g.b = a.w;
  g.ldb = a.ldw;
  g.bias = a.bias;
  for (int d = 0; d < a.tp; ++d)
    g.d[d] = d == r ? a.out : static_cast<void*>(a.recv[d] + size_t(r) * slot_bytes);
  g.ldd = a.n;
  g.rs_own_group = r;
  int i = 0;
  for (int src = 0; src < a.tp; ++src) {
    if (src == r) continue;
    g.rs_partials[i] = a.recv[r] + size_t(src) * slot_bytes;
    g.rs_partial_flags[i] = a.flags[r] + int64_t(src) * a.flags_per_source;
    ++i;
  }
  g.rs_num_partials = i;
  for (int d = 0; d < a.tp; ++d) g.rs_signal[d] = a.flags[d] + int64_t(r) * a.flags_per_source;
  g.rs_consumed = consumed(r);
  g.rs_flags_per_source = a.flags_per_source;
  g.epoch = a.epoch;
  g.timeout_ns = a.timeout_ns;
  g.error_record = a.error_record;
  g.error_claim = a.error_claim;
  g.rank = r;
  g.launch = a.launch;
  launch_gemm(g, a.dtype, a.layout, a.tile, a.compute);

  for (int q = 0; q < a.tp; ++q)
    if (q != r) stream_write_u32(a.compute, consumed(q) + r, a.epoch);
}

}  // namespace flux
