"""Tile and chunk orders: the properties the fused kernels rely on, and the C++ schedule equal to its mirror."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from flux_layers.runtime import schedules

HERE = os.path.dirname(os.path.abspath(__file__))


def _sched(rows, n, tp, order, tile=(256, 128), swizzle=8):
    return schedules.TileSchedule(rows_per_shard=rows, n=n, num_shards=tp, shard_order=tuple(order),
                                  tile_m=tile[0], tile_n=tile[1], swizzle_m=swizzle)


@pytest.mark.parametrize("rows,n,tp,tile,swizzle", [(1000, 520, 2, (256, 128), 8), (4096, 4096, 4, (128, 256), 16),
                                                     (8, 136, 8, (256, 128), 2), (2048, 28672, 2, (128, 256), 4)])
def test_every_tile_once_and_shards_in_order(rows, n, tp, tile, swizzle):
    for rank in range(tp):
        order = schedules.rs_shard_order(rank, tp)
        s = _sched(rows, n, tp, order, tile, swizzle)
        tiles = s.tiles()
        assert len(tiles) == len(set(tiles)) == tp * s.tiles_m * s.tiles_n
        shards_in_visit_order = [g for g, _, _ in tiles]
        firsts = [shards_in_visit_order.index(g) for g in order]
        assert firsts == sorted(firsts), "a shard must be finished before the next starts"


def test_reduce_scatter_rank_offset():
    for tp in (2, 4, 8):
        orders = [schedules.rs_shard_order(r, tp) for r in range(tp)]
        for r, order in enumerate(orders):
            assert order[-1] == r, "own rows come last"
        for step in range(tp):
            dests = [orders[r][step] for r in range(tp)]
            assert sorted(dests) == list(range(tp)), f"step {step}: two ranks write to one destination"


def test_all_gather_orders_follow_arrival():
    for tp in (2, 4, 8):
        for r in range(tp):
            mesh = schedules.ag_shard_order(r, tp, "mesh")
            ring = schedules.ag_shard_order(r, tp, "ring")
            assert mesh[0] == ring[0] == r and sorted(mesh) == sorted(ring) == list(range(tp))
            assert ring[1] == (r - 1) % tp, "a ring delivers the left neighbour's shard first"
    with pytest.raises(ValueError, match="order"):
        schedules.ag_shard_order(0, 2, "tree")


def test_chunk_heuristic():
    for tp in (4, 8):
        rows = schedules.default_rows_per_chunk(4096, 8192 * 2, tp)
        assert rows % 128 == 0 and 1 < schedules.chunk_count(4096, rows) <= 8
    assert schedules.default_rows_per_chunk(8, 64, 4) == 128
    # TP=2: one copy per shard, rounded up to whole tiles
    assert [schedules.default_rows_per_chunk(r, 8192 * 2, 2) for r in (4096, 1000, 8)] == [4096, 1024, 128]
    assert schedules.chunk_count(1000, 128) == 8


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the C++ schedule")
@pytest.mark.parametrize("rows,n,tp,tile,swizzle", [(1000, 520, 2, (256, 128), 8), (3000, 3000, 4, (128, 256), 16),
                                                     (64, 8, 3, (256, 128), 2)])
def test_cpp_schedule_matches_python(schedule_dump, rows, n, tp, tile, swizzle):
    order = schedules.rs_shard_order(1, tp)
    out = subprocess.run([schedule_dump, str(rows), str(n), str(tp), str(tile[0]), str(tile[1]),
                          str(schedules.CLUSTER_M), str(swizzle)] + [str(g) for g in order],
                         check=True, capture_output=True, text=True).stdout
    cpp = [tuple(int(v) for v in line.split()) for line in out.splitlines()]
    assert cpp == _sched(rows, n, tp, order, tile, swizzle).tiles()


# (work items, clusters, k tiles, fill limit %)
STREAM_K_CASES = [(1024, 66, 128, 75), (256, 66, 128, 75), (256, 66, 128, 100), (1792, 66, 128, 75),
                  (128, 66, 64, 75), (34, 66, 128, 75), (67, 66, 8, 75), (1000, 18, 7, 75), (5, 66, 1000, 75),
                  (2, 66, 16, 75), (65, 66, 128, 100), (65, 66, 128, 98)]


@pytest.mark.parametrize("total,clusters,k_tiles,fill", STREAM_K_CASES)
def test_stream_k_covers_every_iteration_once(total, clusters, k_tiles, fill):
    sk = schedules.StreamK(total, clusters, k_tiles, max_fill_pct=fill)
    covered = {}
    for c in range(clusters):
        segs = sk.segments(c)
        for i, (work, k_begin, k_end) in enumerate(segs):
            assert 0 <= k_begin < k_end <= k_tiles
            if k_begin > 0:  # a partial: only ever a cluster's first split segment, so one slot per CTA holds it
                assert not any(kb > 0 for _, kb, _ in segs[:i])
            for k in range(k_begin, k_end):
                assert (work, k) not in covered
                covered[(work, k)] = c
    assert set(covered) == {(w, k) for w in range(total) for k in range(k_tiles)}
    # Every split item is reduced by the cluster holding k = 0, from exactly the clusters holding its other
    # k iterations, and the per-cluster work differs by at most one item's worth of iterations.
    for w in range(total):
        owners = sorted({covered[(w, k)] for k in range(k_tiles)})
        reducer = covered[(w, 0)]
        assert owners[0] == reducer
        assert sk.contributors(w) == owners[1:]
    loads = [sum(ke - kb for _, kb, ke in sk.segments(c)) for c in range(clusters)]
    if sk.active:
        assert max(loads) < (total // clusters + 1) * k_tiles, "the tail split must shorten the longest cluster"


def test_stream_k_stays_off_where_it_cannot_help():
    assert not schedules.StreamK(132, 66, 128).active      # whole waves
    assert not schedules.StreamK(256, 66, 128).active      # last wave 58/66 full: above the default fill limit
    assert schedules.StreamK(256, 66, 128, max_fill_pct=90).active
    assert not schedules.StreamK(256, 66, 128, max_fill_pct=87).active
    assert not schedules.StreamK(100, 66, 2).active        # too few iterations to split
    assert not schedules.StreamK(100, 66, 128, enabled=False).active
    assert schedules.StreamK(1024, 66, 128).active


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the C++ schedule")
def test_cpp_stream_k_matches_python(schedule_dump):
    for total, clusters, k_tiles, fill in STREAM_K_CASES:
        out = subprocess.run([schedule_dump, "streamk", str(total), str(clusters), str(k_tiles), str(fill)],
                             check=True, capture_output=True, text=True).stdout
        cpp = [tuple(int(v) for v in line.split()) for line in out.splitlines()]
        sk = schedules.StreamK(total, clusters, k_tiles, max_fill_pct=fill)
        py = []
        for c in range(clusters):
            for work, kb, ke in sk.segments(c):
                contrib = sk.contributors(work)
                last = (contrib[-1] if contrib else c) if kb == 0 and ke < k_tiles else -1
                py.append((c, work, kb, ke, last))
        assert cpp == py, (total, clusters, k_tiles, fill)


# (rows per shard, N, tile config, swizzle, chunk columns): the layer and benchmark shapes at TP=2, ragged ones.
RS_CHUNK_CASES = [(2048, 8192, 1, 16, 0), (4096, 8192, 1, 16, 512), (8192, 4096, 1, 16, 0), (1000, 264, 1, 16, 256),
                  (1000, 520, 0, 8, 0), (8, 256, 1, 16, 0), (4096, 12288, 0, 8, 4096), (1000, 768, 0, 8, 300)]


@pytest.mark.parametrize("rows,n,tile,swizzle,cols", RS_CHUNK_CASES)
def test_rs_chunks_counted_complete_and_in_order(rows, n, tile, swizzle, cols):
    """The counts the copy engine waits for equal the tiles the kernel counts into each chunk (a mismatch would
    hang until the timeout), and chunks complete in the order the copy engine moves them."""
    tile_m, tile_n = schedules.TILE_CONFIGS[tile]
    sched = _sched(rows, n, 1, [0], (tile_m, tile_n), swizzle)
    grid = schedules.RsChunkGrid(sched, cols)
    counted, last_item = {}, {}
    for item in range(sched.total_work):
        for c in range(schedules.CLUSTER_M):
            _, m, nt = sched.get(item, c)
            if m * tile_m >= rows:
                continue  # a cluster's padding tile: not stored, not counted
            chunk = grid.chunk_of(m, nt)
            counted[chunk] = counted.get(chunk, 0) + 1
            last_item[chunk] = item
    expected = {cm * grid.chunks_n + cn: grid.tiles_in(cm, cn)
                for cm in range(grid.chunks_m) for cn in range(grid.chunks_n)}
    assert counted == expected
    assert sum(expected.values()) == grid.tiles_m * sched.tiles_n
    order = [last_item[c] for c in sorted(last_item)]
    assert order == sorted(order) and len(set(order)) == len(order)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the C++ schedule")
def test_rs_workspace_flags_hold_every_chunk(schedule_dump):
    """The reduce-scatter workspace's flags per source (its layout, workspace_layout.h, sized for 128-row and
    128-column tiles as RsWorkspace makes it) hold every chunk of the C++ chunk grid."""
    for rows, n, tile, swizzle, cols in RS_CHUNK_CASES:
        tile_m, tile_n = schedules.TILE_CONFIGS[tile]
        grid = subprocess.run([schedule_dump, "rschunks", str(rows), str(n), str(tile_m), str(tile_n), str(swizzle),
                               str(cols)], check=True, capture_output=True, text=True).stdout.split()
        flags = subprocess.run([schedule_dump, "rsflags", str(rows), str(n), "128"], check=True, capture_output=True,
                               text=True).stdout
        assert int(grid[2]) * int(grid[3]) <= int(flags), (rows, n, tile, cols)
    small = subprocess.run([schedule_dump, "rsflags", "128", "96", "64"], check=True, capture_output=True, text=True)
    assert int(small.stdout) == 2 * 2, "64-row tiles: 2 along M (a whole cluster) x 2 along N"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the C++ schedule")
def test_cpp_rs_chunks_match_python(schedule_dump):
    for rows, n, tile, swizzle, cols in RS_CHUNK_CASES:
        tile_m, tile_n = schedules.TILE_CONFIGS[tile]
        out = subprocess.run([schedule_dump, "rschunks", str(rows), str(n), str(tile_m), str(tile_n), str(swizzle),
                              str(cols)], check=True, capture_output=True, text=True).stdout.splitlines()
        grid = schedules.RsChunkGrid(_sched(rows, n, 1, [0], (tile_m, tile_n), swizzle), cols)
        assert tuple(int(v) for v in out[0].split()) == (grid.chunk_tiles_m, grid.chunk_tiles_n, grid.chunks_m,
                                                         grid.chunks_n)
        py = [(cm, cn, cm * grid.chunks_n + cn, grid.tiles_in(cm, cn))
              for cm in range(grid.chunks_m) for cn in range(grid.chunks_n)]
        assert [tuple(int(v) for v in line.split()) for line in out[1:-1]] == py, (rows, n, tile, swizzle, cols)
        tiles_n = grid.sched.tiles_n
        assert [int(v) for v in out[-1].split()] == [grid.chunk_of(m, nt) for m in range(grid.tiles_m)
                                                     for nt in range(tiles_n)], (rows, n, tile, swizzle, cols)


SIGNATURES = [(0, 0, 2, 4096), (1, 1, 1, 11008), (0, 1, 3, 1), (1, 0, 0, 2**26 - 1), (0, 0, 0, 2**26),
              (1, 1, 15, 3 * 2**26 + 5)]  # (op, layout, transport, dim)


@pytest.mark.parametrize("op,layout,transport,dim", SIGNATURES)
def test_call_signature_word_round_trips(schedule_dump, op, layout, transport, dim):
    """The kernels compare signature words; the host decodes a mismatch's words into both calls: every field comes
    back, and a dimension past the word's 26 bits is written as 2^26 - 1 rather than wrapped."""
    out = subprocess.run([schedule_dump, "signature", str(op), str(layout), str(transport), str(dim)],
                         capture_output=True, text=True, check=True).stdout.split()
    word, *fields = (int(v) for v in out)
    assert fields == [op, layout, transport, min(dim, 2**26 - 1)]
    assert word < 2**32


@pytest.mark.parametrize("tp,capacity", [(2, 1), (2, 16), (4, 3), (8, 64)])
def test_all_gather_flag_words_are_distinct_and_released(schedule_dump, tp, capacity):
    """Every word of the all-gather's flag layout has its own index inside the layout; the release range (what a
    failed call sets to its maximum so that every wait returns) holds exactly the words a wait reads (chunk,
    avail, done, started, sent), and neither the signatures nor the kernel's count of finished CTAs, which a
    release would corrupt."""
    out = subprocess.run([schedule_dump, "agflags", str(tp), str(capacity)], capture_output=True, text=True,
                         check=True).stdout
    words: dict[str, list[int]] = {}
    for line in out.splitlines():
        name, *values = line.split()
        words.setdefault(name, []).extend(int(v) for v in values)
    (release,), (total,) = words.pop("release_words"), words.pop("words")
    every = [i for indices in words.values() for i in indices]
    assert len(every) == len(set(every)) == total, "a flag word is shared or the layout has gaps"
    assert sorted(every) == list(range(total))
    assert [len(words[n]) for n in ("chunk", "avail", "done", "started", "sent", "signature", "finished")] == \
        [tp * capacity, tp * capacity, tp, 1, 1, 3 * tp, 1]
    waited = {i for n in ("chunk", "avail", "done", "started", "sent") for i in words[n]}
    assert waited == set(range(release)), "the release range is not exactly the waited words"


def test_constants_match_the_cpp_headers(schedule_dump):
    """schedules.py's constants mirror csrc/include/flux/gemm_params.h and tile_schedule.cuh, their one source."""
    out = subprocess.run([schedule_dump, "constants"], capture_output=True, text=True, check=True).stdout
    cpp, tiles = {}, {}
    for line in out.splitlines():
        name, *values = line.split()
        if name == "tile":
            tiles[int(values[0])] = (int(values[1]), int(values[2]))
        else:
            cpp[name] = int(values[0])
    assert cpp == {"max_tp": schedules.MAX_TP, "cluster_m": schedules.CLUSTER_M,
                   "split_max_fill_pct": schedules.DEFAULT_STREAM_K_FILL,
                   "rs_chunk_cols": schedules.DEFAULT_RS_CHUNK_COLS, "signature_words": schedules.SIGNATURE_WORDS,
                   "error_record_words": schedules.ERROR_RECORD_WORDS}
    assert tiles == schedules.TILE_CONFIGS
