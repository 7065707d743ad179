// Persistent tile order shared by the plain, AllGather and ReduceScatter GEMMs.
//
// Work is counted in cluster tiles (kClusterM tiles along M sharing one N tile, so B can be multicast).
//
//   work w -> step = w / work_per_group  (step s visits group group_order[s]: all of a group before the next)
//          -> r    = w % work_per_group  (inside the group: panels of `swizzle` cluster rows, M fastest)
//
//        n ->  0  1  2  3 ...
//   cm 0      0  2  4  6        swizzle = 2: a panel of 2 cluster rows is swept column by column, so the
//   cm 1      1  3  5  7        CTAs resident at one time share A rows and B columns in L2.
//   cm 2      8 10 12 ...
//
// group_order is how ranks avoid contention and follow data arrival:
//   AllGather     : own shard first, then shards in the order the copy engine delivers them;
//   ReduceScatter : destinations rank+1, rank+2, ..., own rows last (rank-offset swizzle: at each step every
//                   rank writes to a different destination, and own rows are reduced after peers delivered).
// flux_layers/runtime/schedules.py mirrors this function; CPU tests check the two agree.
#pragma once

#include "flux/gemm_params.h"

namespace flux {

struct TileCoord {
  int group;
  int m;  // tile index along M inside the group
  int n;  // tile index along N
};

struct TileSchedule {
  int tiles_m = 0;  // per group, rounded up to a multiple of cluster_m
  int tiles_n = 0;
  int cluster_m = 1;
  int swizzle = 1;  // cluster rows per panel
  int work_per_group = 0;
  int total_work = 0;
  int group_order[kMaxGroups] = {0};

  static TileSchedule make(const GemmProblem& p, int tile_m, int tile_n, int cluster_m) {
    TileSchedule s;
    int tiles_m = (p.rows_per_group + tile_m - 1) / tile_m;
    s.cluster_m = cluster_m;
    s.tiles_m = (tiles_m + cluster_m - 1) / cluster_m * cluster_m;
    s.tiles_n = (p.n + tile_n - 1) / tile_n;
    int cluster_rows = s.tiles_m / cluster_m;
    int swz = p.swizzle_m > 0 ? p.swizzle_m : 8;  // tiles along M per panel
    s.swizzle = swz / cluster_m > 0 ? swz / cluster_m : 1;
    if (s.swizzle > cluster_rows && cluster_rows > 0) s.swizzle = cluster_rows;
    s.work_per_group = cluster_rows * s.tiles_n;
    s.total_work = s.work_per_group * p.num_groups;
    for (int i = 0; i < kMaxGroups; ++i) s.group_order[i] = p.group_order[i];
    return s;
  }

  __host__ __device__ TileCoord get(int work, int cluster_rank_m) const {
    int step = work / work_per_group;
    int r = work - step * work_per_group;
    int cluster_rows = tiles_m / cluster_m;
    int panel_span = swizzle * tiles_n;
    int panel = r / panel_span;
    int rem = r - panel * panel_span;
    int rows_here = cluster_rows - panel * swizzle;
    if (rows_here > swizzle) rows_here = swizzle;
    int cm = panel * swizzle + rem % rows_here;
    int n = rem / rows_here;
    return TileCoord{group_order[step], cm * cluster_m + cluster_rank_m, n};
  }
};

}  // namespace flux
