"""Tile and chunk orders: the properties the fused kernels rely on, and the C++ schedule equal to its mirror."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from flux_layers.runtime import schedules

HERE = os.path.dirname(os.path.abspath(__file__))


def _sched(rows, n, tp, order, tile=(256, 128), swizzle=8):
    return schedules.TileSchedule(rows_per_group=rows, n=n, num_groups=tp, group_order=tuple(order),
                                  tile_m=tile[0], tile_n=tile[1], swizzle_m=swizzle)


@pytest.mark.parametrize("rows,n,tp,tile,swizzle", [(1000, 520, 2, (256, 128), 8), (4096, 4096, 4, (128, 256), 16),
                                                     (8, 136, 8, (256, 128), 2), (2048, 28672, 2, (128, 256), 4)])
def test_every_tile_once_and_groups_in_order(rows, n, tp, tile, swizzle):
    for rank in range(tp):
        order = schedules.rs_group_order(rank, tp)
        s = _sched(rows, n, tp, order, tile, swizzle)
        tiles = s.tiles()
        assert len(tiles) == len(set(tiles)) == tp * s.tiles_m * s.tiles_n
        groups_in_visit_order = [g for g, _, _ in tiles]
        firsts = [groups_in_visit_order.index(g) for g in order]
        assert firsts == sorted(firsts), "a group must be finished before the next starts"


def test_reduce_scatter_rank_offset():
    for tp in (2, 4, 8):
        orders = [schedules.rs_group_order(r, tp) for r in range(tp)]
        for r, order in enumerate(orders):
            assert order[-1] == r, "own rows come last"
        for step in range(tp):
            dests = [orders[r][step] for r in range(tp)]
            assert sorted(dests) == list(range(tp)), f"step {step}: two ranks write to one destination"


def test_all_gather_orders_follow_arrival():
    for tp in (2, 4, 8):
        for r in range(tp):
            mesh = schedules.ag_group_order(r, tp, "mesh")
            ring = schedules.ag_group_order(r, tp, "ring")
            assert mesh[0] == ring[0] == r and sorted(mesh) == sorted(ring) == list(range(tp))
            assert ring[1] == (r - 1) % tp, "a ring delivers the left neighbour's shard first"
    with pytest.raises(ValueError, match="order"):
        schedules.ag_group_order(0, 2, "tree")


def test_chunk_heuristic():
    rows = schedules.default_rows_per_chunk(4096, 8192 * 2)
    assert rows % 128 == 0 and schedules.chunk_count(4096, rows) <= 8
    assert schedules.default_rows_per_chunk(8, 64) == 128
    assert schedules.chunk_count(1000, 128) == 8


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the C++ schedule")
@pytest.mark.parametrize("rows,n,tp,tile,swizzle", [(1000, 520, 2, (256, 128), 8), (3000, 3000, 4, (128, 256), 16),
                                                     (64, 8, 3, (256, 128), 2)])
def test_cpp_schedule_matches_python(tmp_path, rows, n, tp, tile, swizzle):
    exe = tmp_path / "schedule_dump"
    include = os.path.join(HERE, "..", "..", "csrc", "include")
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", include, "-o", str(exe), os.path.join(HERE, "schedule_dump.cpp")],
                   check=True)
    order = schedules.rs_group_order(1, tp)
    out = subprocess.run([str(exe), str(rows), str(n), str(tp), str(tile[0]), str(tile[1]),
                          str(schedules.CLUSTER_M), str(swizzle)] + [str(g) for g in order],
                         check=True, capture_output=True, text=True).stdout
    cpp = [tuple(int(v) for v in line.split()) for line in out.splitlines()]
    assert cpp == _sched(rows, n, tp, order, tile, swizzle).tiles()
