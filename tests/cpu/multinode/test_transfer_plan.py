"""Transfer plans (flux_layers/runtime/multinode/transfer_plan.py) and the topology that feeds them: every order
delivers every chunk to every rank once, crosses between nodes once per destination node, never waits on later data; the
validator rejects hand-broken plans; topology detection and the fused-path blocker run on CPU with the CUDA
queries replaced."""
from __future__ import annotations

import dataclasses
import random
import sys
import types

import pytest
import torch

from flux_layers import _env
from flux_layers.runtime import schedules, topology
from flux_layers.runtime.multinode.transfer_plan import (
    Arrival,
    GroupLayout,
    PlanError,
    Transfer,
    ag_plan_problems,
    build_ag_plan,
    build_rs_plan,
    choose_order,
    choose_transport,
    rs_plan_problems,
    validate_ag_plan,
)

MULTI_NODE = [(2, 1), (2, 2), (2, 4), (4, 2), (2, 8)]  # (nnodes, ranks per node)
HALVES = {2: (0, 1), 4: (0, 0, 1, 1), 8: (0, 0, 0, 0, 1, 1, 1, 1)}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("AG_ORDER", "NODE_SIZE", "TRANSPORT", "NUMA_MAP"):
        monkeypatch.delenv("FLUX_LAYERS_" + name, raising=False)
    topology.peer_access_matrix.cache_clear()
    topology.detect_order.cache_clear()
    yield
    topology.peer_access_matrix.cache_clear()
    topology.detect_order.cache_clear()


def simulate(plan):
    """Run the plan on per-rank buffers, independently of the validator: a transfer reads its source's buffer as it
    was before the step (so a step cannot use data that arrives in the same or a later step) and may not overwrite
    a chunk the destination already has. Returns the buffers and the list of (step, transfer)."""
    lay = plan.layout
    have = [{(r, c): ("data", r, c) for c in range(plan.chunks)} for r in range(lay.tp)]
    done = []
    for s, step in enumerate(plan.steps):
        before = [dict(h) for h in have]
        for t in step:
            assert t.chunk in before[t.src], f"step {s}: {t.src} sends {t.chunk} before holding it"
            assert t.chunk not in have[t.dst], f"step {s}: {t.dst} receives {t.chunk} a second time"
            have[t.dst][t.chunk] = before[t.src][t.chunk]
            done.append((s, t))
    for r in range(lay.tp):
        assert have[r] == {(g, c): ("data", g, c) for g in range(lay.tp) for c in range(plan.chunks)}, r
    return have, done


def numa_crossings(plan):
    lay = plan.layout
    return sum(1 for _, t in plan.transfers()
               if lay.same_node(t.src, t.dst) and lay.numa_of[t.src] != lay.numa_of[t.dst])


# --------------------------------------------------------------------------------------------------------------
# All-gather: the multi-node matrix
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("nnodes,size", MULTI_NODE)
def test_internode_delivers_once_and_crosses_nodes_once(nnodes, size, chunks):
    lay = GroupLayout.uniform(nnodes, size)
    plan = build_ag_plan(lay, chunks=chunks)
    assert plan.order == "internode" and ag_plan_problems(plan) == []
    tp = lay.tp
    _, done = simulate(plan)
    assert len(done) == tp * (tp - 1) * chunks
    # Inter-node traffic counted directly: each chunk once into each other node; a mesh over all ranks would send
    # it to every remote rank.
    cross = [t for _, t in done if not lay.same_node(t.src, t.dst)]
    assert len(cross) == tp * chunks * (nnodes - 1)
    if size > 1:
        assert len(cross) < tp * chunks * (tp - size)
    assert all(t.transport == "nccl" and t.src == t.chunk[0] for t in cross), "owners send over the network"
    assert all(lay.local_index(t.src) == lay.local_index(t.dst) for t in cross), "to the same local index"
    assert all(t.transport == "copy_engine" for _, t in done if lay.same_node(t.src, t.dst))
    assert len(plan.steps) == (nnodes if size > 1 else nnodes - 1)
    # Step 0 overlaps the whole local exchange with the first inter-node transfers.
    step0 = plan.steps[0]
    local0 = {(t.chunk, t.dst) for t in step0 if lay.same_node(t.src, t.dst)}
    assert local0 == {((g, c), r) for r in range(tp) for g in lay.members(lay.node_of[r]) if g != r
                      for c in range(chunks)}
    assert sum(not lay.same_node(t.src, t.dst) for t in step0) == tp * chunks
    # Per step, every rank sends and receives at most one shard over the network.
    for step in plan.steps:
        for r in range(tp):
            assert sum(t.src == r and not lay.same_node(t.src, t.dst) for t in step) <= chunks
            assert sum(t.dst == r and not lay.same_node(t.src, t.dst) for t in step) <= chunks
    for r, order in enumerate(plan.gemm_order):
        local = [g for g in lay.members(lay.node_of[r]) if g != r]
        assert order[0] == r and sorted(order[1:1 + len(local)]) == local and sorted(order) == list(range(tp))


@pytest.mark.parametrize("nnodes,size", [(1, 8), (2, 8), (2, 4), (4, 2), (1, 4)])
def test_numa2d_forced_with_a_numa_map(monkeypatch, nnodes, size):
    monkeypatch.setenv("FLUX_LAYERS_NUMA_MAP", ",".join(map(str, HALVES[size])))
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", str(size))
    monkeypatch.setenv("FLUX_LAYERS_AG_ORDER", "numa2d")
    tp = nnodes * size
    lay = topology.group_layout(range(tp), topology.node_ids(tp),
                                peer=GroupLayout.uniform(nnodes, size).peer, nvlink=False)
    assert lay.numa_of == HALVES[size] * nnodes
    order = topology.ag_order(tuple(range(tp)))
    assert order == "numa2d"
    plan = build_ag_plan(lay, order, chunks=2)
    assert ag_plan_problems(plan) == []
    _, done = simulate(plan)
    assert len(done) == tp * (tp - 1) * 2
    assert len(plan.steps) == nnodes * (size - 1)
    # Each shard held in a node crosses into the other NUMA domain once: L crossings per chunk and node, per
    # phase (the 1-D ring needs 2(L-1)).
    assert numa_crossings(plan) == nnodes * nnodes * size * 2
    if nnodes == 1 and size > 2:
        ring = build_ag_plan(GroupLayout.uniform(1, size, numa=HALVES[size], nvlink=False), "ring", chunks=2)
        assert numa_crossings(ring) == 2 * (size - 1) * 2 > numa_crossings(plan)
    h = size // 2
    for p in range(nnodes):
        for s in range(size - 1):
            step = plan.steps[p * (size - 1) + s]
            local = [t for t in step if lay.same_node(t.src, t.dst)]
            # a ring: every rank sends one shard and receives one per step
            assert sorted(t.src for t in local) == sorted(t.dst for t in local) == sorted(
                [r for r in range(tp) for _ in range(2)])
            if s >= h:
                assert all(lay.numa_of[t.src] == lay.numa_of[t.dst] for t in local), "inter-NUMA part comes first"
    cross = [t for _, t in done if not lay.same_node(t.src, t.dst)]
    assert len(cross) == tp * 2 * (nnodes - 1) and all(t.transport == "nccl" for t in cross)


def test_numa2d_with_interleaved_numa_ids_and_bad_maps():
    lay = GroupLayout.uniform(1, 8, numa=(0, 1, 0, 1, 0, 1, 0, 1), nvlink=False)
    plan = build_ag_plan(lay, "numa2d")
    simulate(plan)
    assert numa_crossings(plan) == 8
    for numa in [(0,) * 8, (0, 0, 0, 1, 1, 1, 1, 1), (0, 0, 1, 1, 2, 2, 3, 3)]:
        with pytest.raises(ValueError, match="two NUMA domains of equal size"):
            build_ag_plan(GroupLayout.uniform(1, 8, numa=numa, nvlink=False), "numa2d")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_single_node_mesh_and_ring_match_the_kernels_order(tp):
    for order, nvlink in (("mesh", True), ("ring", False)):
        lay = GroupLayout.uniform(1, tp, nvlink=nvlink)
        plan = build_ag_plan(lay, chunks=2)
        assert plan.order == (order if tp > 2 else "mesh")
        plan = build_ag_plan(lay, order, chunks=2)
        simulate(plan)
        assert len(plan.steps) == (1 if order == "mesh" else tp - 1)
        assert all(t.transport == "copy_engine" for _, t in plan.transfers())
        for r in range(tp):
            assert list(plan.gemm_order[r]) == schedules.ag_shard_order(r, tp, order)
        if order == "ring":
            assert all(t.dst == (t.src + 1) % tp for _, t in plan.transfers())


def test_order_choice():
    assert choose_order(GroupLayout.uniform(1, 8)) == "mesh"
    assert choose_order(GroupLayout.uniform(1, 8, nvlink=False)) == "ring"
    assert choose_order(GroupLayout.uniform(1, 8, numa=HALVES[8], nvlink=False)) == "ring"  # design.md's table
    assert choose_order(GroupLayout.uniform(1, 4, no_peer=[(0, 3)])) == "ring"
    assert choose_order(GroupLayout.uniform(1, 2, no_peer=[(0, 1)])) == "mesh"
    assert choose_order(GroupLayout.uniform(2, 8)) == "internode"
    assert choose_order(GroupLayout.uniform(2, 8, numa=HALVES[8], nvlink=False)) == "numa2d"
    assert choose_order(GroupLayout.uniform(2, 8, nvlink=False)) == "internode"
    assert choose_order(GroupLayout.uniform(2, 1, nvlink=False)) == "internode"
    with pytest.raises(ValueError, match="spans 2 nodes"):
        choose_order(GroupLayout.uniform(2, 4), "ring")
    with pytest.raises(ValueError, match="order must be one of"):
        choose_order(GroupLayout.uniform(1, 4), "tree")


# --------------------------------------------------------------------------------------------------------------
# Transport: pairs without peer access take NCCL
# --------------------------------------------------------------------------------------------------------------

def test_no_peer_access_pair_takes_nccl():
    lay = GroupLayout.uniform(1, 4, no_peer=[(1, 2)], nvlink=False)
    plan = build_ag_plan(lay, chunks=2)
    assert plan.order == "ring"
    simulate(plan)
    for _, t in plan.transfers():
        assert t.transport == ("nccl" if {t.src, t.dst} == {1, 2} else "copy_engine")
    lay = GroupLayout.uniform(2, 4, no_peer=[(4, 6)])
    plan = build_ag_plan(lay, "internode")
    assert {t.transport for _, t in plan.transfers() if {t.src, t.dst} == {4, 6}} == {"nccl"}
    assert {t.transport for _, t in plan.transfers() if {t.src, t.dst} == {0, 2}} == {"copy_engine"}
    forced = build_ag_plan(lay, "internode", transport="nccl")
    assert {t.transport for _, t in forced.transfers()} == {"nccl"}
    with pytest.raises(ValueError, match=r"ranks \(4, 6\)"):
        choose_transport(lay, "copy_engine")
    assert choose_transport(GroupLayout.uniform(2, 2), "copy_engine")[0] == (None, "copy_engine", "nccl", "nccl")


def test_detected_missing_peer_access_reaches_the_plan(monkeypatch):
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} != {1, 3})
    lay = topology.group_layout((0, 1, 2, 3), (0, 0, 0, 0), numa_of=(0,) * 4, nvlink=True)
    assert not lay.can_copy(1, 3) and lay.can_copy(0, 1)
    assert choose_order(lay) == "ring"
    plan = build_ag_plan(lay, "mesh")
    assert {t.transport for _, t in plan.transfers() if {t.src, t.dst} == {1, 3}} == {"nccl"}


# --------------------------------------------------------------------------------------------------------------
# Per-rank view for an executor
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["push", "pull"])
def test_rank_ops_cover_each_transfer_and_pair_nccl_in_order(mode):
    lay = GroupLayout.uniform(2, 4, no_peer=[(0, 1)])
    plan = build_ag_plan(lay, chunks=2)
    ops = {r: plan.rank_ops(r, mode) for r in range(lay.tp)}
    copies = [o.transfer for r in ops for o in ops[r] if o.action == "copy"]
    assert sorted(copies, key=repr) == sorted([t for _, t in plan.transfers() if t.transport == "copy_engine"],
                                              key=repr)
    for r in ops:
        assert [o.step for o in ops[r]] == sorted(o.step for o in ops[r])
        for o in ops[r]:
            if o.action == "copy":
                assert r == (o.transfer.src if mode == "push" else o.transfer.dst)
    for a in range(lay.tp):
        for b in range(lay.tp):
            sends = [o.transfer for o in ops[a] if o.action == "send" and o.transfer.dst == b]
            recvs = [o.transfer for o in ops[b] if o.action == "recv" and o.transfer.src == a]
            assert sends == recvs
    with pytest.raises(ValueError, match="mode"):
        plan.rank_ops(0, "shove")


# --------------------------------------------------------------------------------------------------------------
# The validator rejects broken plans
# --------------------------------------------------------------------------------------------------------------

def _with_steps(plan, steps):
    return dataclasses.replace(plan, steps=tuple(tuple(s) for s in steps))


def test_validator_rejects_a_duplicated_transfer():
    plan = build_ag_plan(GroupLayout.uniform(2, 2))
    steps = [list(s) for s in plan.steps]
    steps[1].append(steps[0][0])
    problems = ag_plan_problems(_with_steps(plan, steps))
    assert problems and all("2 times, not once" in p for p in problems), problems
    with pytest.raises(PlanError, match="2 times"):
        validate_ag_plan(_with_steps(plan, steps))


def test_validator_rejects_waiting_on_a_later_step():
    plan = build_ag_plan(GroupLayout.uniform(1, 4, nvlink=False), "ring")
    steps = [list(s) for s in plan.steps]
    moved = steps[2].pop(0)  # a forward of a chunk that arrives in step 1, moved into step 1
    steps[1].append(moved)
    problems = ag_plan_problems(_with_steps(plan, steps))
    assert any("before it has it" in p and "step 1" in p for p in problems), problems
    with pytest.raises(AssertionError, match="before holding it"):
        simulate(_with_steps(plan, steps))
    # the same transfer with its dependency dropped
    steps = [list(s) for s in plan.steps]
    steps[2][0] = dataclasses.replace(steps[2][0], waits_on=None)
    assert any("not on the chunk's arrival" in p for p in ag_plan_problems(_with_steps(plan, steps)))


def test_validator_rejects_a_chunk_crossing_nodes_twice():
    lay = GroupLayout.uniform(2, 2)
    plan = build_ag_plan(lay)
    steps = [list(s) for s in plan.steps]
    # node 1 gets chunk (0, 0) over the network at rank 2 (step 0), then fans it out to rank 3 (step 1); replace the
    # fan-out by a second network transfer from the owner: every rank still receives it once.
    i = next(i for i, t in enumerate(steps[1]) if t.chunk == (0, 0) and t.dst == 3)
    steps[1][i] = Transfer((0, 0), 0, 3, "nccl", None)
    simulate(_with_steps(plan, steps))
    assert ag_plan_problems(_with_steps(plan, steps)) == ["chunk (0, 0) crosses into node 1 2 times, not once"]


def test_validator_rejects_a_ring_across_nodes_and_wrong_transports():
    ring = build_ag_plan(GroupLayout.uniform(1, 4, nvlink=False), "ring")
    lay = GroupLayout.uniform(2, 2)
    fixed = [[dataclasses.replace(t, transport="nccl" if not lay.same_node(t.src, t.dst) else t.transport)
              for t in step] for step in ring.steps]
    spread = dataclasses.replace(ring, layout=lay, steps=tuple(map(tuple, fixed)))
    assert any("crosses back into its owner's node" in p for p in ag_plan_problems(spread))
    plain = dataclasses.replace(ring, layout=lay)
    assert any("only NCCL reaches another node" in p for p in ag_plan_problems(plain))
    nopeer = dataclasses.replace(ring, layout=GroupLayout.uniform(1, 4, no_peer=[(0, 1)]))
    assert any("cannot map each other's memory" in p for p in ag_plan_problems(nopeer))


def test_validator_rejects_bad_gemm_orders():
    plan = build_ag_plan(GroupLayout.uniform(2, 2))
    orders = list(plan.gemm_order)
    orders[0] = (1, 0, 2, 3)
    assert any("its own (0) first" in p for p in ag_plan_problems(dataclasses.replace(plan, gemm_order=tuple(orders))))
    orders[0] = (0, 2, 1, 3)
    assert any("remote shard before a local one" in p
               for p in ag_plan_problems(dataclasses.replace(plan, gemm_order=tuple(orders))))
    orders[0] = (0, 1, 3, 2)  # 3's shard arrives in step 1, 2's in step 0
    assert any("does not follow arrival" in p
               for p in ag_plan_problems(dataclasses.replace(plan, gemm_order=tuple(orders))))


def test_validator_rejects_a_missing_transfer_and_a_send_to_the_owner():
    plan = build_ag_plan(GroupLayout.uniform(1, 4, nvlink=False), "ring")
    steps = [list(s) for s in plan.steps]
    t = steps[1][0]  # rank 0 forwards shard 3 to rank 1; send it back to its owner instead
    steps[1][0] = dataclasses.replace(t, dst=t.chunk[0])
    problems = ag_plan_problems(_with_steps(plan, steps))
    assert any("sends the chunk to its owner" in p for p in problems), problems
    assert any(f"chunk {t.chunk} reaches rank {t.dst} 0 times" in p for p in problems), problems
    steps[1][0] = dataclasses.replace(t, dst=t.src)
    assert any("sends to itself" in p for p in ag_plan_problems(_with_steps(plan, steps)))


# --------------------------------------------------------------------------------------------------------------
# GEMM+ReduceScatter across nodes
# --------------------------------------------------------------------------------------------------------------

def run_rs(plan, partials, shuffle_seed=None, arrival_order_sum=False):
    """Execute an RsPlan on [tp, tp*rows, cols] partials: collectors sum their node's partials in sum_order, the
    sends deliver node partials to owners, owners sum node partials in sum_order (or, for the contrast, as they
    arrive). Returns each rank's [rows, cols] result."""
    lay, tp = plan.layout, plan.layout.tp
    rows = partials.shape[1] // tp
    block = lambda x, d: x[d * rows:(d + 1) * rows]  # noqa: E731

    def node_partial(n, d):
        ranks = plan.sum_order[d][[lay.node_of[rs[0]] for rs in plan.sum_order[d]].index(n)]
        acc = block(partials[ranks[0]], d).clone()
        for r in ranks[1:]:
            acc += block(partials[r], d)
        return acc

    held = {}  # (collector, d) -> node partial
    for r in range(tp):
        for d in range(tp):
            if lay.local_index(r) == lay.local_index(d):
                held[(r, d)] = node_partial(lay.node_of[r], d)
    inbox = {d: {lay.node_of[d]: held[(d, d)]} for d in range(tp)}
    arrivals = {d: [lay.node_of[d]] for d in range(tp)}
    sends = [t for _, t in plan.sends() if t.chunk[1] == 0]  # chunks carry rows; one chunk per block here
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(sends)
    for t in sends:
        d = t.dst
        assert (t.src, d) in held, f"{t.src} sends a node partial of block {d} it does not collect"
        n = lay.node_of[t.src]
        assert n not in inbox[d]
        inbox[d][n] = held[(t.src, d)]
        arrivals[d].append(n)
    out = []
    for d in range(tp):
        order = arrivals[d] if arrival_order_sum else [lay.node_of[rs[0]] for rs in plan.sum_order[d]]
        assert sorted(order) == list(range(lay.nnodes))
        acc = inbox[d][order[0]].clone()
        for n in order[1:]:
            acc += inbox[d][n]
        out.append(acc)
    return out


@pytest.mark.parametrize("nnodes,size", MULTI_NODE + [(1, 4), (1, 8)])
def test_rs_plan_sends_each_node_partial_once_in_completion_order(nnodes, size):
    lay = GroupLayout.uniform(nnodes, size)
    plan = build_rs_plan(lay, chunks=3)
    assert rs_plan_problems(plan) == []
    tp = lay.tp
    sends = [t for _, t in plan.sends()]
    assert len(sends) == tp * 3 * (nnodes - 1)
    assert all(t.transport == "nccl" and not lay.same_node(t.src, t.dst) for t in sends)
    for step in plan.steps:
        for r in range(tp):
            assert sum(t.src == r for t in step) == 3 and sum(t.dst == r for t in step) == 3
    for r in range(tp):
        order = plan.gemm_order[r]
        assert order[-1] == r and all(not lay.same_node(d, r) for d in order[:tp - size])
        if nnodes == 1:
            assert list(order) == schedules.rs_shard_order(r, tp)
    for pos in range(tp):  # at every position a node's ranks feed different collectors
        for n in range(nnodes):
            assert len({lay.local_index(plan.gemm_order[r][pos]) for r in lay.members(n)}) == size
    for r in range(tp):
        ready = [t.ready_after for _, t in plan.sends() if t.src == r]
        assert ready == sorted(ready)


@pytest.mark.parametrize("nnodes,size", [(2, 2), (4, 2), (2, 4)])
def test_rs_result_is_bitwise_repeatable_and_correct(nnodes, size):
    lay = GroupLayout.uniform(nnodes, size)
    plan = build_rs_plan(lay)
    tp, rows, cols = lay.tp, 16, 64
    gen = torch.Generator().manual_seed(7)
    partials = torch.randn(tp, tp * rows, cols, generator=gen) * torch.logspace(-3, 3, cols)
    want = partials.double().sum(0)
    first = run_rs(plan, partials)
    for d in range(tp):
        torch.testing.assert_close(first[d].double(), want[d * rows:(d + 1) * rows], rtol=1e-5, atol=1e-3)
    for seed in range(5):
        again = run_rs(plan, partials, shuffle_seed=seed)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    if nnodes > 2:  # the fixed order is what makes it repeatable: summing as partials arrive is not
        sums = [run_rs(plan, partials, shuffle_seed=s, arrival_order_sum=True) for s in range(5)]
        assert any(not all(torch.equal(a, b) for a, b in zip(sums[0], s)) for s in sums[1:])


def test_rs_validator_rejects_broken_plans():
    lay = GroupLayout.uniform(2, 2)
    plan = build_rs_plan(lay, chunks=2)
    steps = [list(s) for s in plan.steps]
    steps[0].append(steps[0][0])
    assert any("reaches 2 2 times" in p for p in rs_plan_problems(_with_steps(plan, steps)))
    steps = [list(s) for s in plan.steps]
    t = steps[0].pop(0)
    assert any("reaches 2 0 times" in p for p in rs_plan_problems(_with_steps(plan, steps)))
    steps[0].insert(0, dataclasses.replace(t, src=1))  # rank 1 does not collect block 2's node partial
    assert any("not its node's collector" in p for p in rs_plan_problems(_with_steps(plan, steps)))
    steps = [list(s) for s in plan.steps]
    steps[0][0], steps[0][1] = steps[0][1], steps[0][0]  # chunk 1 before chunk 0
    assert any("completes later" in p for p in rs_plan_problems(_with_steps(plan, steps)))
    bad_sum = dataclasses.replace(plan, sum_order=((( 0, 1), (2,)),) + plan.sum_order[1:])
    assert any("block 0: sum order" in p for p in rs_plan_problems(bad_sum))
    bad_gemm = dataclasses.replace(plan, gemm_order=((1, 2, 3, 0),) + plan.gemm_order[1:])
    assert any("own node's blocks before another node's" in p for p in rs_plan_problems(bad_gemm))


# --------------------------------------------------------------------------------------------------------------
# Topology on CPU
# --------------------------------------------------------------------------------------------------------------

def test_node_ids(monkeypatch):
    assert topology.node_ids(4) == (0, 0, 0, 0)
    assert topology.node_ids(4, ["a", "a", "b", "b"]) == (0, 0, 1, 1)
    assert topology.node_ids(4, ["b", "a", "b", "a"]) == (0, 1, 0, 1)
    assert topology.node_ids(8, node_size=2) == (0, 0, 1, 1, 2, 2, 3, 3)
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "4")
    assert topology.node_ids(8, ["a"] * 8) == (0,) * 4 + (1,) * 4
    assert topology.node_ids(2, ranks=(4, 5)) == (0, 0)  # a TP group inside a node
    assert topology.node_ids(4, ranks=(2, 3, 4, 5)) == (0, 0, 1, 1)
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "-1")
    with pytest.raises(ValueError, match="NODE_SIZE=-1"):
        topology.node_ids(8)
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "x")
    with pytest.raises(ValueError, match="not an integer"):
        topology.node_ids(8)


def test_numa_map_and_detection(monkeypatch, tmp_path):
    assert topology.parse_numa_map("", 4) is None
    assert topology.parse_numa_map("0,0,1,1", 4) == (0, 0, 1, 1)
    with pytest.raises(ValueError, match="names 3 NUMA nodes for 4"):
        topology.parse_numa_map("0,0,1", 4)
    with pytest.raises(ValueError, match="comma-separated"):
        topology.parse_numa_map("0;1", 2)
    # sysfs by the PCI bus id torch reports (NVML hidden)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    for dev, (bus, node) in enumerate([(0x18, 0), (0x9a, 1)]):
        d = tmp_path / f"0000:{bus:02x}:00.0"
        d.mkdir()
        (d / "numa_node").write_text(f"{node}\n")
    props = {0: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x18, pci_device_id=0),
             1: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x9A, pci_device_id=0)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[d])
    assert [topology.numa_node(d, sysfs_root=str(tmp_path)) for d in (0, 1)] == [0, 1]
    assert topology.numa_node(0, sysfs_root=str(tmp_path / "missing")) == -1
    assert topology._sysfs_bus_id("00000000:9A:00.0") == "0000:9a:00.0"
    # a NUMA map applies per local rank on every node
    monkeypatch.setenv("FLUX_LAYERS_NUMA_MAP", "1,0")
    lay = topology.group_layout(range(4), (0, 0, 1, 1), peer=GroupLayout.uniform(2, 2).peer, nvlink=True)
    assert lay.numa_of == (1, 0, 1, 0)


def test_ag_order_keeps_single_node_behaviour_and_plans_multi_node(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert topology.ag_order((0, 1, 2, 3)) == "mesh"
    monkeypatch.setenv("FLUX_LAYERS_AG_ORDER", "ring")
    assert topology.ag_order((0, 1, 2, 3)) == "ring"
    monkeypatch.delenv("FLUX_LAYERS_AG_ORDER")
    monkeypatch.setenv("FLUX_LAYERS_NUMA_MAP", "0,0")
    assert topology.ag_order((0, 1, 2, 3), (0, 0, 1, 1)) == "internode"
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "2")
    assert topology.ag_order((0, 1, 2, 3)) == "internode"
    monkeypatch.setenv("FLUX_LAYERS_AG_ORDER", "numa2d")
    assert topology.ag_order((0, 1, 2, 3)) == "numa2d"
    assert _env.get("TRANSPORT") == "auto"
    monkeypatch.setenv("FLUX_LAYERS_TRANSPORT", "pigeon")
    with pytest.raises(ValueError, match="FLUX_LAYERS_TRANSPORT"):
        _env.get("TRANSPORT")


def test_fused_path_blocker(monkeypatch):
    # The reduce-scatter needs one node and peer access unless its NCCL transport is forced; the all-gather takes
    # NCCL where they are missing (tests/cpu/multinode/test_nccl_transport.py, test_nccl_rs_transport.py).
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    rs = dict(op="gemm_rs")
    assert topology.fused_path_blocker((0, 1, 2, 3), **rs) is None
    assert topology.fused_path_blocker((0, 1, 2, 3), (0, 0, 0, 0), **rs) is None
    assert "spans 2 nodes" in topology.fused_path_blocker((0, 1, 2, 3), (0, 0, 1, 1), **rs)
    assert topology.fused_path_blocker((0, 1, 2, 3), (0, 0, 1, 1)) is None
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "2")
    assert "spans 2 nodes" in topology.fused_path_blocker((0, 1, 2, 3), **rs)
    assert topology.ag_transport((0, 1, 2, 3)) == "nccl"
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "4")
    assert topology.fused_path_blocker((0, 1, 2, 3), **rs) is None
    for order in ("internode", "numa2d"):
        monkeypatch.setenv("FLUX_LAYERS_AG_ORDER", order)
        assert f"AG_ORDER={order}" in topology.fused_path_blocker((0, 1, 2, 3))
        assert topology.fused_path_blocker((0, 1, 2, 3), **rs) is None  # no order in the reduce-scatter
    monkeypatch.setenv("FLUX_LAYERS_AG_ORDER", "ring")
    assert topology.fused_path_blocker((0, 1, 2, 3)) is None
    monkeypatch.setenv("FLUX_LAYERS_TRANSPORT", "nccl")
    assert topology.fused_path_blocker((0, 1, 2, 3), **rs) is None  # the reduce-scatter over NCCL, forced
    assert topology.fused_path_blocker((0, 1, 2, 3), (0, 0, 1, 1), **rs) is None
    assert topology.fused_path_blocker((0, 1, 2, 3)) is None
    monkeypatch.setenv("FLUX_LAYERS_TRANSPORT", "copy_engine")
    assert topology.fused_path_blocker((0, 1, 2, 3)) is None
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} != {2, 3})
    topology.peer_access_matrix.cache_clear()
    for op in ("ag_gemm", "gemm_rs"):
        reason = topology.fused_path_blocker((0, 1, 2, 3), op=op)
        assert "GPUs 2 and 3" in reason and "cannot map each other's memory" in reason
    assert topology.fused_path_blocker((0, 1)) is None
    with pytest.raises(ValueError, match="2 node ids for 4 devices"):
        topology.fused_path_blocker((0, 1, 2, 3), (0, 0))


def test_arrival_type_is_the_waits_on_of_forwards():
    plan = build_ag_plan(GroupLayout.uniform(2, 2))
    forwards = [t for _, t in plan.transfers() if t.src != t.chunk[0]]
    assert forwards and all(t.waits_on == Arrival(t.chunk, t.src) for t in forwards)
    assert all(t.waits_on is None for _, t in plan.transfers() if t.src == t.chunk[0])


def test_a_workspaces_layout_follows_the_node_size_and_numa_map_set_now(monkeypatch):
    """AgWorkspace.layout (runtime/workspace.py) is made for the settings of the call that asks, not frozen at its
    first use: a process that sets FLUX_LAYERS_NUMA_MAP after a call on the same workspace gets the NUMA-2D order."""
    from flux_layers.runtime import workspace
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(topology, "numa_node", lambda device: -1)
    monkeypatch.setattr(topology, "group_node_ids", lambda group: topology.node_ids(4, ranks=(0, 1, 2, 3)))
    ws = object.__new__(workspace.AgWorkspace)  # what layout reads: the members' devices, and its cache
    ws.devices, ws.group, ws._layouts = (0, 1, 2, 3), None, {}
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "4")
    one_node = ws.layout
    assert one_node.nnodes == 1 and one_node.numa_of == (-1,) * 4 and ws.layout is one_node
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "2")
    assert ws.layout.nnodes == 2 and ws.layout.numa_halves(0) is None
    monkeypatch.setenv("FLUX_LAYERS_NUMA_MAP", "0,1")
    assert ws.layout.numa_of == (0, 1, 0, 1) and ws.layout.numa_halves(0) is not None
    assert choose_order(ws.layout, "numa2d") == "numa2d"
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "4")
    monkeypatch.delenv("FLUX_LAYERS_NUMA_MAP")
    assert ws.layout is one_node
