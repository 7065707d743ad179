"""Tile and chunk orders as plain functions (mirrors of csrc/kernels/tile_schedule.cuh and csrc/runtime).

CPU tests check these against each other and against the properties the fused kernels rely on: every tile
visited once, own shard first for AllGather, own rows last for ReduceScatter, and at every step of the
ReduceScatter each rank writing to a different destination (rank-offset swizzle).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

# Mirrors of csrc/include/flux/gemm_params.h and tile_schedule.cuh (the one source; a CPU test compares them).
MAX_TP = 8  # kMaxTp
TILE_CONFIGS = {0: (256, 128), 1: (128, 256), 2: (128, 128)}  # id -> (tile_m, tile_n), flux::TileConfig
SPLIT_TILE_CONFIGS = (1, 2)  # configurations built with the stream-K tail (GemmKernel::kSplitCapable)
CLUSTER_M = 2  # kClusterM
DEFAULT_STREAM_K_FILL = 75  # percent, kDefaultSplitMaxFillPct; FLUX_LAYERS_STREAM_K_MAX_FILL's default
DEFAULT_RS_CHUNK_COLS = 1024  # RsChunkGrid::kDefaultChunkCols
SIGNATURE_WORDS = 3  # kSignatureWords: a call signature's flag words per source rank
ERROR_RECORD_WORDS = 9  # kErrorRecordWords


def ag_shard_order(rank: int, tp: int, order: str) -> list[int]:
    """Shards in the order the AllGather GEMM walks them: own first, then as the copy engine delivers them."""
    if order == "mesh":
        return [(rank + s) % tp for s in range(tp)]
    if order == "ring":
        return [(rank - s) % tp for s in range(tp)]
    raise ValueError(f"order must be 'mesh' or 'ring', got {order!r}")


def rs_shard_order(rank: int, tp: int) -> list[int]:
    """Destinations in the order the ReduceScatter GEMM writes them: rank+1, rank+2, ..., own rows last."""
    return [(rank + 1 + s) % tp for s in range(tp)]


@dataclass(frozen=True)
class TileSchedule:
    """Python twin of flux::TileSchedule."""
    rows_per_shard: int
    n: int
    num_shards: int
    shard_order: tuple[int, ...]
    tile_m: int = 256
    tile_n: int = 128
    cluster_m: int = CLUSTER_M
    swizzle_m: int = 8

    @property
    def tiles_m(self) -> int:
        t = -(-self.rows_per_shard // self.tile_m)
        return -(-t // self.cluster_m) * self.cluster_m

    @property
    def tiles_n(self) -> int:
        return -(-self.n // self.tile_n)

    @property
    def swizzle(self) -> int:
        s = max(1, self.swizzle_m // self.cluster_m)
        rows = self.tiles_m // self.cluster_m
        return min(s, rows) if rows > 0 else s

    @property
    def work_per_shard(self) -> int:
        return self.tiles_m // self.cluster_m * self.tiles_n

    @property
    def total_work(self) -> int:
        return self.work_per_shard * self.num_shards

    def get(self, work: int, cluster_rank_m: int) -> tuple[int, int, int]:
        """(shard, m tile, n tile) of cluster work item `work` for the CTA at `cluster_rank_m`."""
        step, r = divmod(work, self.work_per_shard)
        cluster_rows = self.tiles_m // self.cluster_m
        panel_span = self.swizzle * self.tiles_n
        panel, rem = divmod(r, panel_span)
        rows_here = min(self.swizzle, cluster_rows - panel * self.swizzle)
        cm = panel * self.swizzle + rem % rows_here
        n = rem // rows_here
        return self.shard_order[step], cm * self.cluster_m + cluster_rank_m, n

    def tiles(self) -> list[tuple[int, int, int]]:
        return [self.get(w, c) for w in range(self.total_work) for c in range(self.cluster_m)]


@dataclass(frozen=True)
class RsChunkGrid:
    """Python twin of flux::RsChunkGrid: the copy-engine ReduceScatter's chunks of one destination shard, a
    schedule panel (along M) times a strip of tiles (along N)."""
    sched: TileSchedule
    chunk_cols: int = 0  # 0: the default, DEFAULT_RS_CHUNK_COLS

    @property
    def tiles_m(self) -> int:  # tiles holding rows (no cluster padding)
        return -(-self.sched.rows_per_shard // self.sched.tile_m)

    @property
    def chunk_tiles_m(self) -> int:
        return self.sched.swizzle * self.sched.cluster_m

    @property
    def chunk_tiles_n(self) -> int:
        strip = -(-(self.chunk_cols or DEFAULT_RS_CHUNK_COLS) // self.sched.tile_n)
        return max(1, min(self.sched.tiles_n, strip))

    @property
    def chunks_m(self) -> int:
        return -(-self.tiles_m // self.chunk_tiles_m)

    @property
    def chunks_n(self) -> int:
        return -(-self.sched.tiles_n // self.chunk_tiles_n)

    def chunk_of(self, m_tile: int, n_tile: int) -> int:
        """The kernel's flag/count index of tile (m, n) (gemm_sm90.cuh epilogue)."""
        return (m_tile // self.chunk_tiles_m) * self.chunks_n + n_tile // self.chunk_tiles_n

    def tiles_in(self, cm: int, cn: int) -> int:
        m_end = min(self.tiles_m, (cm + 1) * self.chunk_tiles_m)
        n_end = min(self.sched.tiles_n, (cn + 1) * self.chunk_tiles_n)
        return (m_end - cm * self.chunk_tiles_m) * (n_end - cn * self.chunk_tiles_n)


@dataclass(frozen=True)
class StreamK:
    """Python twin of flux::StreamK: whole items first, then the k iterations of a last, partial wave spread
    over the clusters."""
    total_work: int
    clusters: int
    k_tiles: int
    enabled: bool = True
    max_fill_pct: int = DEFAULT_STREAM_K_FILL  # flux::LaunchOptions::split_max_fill_pct
    min_iters: int = 8  # flux::StreamK::kMinIters

    @functools.cached_property
    def _plan(self) -> tuple[int, int, int, int]:
        """(dp_work, sk_clusters, iters_per_cluster, sk_iters)."""
        rem = self.total_work % self.clusters if self.clusters > 0 else 0
        if not self.enabled or rem == 0 or 100 * rem > self.max_fill_pct * self.clusters or self.k_tiles < 2:
            return self.total_work, 0, 0, 0
        iters = rem * self.k_tiles
        sk_clusters = min(iters // self.min_iters, self.clusters)
        if sk_clusters <= rem:
            return self.total_work, 0, 0, 0
        q = -(-iters // sk_clusters)
        return self.total_work - rem, -(-iters // q), q, iters

    @property
    def active(self) -> bool:
        return self._plan[1] > 0

    @property
    def split_work(self) -> int:
        """Trailing work items whose k iterations are split (0 when the tail is off)."""
        return self.total_work - self._plan[0]

    def segments(self, cluster: int) -> list[tuple[int, int, int]]:
        """(work item, k_begin, k_end) of `cluster`, in the order it runs them."""
        dp_work, sk_clusters, q, sk_iters = self._plan
        segs = [(w, 0, self.k_tiles) for w in range(cluster, dp_work, self.clusters)]
        if cluster < sk_clusters:
            it, end = cluster * q, min(cluster * q + q, sk_iters)
            while it < end:
                item, k_begin = divmod(it, self.k_tiles)
                k_end = min(self.k_tiles, k_begin + end - it)
                segs.append((dp_work + item, k_begin, k_end))
                it += k_end - k_begin
        return segs

    def contributors(self, item: int) -> list[int]:
        """Clusters whose partials the reducer of split `item` adds, in order (empty if the item is whole)."""
        dp_work, sk_clusters, q, _ = self._plan
        if item < dp_work or sk_clusters == 0:
            return []
        first_iter = (item - dp_work) * self.k_tiles
        last_iter = first_iter + self.k_tiles - 1
        return list(range(first_iter // q + 1, last_iter // q + 1))


def default_rows_per_chunk(rows_per_shard: int, row_bytes: int, tp: int, target_bytes: int = 16 << 20,
                           max_chunks: int = 8, align: int = 128) -> int:
    """Copy-engine chunk size, aligned to the GEMM tile height.

    TP=2: one copy per shard. The GEMM's own shard (half the work) outlasts the peer's transfer on every
    measured shape, so chunks only add a flag write and a stream wait per copy: one chunk made the fused op as
    fast or faster on the four larger benchmark shapes (the fifth already moved one) and the all-gather alone
    2-7% faster (benchmarks/results/history/48e602f, fused_1chunk and ce_ag_1chunk). Larger TP: ~target_bytes
    per copy, at most max_chunks per shard, so that a peer's first rows arrive while the own shard (1/tp of the
    work) is computed."""
    if rows_per_shard <= 0:
        return align
    if tp <= 2:
        return -(-rows_per_shard // align) * align
    chunks = min(max_chunks, max(1, -(-rows_per_shard * row_bytes // target_bytes)))
    rows = -(-rows_per_shard // chunks)
    return -(-rows // align) * align


def chunk_count(rows_per_shard: int, rows_per_chunk: int) -> int:
    return -(-rows_per_shard // rows_per_chunk)
