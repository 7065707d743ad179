"""The NCCL transport's executor (flux_layers/runtime/multinode/nccl_transport.py) on CPU: its batches for every
layout, and the very code that drives NCCL run with gloo on CPU tensors across 2-8 processes, a flag stand-in that
checks each chunk's data is in place when its flag is set, through torch.distributed's send/recv and through the
host-staged stand-in of ranks sharing one GPU (runtime/multinode/sendrecv.py: its thread, staging and ordering, with
exactly the plan's chunks received); the transport's selection (topology.ag_transport, fused_path_blocker, the declared
node size)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed
from flux_layers.runtime import topology
from flux_layers.runtime.multinode import nccl_transport, sendrecv
from flux_layers.runtime.multinode.transfer_plan import GroupLayout

# (nnodes, ranks per node, NUMA map of a node or None, order or None (auto))
CASES = {
    2: [(2, 1, None, None), (1, 2, None, None)],
    4: [(2, 2, None, None), (4, 1, None, None), (1, 4, None, "ring"), (1, 4, None, "mesh"),
        (1, 4, (0, 0, 1, 1), "numa2d")],
    8: [(2, 4, None, None), (4, 2, None, None), (8, 1, None, None), (1, 8, (0, 0, 0, 0, 1, 1, 1, 1), "numa2d"),
        (2, 4, (0, 0, 1, 1), "numa2d"), (1, 8, None, "ring")],
}
STATIC = [c for cases in CASES.values() for c in cases] + [(2, 8, None, None), (2, 8, (0,) * 4 + (1,) * 4, "numa2d")]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("AG_ORDER", "NODE_SIZE", "TRANSPORT", "NUMA_MAP"):
        monkeypatch.delenv("FLUX_LAYERS_" + name, raising=False)
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    topology.peer_access_matrix.cache_clear()
    yield
    topology.peer_access_matrix.cache_clear()


def _plan(nnodes, size, numa, order, chunks):
    return nccl_transport.nccl_plan(GroupLayout.uniform(nnodes, size, numa=numa), chunks, order)


@pytest.mark.parametrize("case", STATIC, ids=lambda c: f"{c[0]}x{c[1]}-{c[3] or 'auto'}")
@pytest.mark.parametrize("chunks", [1, 3])
def test_batches_receive_every_chunk_once_and_forward_only_what_arrived(case, chunks):
    plan = _plan(*case, chunks)
    tp = plan.layout.tp
    sent_by_pair: dict[tuple[int, int], list] = {}
    recv_by_pair: dict[tuple[int, int], list] = {}
    for rank in range(tp):
        batches = nccl_transport.rank_batches(plan, rank)
        assert [b.key for b in batches] == sorted(b.key for b in batches)
        arrived: dict[tuple[int, int], int] = {}
        for i, b in enumerate(batches):
            for t in b.recvs:
                assert t.dst == rank and t.chunk not in arrived, f"rank {rank}: {t.chunk} received twice"
                arrived[t.chunk] = i
                recv_by_pair.setdefault((t.src, t.dst), []).append((b.key, t.chunk))
            for t in b.sends:
                assert t.src == rank
                if t.chunk[0] != rank:  # forwarded: received in an earlier batch
                    assert arrived.get(t.chunk, len(batches)) < i, f"rank {rank} forwards {t.chunk} before it has it"
                sent_by_pair.setdefault((t.src, t.dst), []).append((b.key, t.chunk))
        assert sorted(arrived) == [(g, c) for g in range(tp) if g != rank for c in range(chunks)]
    # Both sides of every pair issue the same transfers under the same keys, in the same order (NCCL matches a
    # pair's calls in issue order; equal keys make a batch's partners sit in their own batch of that key).
    assert sent_by_pair == recv_by_pair


def test_batches_refuse_copy_engine_transfers():
    from flux_layers.runtime.multinode.transfer_plan import build_ag_plan
    plan = build_ag_plan(GroupLayout.uniform(2, 2), chunks=1)  # copy engine inside each node
    with pytest.raises(ValueError, match="all NCCL"):
        nccl_transport.rank_batches(plan, 0)


def _shard(g: int, rows: int, k: int) -> torch.Tensor:
    return (g * 10_000 + torch.arange(rows * k, dtype=torch.float64)).view(rows, k)


def _primitive(name: str, group):
    """The send/recv primitive under test: torch.distributed's (the executors' default off a shared GPU) or the
    host-staged stand-in."""
    return sendrecv.HostStagedSendRecv(group, timeout_s=60) if name == "stand_in" else None


def _received_by_plan(executor, rows, rows_per_chunk, k, itemsize):
    """Bytes this rank's batches receive from each peer."""
    want: dict[int, int] = {}
    for b in executor.batches:
        for t in b.recvs:
            want[t.src] = want.get(t.src, 0) + min(rows_per_chunk, rows - t.chunk[1] * rows_per_chunk) * k * itemsize
    return want


def _scales(g: int, rows: int) -> torch.Tensor:
    """Shard g's per-row values that travel beside its rows (as an FP8 shard's row-wise scales do)."""
    return g + torch.arange(rows, dtype=torch.float32) / 64


def _run_cases(rank, tp, rows, rows_per_chunk, k, late_rank, primitive, scaled=False):
    """``scaled``: each chunk moves as two tensors, its rows and its rows' scales (AgExecutor.run's tuples)."""
    group = dist.group.WORLD
    chunks = -(-rows // rows_per_chunk)
    stand_in = _primitive(primitive, group)
    for nnodes, size, numa, order in CASES[tp]:
        plan = _plan(nnodes, size, numa, order, chunks)
        executor = nccl_transport.AgExecutor(plan, rank, group, sendrecv=stand_in)
        received = dict(stand_in.received_bytes) if stand_in else {}
        x, x_scales = _shard(rank, rows, k), _scales(rank, rows)
        buffer = torch.full((tp * rows, k), float("nan"), dtype=torch.float64)
        scale_buffer = torch.full((tp * rows,), float("nan"))
        flags: dict[tuple[int, int], int] = {}

        def span(g, c):
            return slice(g * rows + c * rows_per_chunk, g * rows + min((c + 1) * rows_per_chunk, rows))

        def region(g, c):
            return (buffer[span(g, c)], scale_buffer[span(g, c)]) if scaled else buffer[span(g, c)]

        def own(c):
            at = slice(c * rows_per_chunk, (c + 1) * rows_per_chunk)
            return (x[at], x_scales[at]) if scaled else x[at]

        def announce(g, c):
            # The flag stand-in: the chunk's rows (and scales) are in place when its flag is set, and it is set once.
            assert (g, c) not in flags, f"rank {rank}: flag of {(g, c)} set twice"
            lo, n = c * rows_per_chunk, buffer[span(g, c)].shape[0]
            assert torch.equal(buffer[span(g, c)], _shard(g, rows, k)[lo:lo + n]), \
                f"rank {rank}: flag of {(g, c)} set before its data"
            if scaled:
                assert torch.equal(scale_buffer[span(g, c)], _scales(g, rows)[lo:lo + n]), \
                    f"rank {rank}: flag of {(g, c)} set before its scales"
            flags[(g, c)] = len(flags)

        if rank == late_rank:
            time.sleep(0.2)
        executor.run(own, region, announce)
        what = f"rank {rank}, {nnodes}x{size} {plan.order} ({primitive}{', scaled' if scaled else ''})"
        if stand_in is not None:
            got = {p: n - received.get(p, 0) for p, n in stand_in.received_bytes.items() if n > received.get(p, 0)}
            row_bytes = k * x.element_size() + (x_scales.element_size() if scaled else 0)
            assert got == _received_by_plan(executor, rows, rows_per_chunk, 1, row_bytes), what
        else:
            assert isinstance(executor.sendrecv, sendrecv.GroupSendRecv), what
        assert sorted(flags) == [(g, c) for g in range(tp) if g != rank for c in range(chunks)], what
        for g in range(tp):
            if g != rank:
                assert torch.equal(buffer[g * rows:(g + 1) * rows], _shard(g, rows, k)), f"{what}: shard {g}"
        assert buffer[rank * rows:(rank + 1) * rows].isnan().all(), f"{what}: own rows written"
        if scaled:
            want = torch.cat([torch.full((rows,), float("nan")) if g == rank else _scales(g, rows) for g in range(tp)])
            assert torch.equal(scale_buffer.nan_to_num(-1), want.nan_to_num(-1)), f"{what}: scales"
        # The GEMM's order: own shard, then every other; a shard's chunks are all flagged by then in arrival order.
        order_seen = executor.gemm_order
        assert order_seen[0] == rank and sorted(order_seen) == list(range(tp)), what
        dist.barrier()


@pytest.mark.parametrize("tp,primitive", [(2, "torch"), (4, "torch"), (8, "torch"), (4, "stand_in"), (8, "stand_in")])
def test_executor_moves_every_chunk_once_with_gloo(tp, primitive):
    # 5 rows per shard in chunks of 2 (a short last chunk); rank 1 starts late. TP 4 and 8 hold the 2x2, 2x4 and 4x2
    # layouts.
    run_distributed(_run_cases, tp, 5, 2, 3, 1, primitive)


@pytest.mark.parametrize("tp,primitive", [(4, "torch"), (8, "stand_in")])
def test_executor_moves_chunks_of_several_tensors(tp, primitive):
    """Chunks carried by two tensors (FP8 rows and their scales): both parts land before the chunk's flag."""
    run_distributed(_run_cases, tp, 5, 2, 3, 1, primitive, True)


# Hybrid plans (NCCL between nodes, the copy engine inside): (nnodes, ranks per node, NUMA map of a node, order).
HYBRID_CASES = {4: [(2, 2, None, None), (2, 2, (0, 1), "numa2d")],
                8: [(2, 4, None, None), (4, 2, None, None), (2, 4, (0, 0, 1, 1), "numa2d")]}


@pytest.mark.parametrize("case", [c for cases in HYBRID_CASES.values() for c in cases] + [(2, 8, None, None)],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[3] or 'auto'}")
def test_hybrid_batches_cross_the_network_once_and_push_only_what_arrived(case):
    nnodes, size, numa, order = case
    plan = nccl_transport.hybrid_plan(GroupLayout.uniform(nnodes, size, numa=numa), 2, order)
    tp = plan.layout.tp
    delivered: dict[int, list] = {r: [] for r in range(tp)}
    for rank in range(tp):
        pushed_here = {t.chunk for _, t in plan.transfers() if t.dst == rank and t.transport == "copy_engine"}
        awaited: set = set()
        for b in nccl_transport.rank_batches(plan, rank, copy_engine=True):
            awaited.update(b.waits)
            for t in b.sends + b.copies:  # a chunk a peer pushed here is awaited before it is forwarded
                assert t.chunk[0] == rank or t.chunk not in pushed_here or t.chunk in awaited, (rank, t)
            for t in b.sends + b.recvs:
                assert not plan.layout.same_node(t.src, t.dst), f"{t}: NCCL inside a node"
            for t in b.copies:
                assert plan.layout.same_node(t.src, t.dst) and t.src == rank, t
                delivered[t.dst].append(t.chunk)
            for t in b.recvs:
                delivered[rank].append(t.chunk)
    for rank in range(tp):
        assert sorted(delivered[rank]) == [(g, c) for g in range(tp) if g != rank for c in range(2)], rank
    crossings = [t for _, t in plan.transfers() if not plan.layout.same_node(t.src, t.dst)]
    assert len(crossings) == len({(t.chunk, plan.layout.node_of[t.dst]) for t in crossings}), \
        "a chunk crossed into a node twice"
    with pytest.raises(ValueError, match="all NCCL"):
        nccl_transport.rank_batches(plan, 0)


def _run_hybrid_cases(rank, tp, rows, rows_per_chunk, k, late_rank, buffers, counts, primitive):
    """Each rank's gathered buffer is buffers[rank] (shared memory, standing in for peer-mapped GPU memory), its
    flags counts[rank] (how many times each chunk's flag was set)."""
    group = dist.group.WORLD
    chunks = -(-rows // rows_per_chunk)
    stand_in = _primitive(primitive, group)
    for nnodes, size, numa, order in HYBRID_CASES[tp]:
        if rank == 0:
            buffers.fill_(float("nan"))
            counts.zero_()
        dist.barrier()
        plan = nccl_transport.hybrid_plan(GroupLayout.uniform(nnodes, size, numa=numa), chunks, order)
        executor = nccl_transport.AgExecutor(plan, rank, group, copy_engine=True, sendrecv=stand_in)
        x = _shard(rank, rows, k)

        def at(q, g, c):
            return buffers[q, g * rows + c * rows_per_chunk:g * rows + min((c + 1) * rows_per_chunk, rows)]

        def expected(g, c):
            lo = c * rows_per_chunk
            return _shard(g, rows, k)[lo:lo + at(rank, g, c).shape[0]]

        def announce(g, c):  # received by NCCL here: in place when its flag is set
            assert torch.equal(at(rank, g, c), expected(g, c)), f"rank {rank}: flag of {(g, c)} set before its data"
            counts[rank, g * chunks + c] += 1

        def push(dst, g, c, data):  # the copy engine: what is forwarded had arrived here first
            assert torch.equal(data, expected(g, c)), f"rank {rank} pushes {(g, c)} to {dst} before it has it"
            at(dst, g, c).copy_(data)
            counts[dst, g * chunks + c] += 1

        def wait_arrival(g, c):  # a local peer's push of (g, c) here: its flag
            deadline = time.monotonic() + 30
            while counts[rank, g * chunks + c] < 1:
                assert time.monotonic() < deadline, f"rank {rank}: {(g, c)} never arrived"
                time.sleep(0.001)

        if rank == late_rank:
            time.sleep(0.2)
        executor.run(lambda c: x[c * rows_per_chunk:(c + 1) * rows_per_chunk], lambda g, c: at(rank, g, c),
                     announce, push, wait_arrival)
        dist.barrier()
        what = f"rank {rank}, {nnodes}x{size} {plan.order}"
        want = [0 if g == rank else 1 for g in range(tp) for _ in range(chunks)]
        assert counts[rank].tolist() == want, f"{what}: flags set {counts[rank].tolist()}"
        for g in range(tp):
            if g != rank:
                assert torch.equal(buffers[rank, g * rows:(g + 1) * rows], _shard(g, rows, k)), f"{what}: shard {g}"
        assert buffers[rank, rank * rows:(rank + 1) * rows].isnan().all(), f"{what}: own rows written"
        dist.barrier()


@pytest.mark.parametrize("tp,primitive", [(4, "torch"), (8, "torch"), (8, "stand_in")])
def test_hybrid_executor_fans_out_every_chunk_once_with_gloo(tp, primitive):
    # 5 rows per shard in chunks of 2 (a short last chunk); rank 1 starts late.
    rows, rows_per_chunk, k = 5, 2, 3
    buffers = torch.full((tp, tp * rows, k), float("nan"), dtype=torch.float64).share_memory_()
    counts = torch.zeros((tp, tp * -(-rows // rows_per_chunk)), dtype=torch.int32).share_memory_()
    run_distributed(_run_hybrid_cases, tp, rows, rows_per_chunk, k, 1, buffers, counts, primitive)


def test_ag_transport_and_blocker(monkeypatch):
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    devices = (0, 1, 2, 3)
    assert topology.ag_transport(devices) == "copy_engine"
    assert topology.ag_transport(devices, (0, 0, 1, 1)) == "nccl"
    for op in ("ag_gemm", "gemm_rs"):
        assert topology.fused_path_blocker(devices, op=op) is None
    assert topology.fused_path_blocker(devices, (0, 0, 1, 1)) is None  # all-gather over NCCL
    reason = topology.fused_path_blocker(devices, (0, 0, 1, 1), op="gemm_rs")
    assert "spans 2 nodes" in reason and "FLUX_LAYERS_TRANSPORT=nccl" in reason  # not taken unless forced
    assert not topology.rs_over_nccl()
    monkeypatch.setenv("FLUX_LAYERS_TRANSPORT", "nccl")
    assert topology.ag_transport(devices) == "nccl"
    assert topology.rs_over_nccl()
    assert topology.fused_path_blocker(devices) is None
    assert topology.fused_path_blocker(devices, op="gemm_rs") is None
    assert topology.fused_path_blocker(devices, (0, 0, 1, 1), op="gemm_rs") is None
    monkeypatch.setenv("FLUX_LAYERS_AG_ORDER", "numa2d")
    assert topology.fused_path_blocker(devices) is None  # every order runs on NCCL
    monkeypatch.setenv("FLUX_LAYERS_TRANSPORT", "copy_engine")
    assert "AG_ORDER=numa2d" in topology.fused_path_blocker(devices)
    monkeypatch.setenv("FLUX_LAYERS_AG_ORDER", "auto")
    assert "spans 2 nodes" in topology.fused_path_blocker(devices, (0, 0, 1, 1))
    monkeypatch.delenv("FLUX_LAYERS_TRANSPORT")
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} != {2, 3})
    topology.peer_access_matrix.cache_clear()
    assert topology.ag_transport(devices) == "nccl"  # no peer access: NCCL by itself
    assert topology.fused_path_blocker(devices) is None
    reason = topology.fused_path_blocker(devices, op="gemm_rs")
    assert "cannot map each other's memory" in reason and "has not run on GPUs" in reason


def test_declared_node_size(monkeypatch):
    assert topology.declared_node_size() == 0
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun on two nodes of 8
    assert topology.declared_node_size() == 8
    assert topology.node_ids(16) == (0,) * 8 + (1,) * 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # one node
    assert topology.declared_node_size() == 0
    monkeypatch.setenv("FLUX_LAYERS_NODE_SIZE", "2")  # declared wins
    assert topology.declared_node_size() == 2
