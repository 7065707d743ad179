"""The hybrid all-gather's CPU side (FLUX_LAYERS_TRANSPORT=hybrid: NCCL between nodes, host-driven copy-engine
pushes inside them): each rank's pushes and arrivals in a hybrid plan (nccl_transport.node_pushes, what its
handshake and gathered copy wait on), the node group its workspace maps memory over (node_group.py) with gloo, the
pointers it hands the op library, and the transport's selection (topology.ag_transport, fused_path_blocker)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flux_layers import _env
from flux_layers.devtools.launch import run_distributed
from flux_layers.runtime import topology
from flux_layers.runtime.multinode import nccl_transport, node_group
from flux_layers.runtime.multinode.transfer_plan import GroupLayout

# (nnodes, ranks per node, NUMA map of a node or None, order or None (auto))
CASES = [(2, 2, None, None), (2, 2, (0, 1), "numa2d"), (2, 4, None, None), (4, 2, None, None),
         (2, 4, (0, 0, 1, 1), "numa2d"), (1, 4, None, None), (2, 1, None, None)]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("AG_ORDER", "NODE_SIZE", "TRANSPORT", "NUMA_MAP"):
        monkeypatch.delenv("FLUX_LAYERS_" + name, raising=False)
    topology.peer_access_matrix.cache_clear()
    yield
    topology.peer_access_matrix.cache_clear()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[3] or 'auto'}")
@pytest.mark.parametrize("chunks", [1, 3])
def test_node_pushes_are_the_plans_copies_and_every_chunk_arrives_once(case, chunks):
    nnodes, size, numa, order = case
    plan = nccl_transport.hybrid_plan(GroupLayout.uniform(nnodes, size, numa=numa), chunks, order)
    tp = plan.layout.tp
    pushes = [nccl_transport.node_pushes(plan, r) for r in range(tp)]
    for rank, p in enumerate(pushes):
        node = plan.layout.members(plan.layout.node_of[rank])
        assert p.peers == tuple(q for q in node if q != rank)
        assert set(p.targets) <= set(p.peers), f"rank {rank} pushes outside its node: {p.targets}"
        for q in p.targets:  # a push into q is q's arrival, and only those
            assert any(ch in pushes[q].arriving for ch in
                       (t.chunk for _, t in plan.transfers() if t.src == rank and t.dst == q)), (rank, q)
        by_nccl = [t.chunk for _, t in plan.transfers() if t.dst == rank and t.transport == "nccl"]
        want = sorted((g, c) for g in range(tp) if g != rank for c in range(chunks))
        assert sorted(by_nccl + list(p.arriving)) == want, f"rank {rank}: not every chunk arrives exactly once"
        # what the executor waits for before forwarding is among the arrivals
        for batch in nccl_transport.rank_batches(plan, rank, copy_engine=True):
            assert set(batch.waits) <= set(p.arriving), (rank, batch)
    if size == 1:
        assert all(p.targets == () and p.arriving == () for p in pushes)
    if nnodes == 1:
        assert not any(t.transport == "nccl" for _, t in plan.transfers())


def test_node_pushes_of_an_all_nccl_plan_are_empty():
    plan = nccl_transport.nccl_plan(GroupLayout.uniform(2, 2), 2)
    assert nccl_transport.node_pushes(plan, 0) == nccl_transport.NodePushes((), (1,), ())


def test_node_members_and_mapped_pointers():
    assert node_group.node_members((0, 0, 1, 1), 2) == (2, 3)
    assert node_group.node_members((0, 1, 0, 1), 1) == (1, 3)
    assert node_group.node_members((0,), 0) == (0,)
    with pytest.raises(ValueError, match="outside"):
        node_group.node_members((0, 0), 2)
    assert node_group.mapped_pointers(4, (2, 3), [1000, 5000], 16) == [0, 0, 1016, 5016]
    assert node_group.mapped_pointers(2, (0, 1), [7, 9], 0) == [7, 9]
    with pytest.raises(ValueError, match="pointers for"):
        node_group.mapped_pointers(4, (2, 3), [1000], 0)
    with pytest.raises(ValueError, match="not distinct"):
        node_group.mapped_pointers(4, (2, 2), [1, 2], 0)
    with pytest.raises(ValueError, match="not distinct"):
        node_group.mapped_pointers(4, (3, 4), [1, 2], 0)


def _node_groups(rank, tp, size):
    group = dist.group.WORLD
    members = node_group.node_members(tuple(r // size for r in range(tp)), rank)
    ng = node_group.node_group(group, members)
    assert node_group.node_group(group, members) is ng  # made once
    assert dist.get_world_size(ng) == size and dist.get_rank(ng) == members.index(rank)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=ng)  # only the node's members take part
    assert total.item() == sum(members), (rank, total.item(), members)
    names = [None] * size
    dist.all_gather_object(names, ng.group_name, group=ng)
    assert len(set(names)) == 1, names
    with pytest.raises(ValueError, match="not among"):
        node_group.node_group(group, tuple(r for r in range(tp) if r not in members))
    dist.barrier()


@pytest.mark.parametrize("tp,size", [(4, 2), (8, 4), (8, 2)])
def test_node_groups_are_made_by_each_node_alone_with_gloo(tp, size):
    run_distributed(_node_groups, tp, size)


def test_hybrid_transport_selection(monkeypatch):
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    devices, nodes = (0, 1, 2, 3), (0, 0, 1, 1)
    assert topology.ag_transport(devices, nodes) == "nccl"  # not chosen by itself (not yet run on GPUs)
    monkeypatch.setenv("FLUX_LAYERS_TRANSPORT", "hybrid")
    assert _env.get("TRANSPORT") == "hybrid"
    assert topology.ag_transport(devices, nodes) == "hybrid"
    assert topology.fused_path_blocker(devices, nodes) is None
    layout = GroupLayout.uniform(2, 2)
    assert topology.transport_matrix(layout) == topology.choose_transport(layout, "auto")
    # the reduce-scatter has no hybrid transport: across nodes it keeps the reference path
    reason = topology.fused_path_blocker(devices, nodes, op="gemm_rs")
    assert "spans 2 nodes" in reason and not topology.rs_over_nccl()
    # a node whose GPUs cannot map each other's memory: the hybrid workspace cannot map it
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} != {2, 3})
    topology.peer_access_matrix.cache_clear()
    reason = topology.fused_path_blocker(devices, nodes)
    assert "ranks 2 and 3, node 1" in reason and "FLUX_LAYERS_TRANSPORT=nccl" in reason
    assert topology.fused_path_blocker(devices, (0, 1, 0, 1)) is None  # 2 and 3 on different nodes
