"""The reduce-scatter's NCCL transport (flux_layers/runtime/multinode/nccl_rs_transport.py) on CPU: its batches for
every group size, the full-width chunks against the kernel's tile schedule, and the very executor that drives NCCL run
with gloo on CPU tensors across 2, 4 and 8 processes, with CPU stand-ins for the kernel (a chunk's partial appears
in the staging slot only when its count wait is reached), the flags (each checks that its data is in place and is
set once) and the owner's reduction (the partials it received summed in rank order, as the kernel adds them, against
the library's reference reduce-scatter of every rank's partial product, ops/reference.py).
The same for the inter-node part of a two-level plan across nodes: collectors' node partials (their intra-node sum
stood in), summed by the owner in the plan's node order. Both through torch.distributed's send/recv and through the
host-staged stand-in of ranks sharing one GPU (runtime/multinode/sendrecv.py)."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed
from flux_layers.ops import reference
from flux_layers.runtime import schedules
from flux_layers.runtime.multinode import nccl_rs_transport as rs
from flux_layers.runtime.multinode import sendrecv
from flux_layers.runtime.multinode.transfer_plan import GroupLayout, PlanError, build_rs_plan


@pytest.mark.parametrize("tp", range(2, schedules.MAX_TP + 1))
@pytest.mark.parametrize("chunks", [1, 3])
def test_batches_pair_every_send_with_its_receive_under_one_key(tp, chunks):
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank in range(tp):
        batches = rs.rs_batches(rank, tp, chunks)
        assert [b.key for b in batches] == sorted(b.key for b in batches)
        # The kernel's completion order: destinations rank+1, rank+2, ..., each swept chunk by chunk.
        assert [(b.dst, b.chunk) for b in batches] == [(d, c) for d in schedules.rs_shard_order(rank, tp)[:-1]
                                                      for c in range(chunks)]
        assert sorted((b.src, b.chunk) for b in batches) == [(s, c) for s in range(tp) if s != rank
                                                             for c in range(chunks)]
        for b in batches:
            sent.setdefault((rank, b.dst), []).append((b.key, b.chunk))
            received.setdefault((b.src, rank), []).append((b.key, b.chunk))
    # Both sides of every pair issue the same transfers under the same keys, in the same order (NCCL matches a
    # pair's calls in issue order; equal keys put a batch's partners in their own batch of that key).
    assert sent == received


def test_batches_refuse_bad_arguments():
    with pytest.raises(ValueError, match="rank 2 outside"):
        rs.rs_batches(2, 2, 1)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        rs.rs_batches(0, 2, 0)


@pytest.mark.parametrize("rows,n,tile,swizzle", [(300, 24, 1, 2), (4096, 8192, 1, 16), (1000, 520, 0, 0),
                                                 (8, 256, 1, 0), (2048, 2048, 0, 4)])
def test_full_width_chunks_match_the_kernels_counts_and_completion_order(rows, n, tile, swizzle):
    chunks = rs.full_width_chunks(rows, n, tile, swizzle)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert chunks[0].row0 == 0 and sum(c.rows for c in chunks) == rows
    assert all(a.row0 + a.rows == b.row0 for a, b in zip(chunks, chunks[1:]))  # contiguous, in row order
    tile_m, tile_n = schedules.TILE_CONFIGS[tile]
    kw = {"swizzle_m": swizzle} if swizzle else {}
    sched = schedules.TileSchedule(rows_per_shard=rows, n=n, num_shards=2, shard_order=(1, 0), tile_m=tile_m,
                                   tile_n=tile_n, **kw)
    grid = schedules.RsChunkGrid(sched, chunk_cols=n)
    counts = [0] * len(chunks)
    last_visit = [0] * len(chunks)
    for i, (shard, m, nt) in enumerate(sched.tiles()):
        if shard != 1 or m * tile_m >= rows:  # one destination; a cluster's padding tile is neither stored nor counted
            continue
        c = grid.chunk_of(m, nt)
        assert chunks[c].row0 <= m * tile_m < chunks[c].row0 + chunks[c].rows
        counts[c] += 1
        last_visit[c] = i
    assert counts == [c.tiles for c in chunks]  # the count each wait is for
    assert last_visit == sorted(last_visit)  # chunks complete in index order: the executor's order


def _partial(src: int, dst: int, rows: int, n: int) -> torch.Tensor:
    """Rank src's partial of dst's rows: random float64 of mixed magnitude (the sum's order shows in its bits)."""
    gen = torch.Generator().manual_seed(1000 * src + dst)
    return torch.randn(rows, n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (rows, 1),
                                                                                             generator=gen)


def _reduce(parts) -> torch.Tensor:
    """The owner's sum stand-in: the partials in rank order, as the kernel adds them."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def _run_with_stand_ins(executor, rank, chunks, stage, recv, mine, theirs, late):
    """Run ``executor`` once on CPU stand-ins. The kernel: our partial of d's rows, ``mine(d)``, appears in the
    staging slot ``stage[d]`` chunk by chunk, only when that chunk's count wait is reached, and each count is awaited
    once. The flags: each is set once, and only once the chunk of ``theirs(s)`` is in place in ``recv[s]``. Returns
    the count waits in order and the flags in the order they were set."""
    ready_seen: list = []
    flags: dict[tuple[int, int], int] = {}

    def ready(d, c):
        assert (d, c) not in ready_seen, f"rank {rank}: count of {(d, c)} awaited twice"
        ready_seen.append((d, c))
        rs.chunk_rows(stage[d], chunks[c]).copy_(rs.chunk_rows(mine(d), chunks[c]))

    def announce(s, c):
        assert (s, c) not in flags, f"rank {rank}: flag of {(s, c)} set twice"
        assert torch.equal(rs.chunk_rows(recv[s], chunks[c]), rs.chunk_rows(theirs(s), chunks[c])), \
            f"rank {rank}: flag of {(s, c)} set before its data"
        flags[(s, c)] = len(flags)

    if late:
        time.sleep(0.2)
    executor.run(ready, lambda d, c: rs.chunk_rows(stage[d], chunks[c]),
                 lambda s, c: rs.chunk_rows(recv[s], chunks[c]), announce)
    return ready_seen, flags


def _primitive(name: str, group):
    """torch.distributed's send/recv (the executors' default off a shared GPU) or the host-staged stand-in."""
    return sendrecv.HostStagedSendRecv(group, timeout_s=60) if name == "stand_in" else None


def _run_calls(rank, tp, late_rank, primitive):
    group = dist.group.WORLD
    stand_in = _primitive(primitive, group)
    for rows, n, tile, swizzle in ((300, 24, 1, 2), (5, 8, 1, 0)):
        chunks = rs.full_width_chunks(rows, n, tile, swizzle)
        executor = rs.RsExecutor(rank, tp, len(chunks), group, sendrecv=stand_in)
        results = []
        for call in range(2):
            # Staging slots start empty: a chunk's rows appear only when its count is complete (the kernel stand-in).
            stage = {d: torch.full((rows, n), float("nan"), dtype=torch.float64) for d in range(tp) if d != rank}
            recv = {s: torch.full((rows, n), float("nan"), dtype=torch.float64) for s in range(tp) if s != rank}
            ready_seen, flags = _run_with_stand_ins(executor, rank, chunks, stage, recv,
                                                    lambda d: _partial(rank, d, rows, n),
                                                    lambda s: _partial(s, rank, rows, n), rank == late_rank)
            what = f"rank {rank} of {tp}, {rows}x{n}, {len(chunks)} chunks, call {call}"
            assert ready_seen == [(d, c) for d in schedules.rs_shard_order(rank, tp)[:-1]
                                  for c in range(len(chunks))], what
            assert sorted(flags) == [(s, c) for s in range(tp) if s != rank for c in range(len(chunks))], what
            for s in recv:
                assert torch.equal(recv[s], _partial(s, rank, rows, n)), f"{what}: partial of rank {s}"
            out = _reduce([_partial(rank, rank, rows, n) if s == rank else recv[s] for s in range(tp)])
            # This rank's partial product of every rank's rows, reduce-scattered by the reference backend (gloo:
            # an all-reduce, this rank's block kept): what the owner's sum of the delivered partials must give.
            product = torch.cat([_partial(rank, d, rows, n) for d in range(tp)])
            ref = reference.reduce_scatter_rows(product, group)
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-9,
                                       msg=lambda m: f"{what}: reduced rows differ from the reference: {m}")
            results.append(out)
        assert torch.equal(results[0], results[1]), f"rank {rank}: two calls differ bitwise"
        dist.barrier()


@pytest.mark.parametrize("tp,primitive", [(2, "torch"), (4, "torch"), (8, "torch"), (4, "stand_in")])
def test_executor_moves_every_partial_once_with_gloo(tp, primitive):
    run_distributed(_run_calls, tp, 1, primitive)  # rank 1 starts late


TWO_LEVEL = [(2, 1), (2, 2), (2, 4), (4, 2), (2, 8), (8, 1), (3, 2)]  # nodes x ranks per node


@pytest.mark.parametrize("nnodes,size", TWO_LEVEL, ids=[f"{a}x{b}" for a, b in TWO_LEVEL])
@pytest.mark.parametrize("chunks", [1, 3])
def test_node_partial_batches_cross_the_network_once_per_node_partial(nnodes, size, chunks):
    layout = GroupLayout.uniform(nnodes, size)
    plan = build_rs_plan(layout, chunks=chunks)
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    arrivals: dict[tuple[int, int], list] = {}
    for rank in range(layout.tp):
        batches = rs.node_partial_batches(plan, rank)
        assert [b.key for b in batches] == sorted(b.key for b in batches)
        assert len(batches) == (nnodes - 1) * chunks
        # A collector sends the partials of the blocks of its own local index, on the other nodes, as its node's
        # GEMMs complete them (the order of plan.steps' ready_after).
        ready = []
        for b in batches:
            assert not layout.same_node(rank, b.dst) and layout.local_index(b.dst) == layout.local_index(rank)
            assert layout.local_index(b.src) == layout.local_index(rank) and not layout.same_node(rank, b.src)
            ready.append(next(t.ready_after for _, t in plan.sends() if t.src == rank and t.chunk == (b.dst, b.chunk)))
            sent.setdefault((rank, b.dst), []).append(b.key)
            received.setdefault((b.src, rank), []).append(b.key)
            arrivals.setdefault((rank, b.chunk), []).append(layout.node_of[b.src])
        assert ready == sorted(ready), f"rank {rank}: count waits out of the GEMM's order {ready}"
    assert sent == received  # both sides of a pair, same keys, same order
    for rank in range(layout.tp):  # each chunk of a block hears from every other node once
        for c in range(chunks):
            assert sorted(arrivals.get((rank, c), [])) == [n for n in range(nnodes) if n != layout.node_of[rank]]


def test_node_partial_batches_refuse_a_plan_whose_send_has_no_receive():
    plan = build_rs_plan(GroupLayout.uniform(2, 2), chunks=2, validate=False)
    dropped = dataclasses.replace(plan, steps=(plan.steps[0][1:],) + plan.steps[1:])
    with pytest.raises(PlanError, match=r"rank 2: .* do not pair one send with one receive"):
        rs.node_partial_batches(dropped, 2)
    with pytest.raises(ValueError, match="rank 4 outside"):
        rs.node_partial_batches(plan, 4)


def _node_partial(layout, node: int, d: int, rows: int, n: int) -> torch.Tensor:
    """What the intra-node level leaves at node ``node``'s collector of block d (the kernel's part on GPUs): its
    ranks' partials of d summed in the plan's order, the collector's (d's local index) first, then the others'."""
    first = layout.rank_at(node, layout.local_index(d))
    return _reduce([_partial(q, d, rows, n) for q in (first, *(q for q in layout.members(node) if q != first))])


def _run_two_level(rank, tp, nnodes, size, late_rank, primitive):
    layout = GroupLayout.uniform(nnodes, size)
    node = layout.node_of[rank]
    stand_in = _primitive(primitive, dist.group.WORLD)
    for rows, n, tile, swizzle in ((300, 24, 1, 2), (5, 8, 1, 0)):
        chunks = rs.full_width_chunks(rows, n, tile, swizzle)
        plan = build_rs_plan(layout, chunks=len(chunks))
        executor = rs.RsExecutor(rank, tp, len(chunks), dist.group.WORLD, rs.node_partial_batches(plan, rank),
                                 sendrecv=stand_in)
        results = []
        for call in range(2):
            collected = {b.dst for b in executor.batches}
            stage = {d: torch.full((rows, n), float("nan"), dtype=torch.float64) for d in collected}
            recv = {b.src: torch.full((rows, n), float("nan"), dtype=torch.float64) for b in executor.batches}
            # The collector's node partial of d appears chunk by chunk at its count; the owner receives the
            # other nodes' collectors' node partials of its rows.
            _, flags = _run_with_stand_ins(executor, rank, chunks, stage, recv,
                                           lambda d: _node_partial(layout, node, d, rows, n),
                                           lambda s: _node_partial(layout, layout.node_of[s], rank, rows, n),
                                           rank == late_rank)
            what = f"rank {rank} of {nnodes}x{size}, {rows}x{n}, {len(chunks)} chunks, call {call}"
            assert len(flags) == (nnodes - 1) * len(chunks), what
            by_node = {layout.node_of[s]: part for s, part in recv.items()}
            by_node[node] = _node_partial(layout, node, rank, rows, n)  # the intra-node reduce-scatter's result
            # The owner adds the node partials in the plan's sum order; the reference adds every rank's partial in
            # that same nesting, so any partial routed to the wrong rank, chunk or slot shows in the bits.
            out = _reduce([by_node[layout.node_of[ranks[0]]] for ranks in plan.sum_order[rank]])
            ref = _reduce([_reduce([_partial(q, rank, rows, n) for q in ranks]) for ranks in plan.sum_order[rank]])
            assert torch.equal(out, ref), f"{what}: reduced rows differ from the reference"
            results.append(out)
        assert torch.equal(results[0], results[1]), f"rank {rank}: two calls differ bitwise"
        dist.barrier()


TWO_LEVEL_RUNS = [(2, 1, "torch"), (2, 2, "torch"), (2, 4, "torch"), (4, 2, "torch"), (2, 2, "stand_in"),
                  (2, 4, "stand_in"), (4, 2, "stand_in")]


@pytest.mark.parametrize("nnodes,size,primitive", TWO_LEVEL_RUNS, ids=[f"{a}x{b}-{p}" for a, b, p in TWO_LEVEL_RUNS])
def test_executor_sends_each_node_partial_once_with_gloo(nnodes, size, primitive):
    run_distributed(_run_two_level, nnodes * size, nnodes, size, 1, primitive)  # rank 1 starts late


def _selection(rank, tp):
    """backend.choose and the dispatcher for gemm_rs on a 2-process gloo group, the op library and peer access
    stood in (no GPU here)."""
    import os

    from flux_layers import _library
    from flux_layers.ops import _dispatch, backend
    from flux_layers.runtime import topology
    from flux_layers.runtime.multinode import nccl_rs_transport

    _library.unavailable_reason = lambda: None
    torch.cuda.can_device_access_peer = lambda a, b: True
    torch.cuda.device_count = lambda: tp
    capturing = [False]
    torch.cuda.is_current_stream_capturing = lambda: capturing[0]
    group, cuda = dist.group.WORLD, torch.device("cuda", 0)

    def choose():
        return backend.choose("gemm_rs", device=cuda, dtype=torch.bfloat16, mkn=(256, 64, 64), group=group)

    os.environ["FLUX_LAYERS_NODE_SIZE"] = "1"  # every peer on another node
    topology.peer_access_matrix.cache_clear()
    c = choose()
    assert c.path == "reference" and "spans 2 nodes" in c.reason and "FLUX_LAYERS_TRANSPORT=nccl" in c.reason, c
    assert not backend.over_nccl("gemm_rs", group)
    os.environ["FLUX_LAYERS_TRANSPORT"] = "nccl"
    assert backend.over_nccl("gemm_rs", group)
    c = choose()
    assert c.path == "reference" and "backend is gloo" in c.reason, c  # NCCL transfers need an NCCL group
    dist.get_backend = lambda g=None: "nccl"
    c = choose()
    assert c.path == "fused" and "not yet run on GPUs" in c.reason, c
    capturing[0] = True
    c = choose()
    assert c.path == "reference" and c.reason == nccl_rs_transport.CAPTURE_REFUSAL, c
    capturing[0] = False
    os.environ["FLUX_LAYERS_TRANSPORT"] = "hybrid"  # the two-level plan: forced, across nodes
    assert backend.rs_host_transport(group) == "hybrid" and backend.over_nccl("gemm_rs", group)
    c = choose()
    assert c.path == "fused" and "hybrid transport" in c.reason and "not yet run on GPUs" in c.reason, c
    os.environ["FLUX_LAYERS_NODE_SIZE"] = "2"  # one node: the peer-mapped transports
    assert backend.rs_host_transport(group) is None and choose().path == "fused"
    os.environ["FLUX_LAYERS_NODE_SIZE"] = "1"
    os.environ["FLUX_LAYERS_TRANSPORT"] = "nccl"

    # The dispatcher asks for the NCCL transport's workspace where it is forced, the peer-mapped one otherwise (and
    # checks the call across ranks with that transport first).
    from flux_layers.ops import fused_gemm_rs
    from flux_layers.runtime import workspace
    made, signatures = [], []

    class Made(Exception):
        pass

    def get_rs_workspace(group, dtype, m, n, over_nccl=False, hybrid=False):
        made.append("Hybrid" if hybrid else "Nccl" if over_nccl else "Peer")
        raise Made
    _dispatch.choose = lambda *a, **k: backend.Choice("fused", "stand-in")
    _dispatch.check_same_call = lambda group, signature: signatures.append(signature[-1])
    fused_gemm_rs.check_args = lambda x, weight, bias, layout, group: (256, 64, 64)  # CPU tensors stand in
    workspace.get_rs_workspace = get_rs_workspace
    x, w = torch.empty(256, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.bfloat16)
    with pytest.raises(Made):
        _dispatch.decided("gemm_rs", x, w, group, "nt", None)
    os.environ["FLUX_LAYERS_TRANSPORT"] = "hybrid"
    _dispatch.refresh()
    with pytest.raises(Made):
        _dispatch.decided("gemm_rs", x, w, group, "nt", None)
    os.environ["FLUX_LAYERS_TRANSPORT"] = "auto"
    _dispatch.refresh()
    with pytest.raises(Made):
        _dispatch.decided("gemm_rs", x, w, group, "nt", None)
    assert made == ["Nccl", "Hybrid", "Peer"] and signatures == ["nccl", "hybrid", "epilogue"], (made, signatures)
    assert not _dispatch._decisions, "a call that did not get its workspace left a decision behind"


def test_selection_takes_nccl_only_when_forced():
    run_distributed(_selection, 2)


class _PlanWorkspace:
    """What plan_nccl_call reads of an RsWorkspace of the NCCL or hybrid transport (no GPU here): flag indices are
    this stand-in's own."""

    def __init__(self, rank, tp, mapped, hybrid):
        self.rank, self.tp, self.mapped, self.hybrid, self.over_nccl = rank, tp, mapped, hybrid, True
        self.dtype, self.flags_per_source, self.group = torch.bfloat16, 64, None
        self.plans: list = []

    def count_index(self, dst, chunk):
        return dst * self.flags_per_source + chunk

    def partial_flag_index(self, src, chunk):
        return (self.tp + src) * self.flags_per_source + chunk

    def plan_index(self, plan):
        self.plans.append(plan)
        return len(self.plans) - 1


@pytest.mark.parametrize("nnodes,size", [(2, 2), (2, 4), (4, 2), (2, 1)])
def test_hybrid_call_runs_the_two_level_plans_batches(monkeypatch, nnodes, size):
    """plan_nccl_call on a hybrid workspace: the op library's two-level plan (its node size) and, for the transfer
    stream, the inter-node batches of build_rs_plan (node partials only); the flat transport's otherwise."""
    from flux_layers.ops import fused_gemm_rs
    monkeypatch.setattr(rs, "for_group", lambda group: None)
    tp = nnodes * size
    rows, n = 300, 24
    for rank in range(tp):
        node = tuple(range(rank // size * size, (rank // size + 1) * size))
        ws = _PlanWorkspace(rank, tp, node, hybrid=True)
        call = fused_gemm_rs.plan_nccl_call(ws, m=rows * tp, k=64, n=n, tile=1, swizzle=2, sm_count=64)
        assert call.plan.transport == "hybrid" and call.plan.node_size == size and call.plan.chunk_cols == n
        want = rs.node_partial_batches(build_rs_plan(GroupLayout.uniform(nnodes, size), chunks=len(call.chunks)),
                                       rank)
        assert call.executor.batches == want and ws.plans == [call.plan]
        flat = fused_gemm_rs.plan_nccl_call(_PlanWorkspace(rank, tp, (rank,), hybrid=False), m=rows * tp, k=64, n=n,
                                            tile=1, swizzle=2, sm_count=64)
        assert flat.plan.transport == "external" and flat.plan.node_size == 0
        assert flat.executor.batches == rs.rs_batches(rank, tp, len(flat.chunks))
    with pytest.raises(ValueError, match="consecutive ranks"):
        fused_gemm_rs.plan_nccl_call(_PlanWorkspace(0, 4, (0, 2), hybrid=True), m=1200, k=64, n=n, sm_count=64)
