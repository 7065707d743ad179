// Prints flux::TileSchedule's tile order for the problem given on the command line, so that the CPU tests can
// compare it with flux_layers/runtime/schedules.py. Host-only build of the header.
#define __host__
#define __device__
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../../csrc/include/flux/workspace_layout.h"
#include "../../csrc/kernels/tile_schedule.cuh"

// streamk total_work clusters k_tiles max_fill_pct: per cluster "c work k_begin k_end last_contributor" lines.
int dump_stream_k(int argc, char** argv) {
  if (argc < 6) return 2;
  int total = std::atoi(argv[2]), clusters = std::atoi(argv[3]), k_tiles = std::atoi(argv[4]);
  flux::StreamK sk = flux::StreamK::make(total, clusters, k_tiles, true, std::atoi(argv[5]));
  flux::Segment s;
  for (int c = 0; c < clusters; ++c)
    for (flux::SegmentCursor cur = sk.begin(c, clusters); sk.next(cur, s);) {
      int last = s.k_begin == 0 && s.k_end < k_tiles ? sk.last_contributor(s.work) : -1;
      std::printf("%d %d %d %d %d\n", c, s.work, s.k_begin, s.k_end, last);
    }
  return 0;
}

// rschunks rows_per_shard n tile_m tile_n swizzle_m chunk_cols: "chunk_tiles_m chunk_tiles_n chunks_m chunks_n",
// then per chunk in copy order "cm cn index tiles", then one line: the chunk of every tile (row-major), as the
// kernel's epilogue computes it (rs_chunk_index).
int dump_rs_chunks(int argc, char** argv) {
  if (argc < 8) return 2;
  flux::GemmProblem p;
  p.rows_per_shard = std::atoi(argv[2]);
  p.n = std::atoi(argv[3]);
  int tile_m = std::atoi(argv[4]), tile_n = std::atoi(argv[5]);
  p.launch.swizzle_m = std::atoi(argv[6]);
  flux::TileSchedule s = flux::TileSchedule::make(p, tile_m, tile_n, 2);
  flux::RsChunkGrid g = flux::RsChunkGrid::make(s, p.rows_per_shard, tile_m, tile_n, std::atoi(argv[7]));
  std::printf("%d %d %d %d\n", g.chunk_tiles_m, g.chunk_tiles_n, g.chunks_m, g.chunks_n);
  for (int cm = 0; cm < g.chunks_m; ++cm)
    for (int cn = 0; cn < g.chunks_n; ++cn) std::printf("%d %d %d %u\n", cm, cn, g.index(cm, cn), g.tiles_in(cm, cn));
  for (int m = 0; m < g.tiles_m; ++m)
    for (int n = 0; n < g.tiles_n; ++n) std::printf("%d ", g.chunk_of(m, n));
  std::printf("\n");
  return 0;
}

// signature op layout transport dim: a call signature's word 2 (gemm_params.h), then its fields decoded.
int dump_signature(int argc, char** argv) {
  if (argc < 6) return 2;
  uint32_t w =
      flux::signature_shape_word(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), std::atoll(argv[5]));
  std::printf("%u %d %d %d %lld\n", w, flux::signature_op(w), flux::signature_layout(w), flux::signature_transport(w),
              static_cast<long long>(flux::signature_dim(w)));
  return 0;
}

// rsflags slot_rows n min_tile: the reduce-scatter workspace's flags per source (workspace_layout.h).
int dump_rs_flags(int argc, char** argv) {
  if (argc < 5) return 2;
  std::printf("%lld\n", static_cast<long long>(flux::RsFlagLayout::flags_per_source_for(
                            std::atoll(argv[2]), std::atoll(argv[3]), std::atoi(argv[4]))));
  return 0;
}

// rstwolevel rank tp node_size: the two-level reduce-scatter's routes of one rank (workspace_layout.h RsTwoLevel),
// one "name values..." line each: order, dest, dest_slot, collected (one 0/1 per block), partial_slot,
// partial_source, from_caller (one per partial), first_partial, partial_count (one per block).
int dump_rs_two_level(int argc, char** argv) {
  if (argc < 5) return 2;
  int const tp = std::atoi(argv[3]);
  flux::RsTwoLevel const t = flux::RsTwoLevel::make(std::atoi(argv[2]), tp, std::atoi(argv[4]));
  auto line = [](const char* name, const int* v, int n) {
    std::printf("%s", name);
    for (int i = 0; i < n; ++i) std::printf(" %d", v[i]);
    std::printf("\n");
  };
  int collected[flux::kMaxTp], from_caller[flux::kMaxTp];
  for (int b = 0; b < tp; ++b) collected[b] = int(t.collected >> b & 1u);
  for (int s = 0; s < t.num_partials; ++s) from_caller[s] = int(t.from_caller >> s & 1u);
  line("order", t.shard_order, tp);
  line("dest", t.dest, tp);
  line("dest_slot", t.dest_slot, tp);
  line("collected", collected, tp);
  line("partial_slot", t.partial_slot, t.num_partials);
  line("partial_source", t.partial_source, t.num_partials);
  line("from_caller", from_caller, t.num_partials);
  line("first_partial", t.first_partial, tp);
  line("partial_count", t.partial_count, tp);
  return 0;
}

// agflags tp chunk_capacity: every word of the all-gather's flag layout, one "name index" line each, then
// "release_words n" and "words n" (workspace_layout.h AgFlagLayout).
int dump_ag_flags(int argc, char** argv) {
  if (argc < 4) return 2;
  flux::AgFlagLayout const f{std::atoi(argv[2]), std::atoi(argv[3])};
  auto word = [](const char* name, int64_t index) { std::printf("%s %lld\n", name, static_cast<long long>(index)); };
  for (int g = 0; g < f.tp; ++g)
    for (int c = 0; c < f.chunk_capacity; ++c) {
      word("chunk", f.chunk(g, c));
      word("avail", f.avail(g, c));
    }
  for (int q = 0; q < f.tp; ++q) word("done", f.done(q));
  word("started", f.started());
  word("sent", f.sent());
  for (int q = 0; q < f.tp; ++q)
    for (int i = 0; i < flux::kSignatureWords; ++i) word("signature", f.signature(q) + i);
  word("finished", f.finished());
  word("release_words", f.release_words());
  word("words", f.words());
  return 0;
}

// constants: the values the Python mirrors must equal, one "name value..." line each.
int dump_constants() {
  std::printf("max_tp %d\ncluster_m %d\nsplit_max_fill_pct %d\nrs_chunk_cols %d\n", flux::kMaxTp, flux::kClusterM,
              flux::kDefaultSplitMaxFillPct, flux::RsChunkGrid::kDefaultChunkCols);
  std::printf("signature_words %d\nerror_record_words %d\n", flux::kSignatureWords, flux::kErrorRecordWords);
  for (int t = 0; t < flux::kNumTileConfigs; ++t)
    std::printf("tile %d %d %d\n", t, flux::tile_m(flux::TileConfig(t)), flux::tile_n(flux::TileConfig(t)));
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "constants") return dump_constants();
  if (argc > 1 && std::string(argv[1]) == "streamk") return dump_stream_k(argc, argv);
  if (argc > 1 && std::string(argv[1]) == "rschunks") return dump_rs_chunks(argc, argv);
  if (argc > 1 && std::string(argv[1]) == "signature") return dump_signature(argc, argv);
  if (argc > 1 && std::string(argv[1]) == "rsflags") return dump_rs_flags(argc, argv);
  if (argc > 1 && std::string(argv[1]) == "agflags") return dump_ag_flags(argc, argv);
  if (argc > 1 && std::string(argv[1]) == "rstwolevel") return dump_rs_two_level(argc, argv);
  // rows_per_shard n num_shards tile_m tile_n cluster_m swizzle_m order...
  if (argc < 8) return 2;
  flux::GemmProblem p;
  p.rows_per_shard = std::atoi(argv[1]);
  p.n = std::atoi(argv[2]);
  p.num_shards = std::atoi(argv[3]);
  int tile_m = std::atoi(argv[4]), tile_n = std::atoi(argv[5]), cluster_m = std::atoi(argv[6]);
  p.launch.swizzle_m = std::atoi(argv[7]);
  for (int i = 0; i < p.num_shards && 8 + i < argc; ++i) p.shard_order[i] = std::atoi(argv[8 + i]);
  flux::TileSchedule s = flux::TileSchedule::make(p, tile_m, tile_n, cluster_m);
  for (int w = 0; w < s.total_work; ++w)
    for (int c = 0; c < cluster_m; ++c) {
      flux::TileCoord t = s.get(w, c);
      std::printf("%d %d %d\n", t.shard, t.m, t.n);
    }
  return 0;
}
