"""The two-level reduce-scatter's routes (csrc/include/flux/workspace_layout.h ``RsTwoLevel``: what the kernel and
csrc/runtime/gemm_rs.cpp run for the hybrid transport), read from the C++ (tests/cpu/schedule_dump.cpp) and executed
on CPU tensors: every rank's tile of every block goes to exactly one place, every receive slot has one writer per
call, the collectors' node partials reach their owners through the plan's inter-node batches
(nccl_rs_transport.node_partial_batches), and each owner's result is the plan's sum (``RsPlan.sum_order``),
bitwise; the GEMM's block order is transfer_plan.rs_gemm_order, and every wait for a partial is for a tile its
writer makes earlier in its own walk (no rank waits on a tile that waits on it)."""
from __future__ import annotations

import subprocess

import pytest
import torch

from flux_layers.runtime.multinode import nccl_rs_transport as rs
from flux_layers.runtime.multinode.transfer_plan import GroupLayout, build_rs_plan, rs_gemm_order

LAYOUTS = [(2, 1), (2, 2), (2, 4), (4, 2), (3, 2), (8, 1)]  # nodes x ranks per node (the op library's tp <= 8)


def _routes(exe: str, rank: int, tp: int, size: int) -> dict[str, list[int]]:
    out = subprocess.run([exe, "rstwolevel", str(rank), str(tp), str(size)], check=True, capture_output=True,
                         text=True).stdout
    return {name: [int(v) for v in values] for name, *values in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("nnodes,size", LAYOUTS, ids=[f"{a}x{b}" for a, b in LAYOUTS])
def test_the_kernels_block_order_is_the_plans(schedule_dump, nnodes, size):
    layout = GroupLayout.uniform(nnodes, size)
    for rank in range(layout.tp):
        assert tuple(_routes(schedule_dump, rank, layout.tp, size)["order"]) == rs_gemm_order(layout, rank), rank


def _reduce(parts) -> torch.Tensor:
    """Partials added in the order given, as the kernel adds them to its accumulator."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


@pytest.mark.parametrize("nnodes,size", LAYOUTS, ids=[f"{a}x{b}" for a, b in LAYOUTS])
def test_routes_deliver_every_partial_once_and_sum_in_the_plans_order(schedule_dump, nnodes, size):
    layout = GroupLayout.uniform(nnodes, size)
    tp = layout.tp
    plan = build_rs_plan(layout)
    routes = [_routes(schedule_dump, r, tp, size) for r in range(tp)]
    gen = torch.Generator().manual_seed(nnodes * 10 + size)
    # partial[r][b]: rank r's tile of block b, values over many magnitudes so that the order of the adds shows
    partial = torch.randn(tp, tp, 4, 8, generator=gen) * torch.logspace(-4, 4, 8)
    slots: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (rank, slot) -> (writer, data)

    def put(rank: int, slot: int, writer: int, data: torch.Tensor) -> None:
        assert slot != rank and (rank, slot) not in slots, f"rank {rank}'s slot {slot} written twice"
        slots[(rank, slot)] = (writer, data)

    def reduced(r: int, b: int) -> torch.Tensor:
        """Rank r's sum for block b: its own tile, then its slots in the routes' order, each from the source the
        routes name."""
        t = routes[r]
        acc = [partial[r, b]]
        for s in range(t["first_partial"][b], t["first_partial"][b] + t["partial_count"][b]):
            writer, data = slots[(r, t["partial_slot"][s])]
            assert writer == t["partial_source"][s], f"rank {r} block {b}: slot {t['partial_slot'][s]} from {writer}"
            acc.append(data)
        return _reduce(acc)

    # Inside the nodes: the epilogue's stores into the owners' and collectors' slots.
    for r in range(tp):
        t = routes[r]
        for b in range(tp):
            dest, collected = t["dest"][b], t["collected"][b]
            if b == r or collected:
                assert dest == -1, (r, b)
                assert collected == (b != r and layout.local_index(b) == layout.local_index(r)), (r, b)
                continue
            assert layout.same_node(dest, r) and layout.local_index(dest) == layout.local_index(b), (r, b, dest)
            put(dest, t["dest_slot"][b], r, partial[r, b])
    # The collectors' node partials, moved by the plan's inter-node batches into the owner's slot of the collector.
    for r in range(tp):
        for batch in rs.node_partial_batches(plan, r):
            assert routes[r]["collected"][batch.dst], f"rank {r} sends a block it does not collect: {batch}"
            put(batch.dst, r, r, reduced(r, batch.dst))
    assert sorted(slots) == sorted((r, q) for r in range(tp) for q in range(tp) if q != r), "slots left empty"
    for d in range(tp):
        got = reduced(d, d)
        want = _reduce([_reduce([partial[q, d] for q in ranks]) for ranks in plan.sum_order[d]])
        assert torch.equal(got, want), f"block {d}: not the plan's sum"
        torch.testing.assert_close(got.double(), partial[:, d].double().sum(0), rtol=1e-5, atol=1e-4)
        for s, slot in enumerate(routes[d]["partial_slot"]):
            assert bool(routes[d]["from_caller"][s]) == (not layout.same_node(slot, d) and
                                                         layout.local_index(slot) == layout.local_index(d)), (d, slot)


@pytest.mark.parametrize("nnodes,size", LAYOUTS, ids=[f"{a}x{b}" for a, b in LAYOUTS])
def test_a_partial_is_made_before_its_reader_waits_for_it(schedule_dump, nnodes, size):
    """A block's tile that adds node peers' partials sits, in its rank's walk, after each writer's tile of that
    block in the writer's walk: by induction on the position no wait points forward (the node partials come after
    the collector's walk of that node, and the owner's own block is its last)."""
    layout = GroupLayout.uniform(nnodes, size)
    tp = layout.tp
    routes = [_routes(schedule_dump, r, tp, size) for r in range(tp)]
    for r in range(tp):
        t = routes[r]
        for b in range(tp):
            for s in range(t["first_partial"][b], t["first_partial"][b] + t["partial_count"][b]):
                writer = t["partial_source"][s]
                if t["from_caller"][s]:
                    assert b == r and t["order"].index(b) == tp - 1
                    continue
                assert routes[writer]["order"].index(b) < t["order"].index(b), (r, b, writer)
