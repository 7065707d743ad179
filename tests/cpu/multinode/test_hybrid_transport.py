"""The hybrid all-gather's CPU side (FLUX_LAYERS_TRANSPORT=hybrid: NCCL between nodes, host-driven copy-engine
pushes inside them): each rank's pushes and arrivals in a hybrid plan (nccl_transport.node_pushes, what its
handshake and gathered copy wait on), the node group its workspace maps memory over (node_group.py) with gloo, the
pointers it hands the op library, the transport's selection (topology.ag_transport, fused_path_blocker), and
fused_ag_gemm.run_nccl's hybrid calls themselves across 2-8 gloo processes on shared-memory buffers and flags (the
streams, the GEMM and the flag operations stood in on the host): back-to-back calls with the order changing, each
gathered input exact, which fails without the done handshake."""
from __future__ import annotations

import contextlib
import os
import time
import types

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
    # the reduce-scatter's two-level plan, across nodes of consecutive ranks only; inside one node as under auto
    assert topology.rs_two_level(nodes) and not topology.rs_over_nccl()
    assert topology.fused_path_blocker(devices, nodes, op="gemm_rs") is None
    assert not topology.rs_two_level((0, 0, 0, 0)) and not topology.rs_two_level(None)
    reason = topology.fused_path_blocker(devices, (0, 1, 0, 1), op="gemm_rs")
    assert "consecutive ranks" in reason and "FLUX_LAYERS_TRANSPORT=nccl" in reason
    assert "consecutive ranks" in topology.fused_path_blocker(devices[:3], (0, 0, 1), op="gemm_rs")
    # a node whose GPUs cannot map each other's memory: the hybrid workspace cannot map it
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} != {2, 3})
    topology.peer_access_matrix.cache_clear()
    for op, what in (("ag_gemm", "all-gather"), ("gemm_rs", "reduce-scatter")):
        reason = topology.fused_path_blocker(devices, nodes, op=op)
        assert "ranks 2 and 3, node 1" in reason and f"hybrid {what}" in reason, reason
    assert topology.fused_path_blocker(devices, (0, 1, 0, 1)) is None  # 2 and 3 on different nodes


# ---------------------------------------------------------------- the hybrid call itself, on CPU

class _Stream:
    def wait_stream(self, other) -> None:
        pass


class _HostWorkspace:
    """What run_nccl and plan_nccl_call read of a hybrid AgWorkspace, over shared-memory tensors: every rank's
    gathered buffer (buffers[q]), flag words (flags[q]) and, for FP8 rows, scale region (scales[q]); the flag words'
    indices and the scales' slots are this stand-in's own (distinct per region, rank and epoch parity), the op
    library's layout is not needed to check the protocol."""

    def __init__(self, rank, tp, node_size, buffers, flags, k, scales=None):
        self.rank, self.tp, self.group, self.k = rank, tp, dist.group.WORLD, k
        self.dtype = torch.float64 if scales is None else torch.float8_e4m3fn
        self.chunk_capacity, self.device = 16, torch.device("cpu")
        self.transport, self.transfer_stream, self.epoch_count = "hybrid", _Stream(), 0
        self.node_size = node_size
        self.mapped = node_group.node_members(tuple(r // node_size for r in range(tp)), rank)
        self.buffer, self.flags = buffers[rank].view(self.dtype), flags[rank]
        self.peer_buffers = {q: buffers[q].view(self.dtype) for q in self.mapped if q != rank}
        self.scales = None if scales is None else scales[rank]
        self.peer_scales = {} if scales is None else {q: scales[q] for q in self.mapped if q != rank}
        self._flags_of = flags
        self._plans: dict = {}

    def scale_index(self, epoch, shard, per_shard):
        return (epoch % 2) * self.scales.shape[0] // 2 + shard * per_shard

    @property
    def layout(self):  # the node size fixed, the NUMA map as set now (as AgWorkspace.layout follows it)
        size, tp = self.node_size, self.tp
        numa = [int(v) for v in os.environ.get("FLUX_LAYERS_NUMA_MAP", "").split(",") if v] or [0] * size
        return topology.group_layout((0,) * tp, tuple(r // size for r in range(tp)), numa_of=numa * (tp // size),
                                     peer=[[a != b and a // size == b // size for b in range(tp)] for a in range(tp)])

    @property
    def epoch(self) -> int:
        return self.epoch_count

    def peer_flags(self, q):
        return self._flags_of[q]

    def flag_index(self, region, rank, chunk=0):
        base = {"chunk": 0, "done": self.tp * self.chunk_capacity}[region]
        return base + rank * (self.chunk_capacity if region == "chunk" else 1) + chunk

    def plan_index(self, plan):
        return self._plans.setdefault(plan, len(self._plans))


def _wait(flags, index, value):
    deadline = time.monotonic() + 30
    while int(flags[index]) < value:
        assert time.monotonic() < deadline, f"flag {index} never reached {value} (holds {int(flags[index])})"
        time.sleep(0.0005)


def _write(flags, index, value):
    flags[index] = value


def _hybrid_calls(rank, tp, node_size, layouts, buffers, flags, k, scales=None):
    """Back-to-back hybrid calls through fused_ag_gemm.run_nccl on host tensors (streams and the GEMM stood in,
    the flag operations done on the host at once): each call's gathered input exact, with the order changing between
    calls and a rank late now and then, so a push that did not wait for its target's previous call would show.
    ``scales`` (FP8 rows): every rank's scale region; the calls alternate row-wise and tensor-wise scales, each call's
    its own values, and the gathered scales must be every shard's."""
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.ops.fp8 import ScaledTensor

    class _Op:  # the GEMM in external mode: advances the epoch, computes nothing
        def __call__(self, *args):
            ws.epoch_count += 1
            return None

    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_stream = lambda: _Stream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, s: None
    fused_ag_gemm.flag_ops = lambda: (_write, _wait)
    fused_ag_gemm._opcalls = types.SimpleNamespace(ag_gemm=lambda *args: _Op(), ag_gemm_fp8=lambda *args: _Op(),
                                                   end_external_call=lambda *args: None)  # the GEMM's end: stood in
    ws = _HostWorkspace(rank, tp, node_size, buffers, flags, k, scales)
    for i in range(12):
        order, numa = layouts[i % len(layouts)]
        os.environ["FLUX_LAYERS_AG_ORDER"], os.environ["FLUX_LAYERS_NUMA_MAP"] = order, numa
        rows = (5, 8, 3)[i % 3]
        x_global = torch.arange(rows * tp * k, dtype=torch.float64).reshape(rows * tp, k) + 1000 * i
        x_scale = x_scales = None
        if scales is not None:  # FP8 rows: bytes that differ from call to call, and this call's scales
            x_global = (x_global % 251).to(torch.uint8).view(torch.float8_e4m3fn)
            shape = (rows, 1) if i % 2 == 0 else (1,)  # row-wise or tensor-wise
            x_scales = [(1000.0 * i + g + torch.arange(shape[0], dtype=torch.float32) / 8).view(shape)
                        for g in range(tp)]
            x_scale = x_scales[rank]
        call = fused_ag_gemm.plan_nccl_call(ws, m=rows * tp, k=k, n=8, chunk_rows=(2, 0)[i % 2], sm_count=132)
        if rank == i % tp and i % 4 == 1:
            time.sleep(0.05)
        _, gathered = fused_ag_gemm.run_nccl(ws, call, x_global[rank * rows:(rank + 1) * rows], None, None, False,
                                             True, x_scale=x_scale, w_scale=x_scale)
        what = f"rank {rank} call {i} ({order})"
        if scales is None:
            assert torch.equal(gathered, x_global), f"{what}: gathered input differs"
        else:
            assert isinstance(gathered, ScaledTensor), what
            assert torch.equal(gathered.data.view(torch.uint8), x_global.view(torch.uint8)), f"{what}: rows differ"
            want = torch.cat([s.reshape(-1) for s in x_scales])
            assert torch.equal(gathered.scale.reshape(-1), want), f"{what}: scales {gathered.scale} != {want}"
            assert gathered.scale.shape == ((rows * tp, 1) if x_scale.numel() > 1 else (tp,)), what
        assert call.pushes is not None and set(call.pushes.peers) == set(ws.mapped) - {rank}
    dist.barrier()


@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit", "fp8"])
@pytest.mark.parametrize("tp,node_size", [(4, 2), (8, 4), (8, 2), (2, 2)])
def test_hybrid_calls_back_to_back_on_host_tensors(tp, node_size, fp8):
    k = 3
    buffers = torch.full((tp, 8 * tp, k), float("nan"), dtype=torch.float64).share_memory_()
    scales = torch.full((tp, 2 * 8 * tp), float("nan")).share_memory_() if fp8 else None
    if fp8:  # FP8 rows: a byte per element
        buffers = torch.zeros((tp, 8 * tp, k), dtype=torch.uint8).share_memory_()
    flags = torch.zeros((tp, 16 * tp + tp), dtype=torch.int32).share_memory_()
    nnodes = tp // node_size
    layouts = [("internode" if nnodes > 1 else "mesh", "")]
    if nnodes > 1 and node_size % 2 == 0:
        layouts.append(("numa2d", ",".join(["0"] * (node_size // 2) + ["1"] * (node_size // 2))))
    run_distributed(_hybrid_calls, tp, node_size, layouts, buffers, flags, k, scales)
