// Persistent tile order shared by the plain, AllGather and ReduceScatter GEMMs.
//
// Work is counted in cluster tiles (kClusterM tiles along M sharing one N tile, so B can be multicast).
//
//   work w -> step = w / work_per_shard  (step s visits shard shard_order[s]: all of a shard before the next)
//          -> r    = w % work_per_shard  (inside the shard: panels of `swizzle` cluster rows, M fastest)
//
//        n ->  0  1  2  3 ...
//   cm 0      0  2  4  6        swizzle = 2: a panel of 2 cluster rows is swept column by column, so the
//   cm 1      1  3  5  7        CTAs resident at one time share A rows and B columns in L2.
//   cm 2      8 10 12 ...
//
// shard_order is how ranks avoid contention and follow data arrival:
//   AllGather     : own shard first, then shards in the order the copy engine delivers them;
//   ReduceScatter : destinations rank+1, rank+2, ..., own rows last (rank-offset swizzle: at each step every
//                   rank writes to a different destination, and own rows are reduced after peers delivered).
// Stream-K tail (StreamK below): when the work does not fill whole waves of the persistent grid, the leading
// work items stay whole (round robin over clusters) and the k iterations of the trailing items are spread
// evenly over the clusters, so no cluster idles through a last, partial wave.
//
// flux_layers/runtime/schedules.py mirrors the schedule, the stream-K tail and the reduce-scatter chunks (RsChunkGrid
// below); CPU tests check the two agree.
#pragma once

#include "flux/gemm_params.h"

namespace flux {

// x / d for 0 <= x < 2^31 and a divisor d >= 1 fixed when the schedule is made: q = umulhi(x, m) >> s with
// l = ceil(log2 d), m = ceil(2^(31 + l) / d) < 2^32, s = l - 1. Exact: m * d = 2^(31 + l) + e with e < d <= 2^l, so
// x * m / 2^(31 + l) = x / d + x * e / (d * 2^(31 + l)), and x * e < 2^(31 + l) keeps the error below 1 / d. The
// consumers compute their next tile with three such divisions per tile, on the tensor pipe's idle path between two
// tiles; the compiler's division by a runtime value is ~20 instructions around a reciprocal (MUFU) each.
struct FastDiv {
  int d = 1;
  unsigned mul = 0;
  unsigned shift = 0;

  static FastDiv make(int divisor) {
    FastDiv f;
    f.d = divisor > 1 ? divisor : 1;
    if (f.d > 1) {
      unsigned l = 0;
      while ((1ull << l) < unsigned(f.d)) ++l;
      f.mul = unsigned(((1ull << (31 + l)) + unsigned(f.d) - 1) / unsigned(f.d));
      f.shift = l - 1;
    }
    return f;
  }
  __host__ __device__ int div(int x) const {
    if (d == 1) return x;
#if defined(__CUDA_ARCH__)
    return int(__umulhi(unsigned(x), mul) >> shift);
#else
    return int(((unsigned long long)unsigned(x) * mul) >> 32 >> shift);
#endif
  }
};

struct TileCoord {
  int shard;
  int m;  // tile index along M inside the shard
  int n;  // tile index along N
};

struct TileSchedule {
  int tiles_m = 0;  // per shard, rounded up to a multiple of cluster_m
  int tiles_n = 0;
  int cluster_m = 1;
  int swizzle = 1;  // cluster rows per panel
  int work_per_shard = 0;
  int total_work = 0;
  int shard_order[kMaxTp] = {0};
  // Divisors of get(): work_per_shard, swizzle * tiles_n (a panel), swizzle (rows of a full panel) and the rows of
  // the last panel.
  FastDiv by_work_per_shard, by_panel_span, by_swizzle, by_last_rows;

  static TileSchedule make(const GemmProblem& p, int tile_m, int tile_n, int cluster_m) {
    TileSchedule s;
    int tiles_m = (p.rows_per_shard + tile_m - 1) / tile_m;
    s.cluster_m = cluster_m;
    s.tiles_m = (tiles_m + cluster_m - 1) / cluster_m * cluster_m;
    s.tiles_n = (p.n + tile_n - 1) / tile_n;
    int cluster_rows = s.tiles_m / cluster_m;
    int swz = p.launch.swizzle_m > 0 ? p.launch.swizzle_m : 8;  // tiles along M per panel
    s.swizzle = swz / cluster_m > 0 ? swz / cluster_m : 1;
    if (s.swizzle > cluster_rows && cluster_rows > 0) s.swizzle = cluster_rows;
    s.work_per_shard = cluster_rows * s.tiles_n;
    s.total_work = s.work_per_shard * p.num_shards;
    for (int i = 0; i < kMaxTp; ++i) s.shard_order[i] = p.shard_order[i];
    s.by_work_per_shard = FastDiv::make(s.work_per_shard);
    s.by_panel_span = FastDiv::make(s.swizzle * s.tiles_n);
    s.by_swizzle = FastDiv::make(s.swizzle);
    int const last_rows = cluster_rows - (cluster_rows > 0 ? (cluster_rows - 1) / s.swizzle * s.swizzle : 0);
    s.by_last_rows = FastDiv::make(last_rows);
    return s;
  }

  __host__ __device__ TileCoord get(int work, int cluster_rank_m) const {
    int step = by_work_per_shard.div(work);
    int r = work - step * work_per_shard;
    int panel = by_panel_span.div(r);
    int rem = r - panel * by_panel_span.d;
    // Every panel holds `swizzle` cluster rows but the last, which holds what is left (tiles_m is a multiple of
    // cluster_m: the comparison in tiles needs no division).
    FastDiv const& by_rows = (panel + 1) * swizzle * cluster_m <= tiles_m ? by_swizzle : by_last_rows;
    int n = by_rows.div(rem);
    int cm = panel * swizzle + (rem - n * by_rows.d);
    return TileCoord{shard_order[step], cm * cluster_m + cluster_rank_m, n};
  }
};

// The flag (and copy-engine count) index of tile (m_tile, n_tile) of a ReduceScatter shard: chunks of
// chunk_tiles_m x chunk_tiles_n tiles, numbered row-major. The kernel's epilogue and the host's copy loop both
// use it.
__host__ __device__ inline int rs_chunk_index(int m_tile, int n_tile, int chunk_tiles_m, int chunk_tiles_n,
                                              int chunks_n) {
  return (m_tile / chunk_tiles_m) * chunks_n + n_tile / chunk_tiles_n;
}

// Copy-engine ReduceScatter: the chunks of one destination shard, each a unit the copy engine moves once all
// of its tiles are stored. A chunk is one panel of the schedule (chunk_tiles_m = swizzle * cluster_m tiles along
// M, visited together) times a strip of chunk_tiles_n tiles along N; the panel sweeps N, so the chunks complete
// in index order (cm, then cn). Tile (m, n) lies in chunk chunk_of(m, n); tiles_in counts only tiles holding
// rows (a cluster's padding tiles are neither stored nor counted).
struct RsChunkGrid {
  int tile_m = 0, tile_n = 0;
  int tiles_m = 0;  // tiles holding rows
  int tiles_n = 0;
  int chunk_tiles_m = 0;
  int chunk_tiles_n = 0;
  int chunks_m = 0, chunks_n = 0;

  // Columns per chunk when the caller does not say: 2-4 MB chunks on the layer shapes, copy-engine rows of at
  // least 2 KB.
  static constexpr int kDefaultChunkCols = 1024;

  // Copy-engine transport: panels of the schedule x strips of chunk_cols columns (0: the default).
  static RsChunkGrid make(const TileSchedule& s, int rows_per_shard, int tile_m, int tile_n, int chunk_cols) {
    int const cols = chunk_cols > 0 ? chunk_cols : kDefaultChunkCols;
    int const strip = (cols + tile_n - 1) / tile_n;
    int const chunk_tiles_n = strip < 1 ? 1 : (strip > s.tiles_n ? s.tiles_n : strip);
    return with_chunks(s, rows_per_shard, tile_m, tile_n, s.swizzle * s.cluster_m, chunk_tiles_n);
  }

  // Epilogue transport: one chunk (one flag) per tile.
  static RsChunkGrid per_tile(const TileSchedule& s, int rows_per_shard, int tile_m, int tile_n) {
    return with_chunks(s, rows_per_shard, tile_m, tile_n, 1, 1);
  }

  static RsChunkGrid with_chunks(const TileSchedule& s, int rows_per_shard, int tile_m, int tile_n, int chunk_tiles_m,
                                 int chunk_tiles_n) {
    RsChunkGrid g;
    g.tile_m = tile_m;
    g.tile_n = tile_n;
    g.tiles_m = (rows_per_shard + tile_m - 1) / tile_m;
    g.tiles_n = s.tiles_n;
    g.chunk_tiles_m = chunk_tiles_m;
    g.chunk_tiles_n = chunk_tiles_n;
    g.chunks_m = (g.tiles_m + chunk_tiles_m - 1) / chunk_tiles_m;
    g.chunks_n = chunk_tiles_n > 0 ? (g.tiles_n + chunk_tiles_n - 1) / chunk_tiles_n : 0;
    return g;
  }

  int index(int cm, int cn) const { return cm * chunks_n + cn; }
  int chunk_of(int m_tile, int n_tile) const {
    return rs_chunk_index(m_tile, n_tile, chunk_tiles_m, chunk_tiles_n, chunks_n);
  }
  unsigned tiles_in(int cm, int cn) const {
    int const m_end = (cm + 1) * chunk_tiles_m < tiles_m ? (cm + 1) * chunk_tiles_m : tiles_m;
    int const n_end = (cn + 1) * chunk_tiles_n < tiles_n ? (cn + 1) * chunk_tiles_n : tiles_n;
    return unsigned((m_end - cm * chunk_tiles_m) * (n_end - cn * chunk_tiles_n));
  }
};

struct Segment {
  int work;     // work item (cluster tile), as for TileSchedule::get
  int k_begin;  // k tiles [k_begin, k_end) of it
  int k_end;
};

struct SegmentCursor {
  int work, stride;  // next whole item, clusters
  int it, end;       // next and end stream-K iteration of the cluster's range
};

// Work assignment of the persistent grid: data-parallel items, then a stream-K tail.
//
//   items [0, dp_work)         : whole items; cluster c takes c, c + C, c + 2C, ... (the same count each)
//   items [dp_work, total_work): their k iterations, numbered item-major from 0 to sk_iters, are cut into
//                                contiguous ranges of iters_per_cluster, cluster c taking range c.
// A split item's segment holding k = 0 is its reducer: it adds the other segments' fp32 partials, in cluster
// order (deterministic), and runs the epilogue. Every other segment is the first segment of its cluster's
// range, so a cluster writes at most one partial (the workspace holds one per CTA), and a reducer, which is
// the last segment of its cluster's range, finds its contributors (who began with it) long finished.
struct StreamK {
  int dp_work = 0;
  int sk_clusters = 0;        // clusters with a stream-K range (0: no tail split)
  int iters_per_cluster = 0;  // q
  int sk_iters = 0;
  int k_tiles = 0;

  // Fewest k iterations a cluster's range may hold: below that the partials' traffic outweighs the gain.
  static constexpr int kMinIters = 8;

  // max_fill_pct: a last wave keeping more than this percentage of the clusters busy stays whole, as it
  // leaves too little idle time to pay for the partials (LaunchOptions::split_max_fill_pct).
  static StreamK make(int total_work, int clusters, int k_tiles, bool enabled, int max_fill_pct) {
    StreamK s;
    s.dp_work = total_work;
    s.k_tiles = k_tiles;
    int rem = clusters > 0 ? total_work % clusters : 0;
    if (!enabled || rem == 0 || 100 * rem > max_fill_pct * clusters || k_tiles < 2) return s;
    long long iters = (long long)rem * k_tiles;
    long long want = iters / kMinIters;
    int sk_clusters = int(want < clusters ? want : clusters);
    if (sk_clusters <= rem) return s;  // splitting would not shorten the last wave
    int q = int((iters + sk_clusters - 1) / sk_clusters);
    s.dp_work = total_work - rem;
    s.iters_per_cluster = q;
    s.sk_clusters = int((iters + q - 1) / q);
    s.sk_iters = int(iters);
    return s;
  }

  __host__ __device__ bool active() const { return sk_clusters > 0; }

  // The segments of a cluster, in the order it runs them: its whole items, then its stream-K range. The
  // producer and the consumers of a CTA walk the same list:
  //   for (SegmentCursor c = split.begin(cluster, clusters); split.next(c, seg);) ...
  // (a plain loop rather than a callback: the consumer's body must stay inlined, or its accumulators
  // would cross a call and spill).
  __host__ __device__ SegmentCursor begin(int cluster, int num_clusters) const {
    SegmentCursor c;
    c.work = cluster;
    c.stride = num_clusters;
    c.it = cluster < sk_clusters ? cluster * iters_per_cluster : 0;
    int const end = c.it + iters_per_cluster;
    c.end = cluster < sk_clusters ? (end < sk_iters ? end : sk_iters) : 0;
    return c;
  }

  __host__ __device__ bool next(SegmentCursor& c, Segment& s) const {
    if (c.work < dp_work) {
      s = Segment{c.work, 0, k_tiles};
      c.work += c.stride;
      return true;
    }
    if (c.it >= c.end) return false;
    int const item = c.it / k_tiles;
    int const k_begin = c.it - item * k_tiles;
    int const k_end = k_begin + (c.end - c.it) < k_tiles ? k_begin + (c.end - c.it) : k_tiles;
    s = Segment{dp_work + item, k_begin, k_end};
    c.it += k_end - k_begin;
    return true;
  }

  // The reducer of split item `work` (running on cluster c) adds the partials of clusters c+1 ..
  // last_contributor(work): their ranges begin inside the item.
  __host__ __device__ int last_contributor(int work) const {
    return ((work - dp_work + 1) * k_tiles - 1) / iters_per_cluster;
  }
};

}  // namespace flux
