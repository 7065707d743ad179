"""The fused operators over their NCCL transports, against an fp32 reference with NaN-poisoned outputs
(flux_layers/devtools/oracle.py): TP GPUs with a process each and NCCL, or TP ranks sharing one GPU
(FLUX_LAYERS_TEST_SHARED_GPU=1, FLUX_LAYERS_TEST_TP), whose send/recv the host-staged stand-in runs
(flux_layers/runtime/multinode/sendrecv.py; every other line is the transports' own: plans, batches, flags, the kernels'
external mode, the workspaces).

Layouts (FLUX_LAYERS_TEST_NODES): 0, the default: node size 1 (every peer on another "node"), one node with NCCL
forced, and the NUMA-2D order forced inside one node; N >= 2: N emulated nodes of TP / N ranks
(FLUX_LAYERS_NODE_SIZE) in the internode order and, where a node holds two NUMA halves, in numa2d
(FLUX_LAYERS_NUMA_MAP forced).

AllGather+GEMM (flux_layers/runtime/multinode/nccl_transport.py): every layout, both dtypes, both weight layouts, M/tp a
multiple of the tile and not, chunked and not (lean runs: each layout's chunkings and shapes, the other axes varied
across them); each call's plan (order, nodes) and, on the stand-in, the bytes this rank received against the plan's
chunks; a late rank; back-to-back calls with varying M; the dispatched op taking NCCL by itself where the group
spans nodes (saying so where the stand-in runs it); captured calls refused.

GEMM+ReduceScatter (flux_layers/runtime/multinode/nccl_rs_transport.py): both weight layouts, both dtypes, both tile
configurations, M/tp a multiple of 128 and not, several chunks per peer; a late rank; back-to-back calls with varying
M; bitwise equal results across runs; the dispatched op taking NCCL only when FLUX_LAYERS_TRANSPORT=nccl; captured
calls refused.

A rank of another node dying makes both operators raise on the survivors within the timeout, and their devices
drain (on the stand-in; NCCL's own receive from a dead peer stays pending, docs/design.md §7)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flux_layers import _env
from flux_layers.devtools.launch import run_distributed, shared_gpu, tp_under_test
from tests.gpu.external_transfers import (
    ag_matrix,
    check_received,
    layout_name,
    set_layout,
    survive_peer_death,
)
from tests.gpu.gpu_support import (
    ag_gemm_checked,
    assert_close_rel,
    gemm_rs_checked,
    global_inputs,
    lean,
    needs_gpus,
    poison_outputs,
    references,
    rows_per_rank,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP)]


def _layouts(tp: int, nodes: int) -> list[tuple[str, str, str]]:
    """(FLUX_LAYERS_NODE_SIZE, FLUX_LAYERS_AG_ORDER, FLUX_LAYERS_NUMA_MAP of one node) of the layouts under test."""
    if nodes == 0:
        halves = ",".join(["0"] * (tp // 2) + ["1"] * (tp // 2))
        return [("1", "auto", ""), (str(tp), "auto", ""), (str(tp), "numa2d", halves)]
    if nodes < 2 or tp % nodes:
        raise ValueError(f"FLUX_LAYERS_TEST_NODES={nodes} must split FLUX_LAYERS_TEST_TP={tp} into 2 or more nodes")
    size = tp // nodes
    layouts = [(str(size), "internode", "")]
    if size % 2 == 0:  # two NUMA halves per node
        layouts.append((str(size), "numa2d", ",".join(["0"] * (size // 2) + ["1"] * (size // 2))))
    return layouts


LAYOUTS = _layouts(TP, _env.get_int("TEST_NODES"))
# The layout whose last node loses a rank in the peer-death test: the first one of several nodes.
MULTI_NODE = next(layout for layout in LAYOUTS if int(layout[0]) < TP)
TIMEOUT_S = 5.0  # the dead peer is found within it; the calls before the death must fit in it too


def _set_layout(node_size: str, order: str, numa: str) -> None:
    set_layout("nccl", node_size, order, numa)


def _check_ag_plan(rank, tp, m, k, n_local, dtype, chunk_rows, received_before) -> None:
    """The call just made ran the NCCL transport's plan of the layout set (its nodes and order) and, on the stand-in,
    received exactly this rank's batches' chunks, no more."""
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.runtime import workspace
    from flux_layers.runtime.multinode import sendrecv
    ws = workspace.get_ag_workspace(dist.group.WORLD, dtype, m, k, "nccl")
    registered = len(ws._plans)
    call = fused_ag_gemm.plan_nccl_call(ws, m=m, k=k, n=n_local, chunk_rows=chunk_rows)
    plan, what = call.executor.plan, f"rank {rank} {layout_name()}"
    node_size, order = int(os.environ["FLUX_LAYERS_NODE_SIZE"]), os.environ["FLUX_LAYERS_AG_ORDER"]
    assert plan.layout.nnodes == tp // node_size and order in ("auto", plan.order), f"{what}: plan {plan.order}"
    # plan_nccl_call registers its plan: the call registered this one already
    assert len(ws._plans) == registered and call.plan.mode == "external", f"{what}: the call did not run {call.plan}"
    if not shared_gpu():
        assert isinstance(call.executor.sendrecv, sendrecv.GroupSendRecv), what
        return
    assert isinstance(call.executor.sendrecv, sendrecv.HostStagedSendRecv), what
    check_received(call, m, tp, k, dtype, received_before, what)


def _one_call(rank, tp, seed, m, k, n, dtype, layout, **kwargs):
    ag_gemm_checked(rank, tp, seed, m, k, n, dtype, layout, transport="nccl", **kwargs,
                    what=f"nccl ag_gemm {layout_name()}")


def _matrix(rank, tp, seed):
    ag_matrix(rank, tp, seed, "nccl", LAYOUTS, _check_ag_plan)


def test_nccl_ag_gemm_layouts_dtypes_weight_layouts():
    run_distributed(_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _late_and_many(rank, tp, seed):
    poison_outputs()
    _set_layout(*MULTI_NODE)
    rows = rows_per_rank(2048, tp)
    for late in (0, 1):
        _one_call(rank, tp, seed + late, rows * tp, 1024, 512 * tp, torch.bfloat16, "nt", late_rank=late)
    # Back-to-back calls with varying M on one workspace (max M fixed up front), chunked and not: 200, or 40 where
    # lean.
    from flux_layers.runtime.workspace import AgWorkspace
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 512, transport="nccl")
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    calls = 40 if lean() else 200
    for i in range(calls):
        m = rows[i % len(rows)] * tp
        _one_call(rank, tp, seed + 100 + i, m, 512, 128 * tp, torch.bfloat16, "nt" if i % 3 else "nn",
                  with_bias=bool(i % 2), ws=ws, chunk_rows=(0, 256)[i % 2])
    assert ws.epoch == calls
    from flux_layers.ops import fused_ag_gemm
    with pytest.raises(ValueError, match="max_m"):  # rejected before anything runs
        fused_ag_gemm.ag_gemm(torch.empty(4096, 512, device="cuda", dtype=torch.bfloat16),
                              torch.empty(128, 512, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD, ws=ws)
    torch.cuda.synchronize()


def test_nccl_ag_gemm_late_rank_and_back_to_back():
    run_distributed(_late_and_many, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _dispatched(rank, tp, seed):
    from flux_layers import ops
    from flux_layers.runtime.multinode.nccl_transport import CAPTURE_REFUSAL
    from flux_layers.runtime.multinode.sendrecv import STAND_IN_NOTE
    poison_outputs()
    _set_layout(*MULTI_NODE)
    os.environ["FLUX_LAYERS_TRANSPORT"] = "auto"  # the group spans nodes, so NCCL by itself
    ops.refresh_settings()
    x, w, b = global_inputs(seed, 1536 * tp, 1024, 256 * tp, torch.bfloat16, "nt")
    x_shard_m, w_shard_n = x.chunk(tp)[rank], w.chunk(tp)[rank].contiguous()
    for _ in range(3):
        out = ops.ag_gemm(x_shard_m, w_shard_n, group=dist.group.WORLD, backend="fused")
        assert_close_rel(out, *references(x, w_shard_n, None, "nt"), f"rank {rank} ops.ag_gemm nccl")
    decision = ops.decide("ag_gemm", x_shard_m, w_shard_n, group=dist.group.WORLD, backend="fused")
    assert decision.transport == "nccl" and decision.plan.mode == "external", decision
    assert (STAND_IN_NOTE in decision.reason) == shared_gpu(), decision.reason
    # A captured call is refused, saying why (and so is the dispatcher's choice under capture).
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match="CUDA-graph capture"):
            ops.ag_gemm(x_shard_m, w_shard_n, group=dist.group.WORLD, backend="fused")
    assert "CUDA-graph capture" in CAPTURE_REFUSAL
    torch.cuda.synchronize()


def test_nccl_transport_taken_by_the_dispatcher():
    run_distributed(_dispatched, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


# ---------------------------------------------------------------- GEMM+ReduceScatter over NCCL

def _rs_one_call(rank, tp, seed, m, k, n, dtype, layout, **kwargs):
    return gemm_rs_checked(rank, tp, seed, m, k, n, dtype, layout, transport="nccl", **kwargs,
                           what=f"nccl gemm_rs tile={kwargs.get('tile')} {layout_name()}")


def _rs_cases(tp):
    """(node size, dtype, weight layout, (M, K, N), tile): the flat transport moves each partial to its owner
    whatever the nodes, so one multi-node layout and one node (the default layouts) or the layout under test;
    every combination, or where lean every shape with both tiles, dtype and weight layout varied across them."""
    # M/tp a multiple of the tile, one that is not a multiple of 128, and several chunks per peer (tile 1)
    shapes = ((rows_per_rank(1024, tp) * tp, 512 * tp, 768), (rows_per_rank(1000, tp) * tp, 264 * tp, 264),
              (2048 * tp, 256 * tp, 256) if shared_gpu() else (4096 * tp, 256 * tp, 512))
    sizes = ("1", str(tp)) if _env.get_int("TEST_NODES") == 0 else (MULTI_NODE[0],)
    if lean():
        return [(size, (torch.bfloat16, torch.float16)[i % 2], ("nt", "nn")[(i // 2) % 2], shape, tile)
                for size in sizes for i, (shape, tile) in enumerate((s, t) for s in shapes for t in (0, 1))]
    return [(size, dtype, w, shape, tile) for size in sizes for dtype in (torch.bfloat16, torch.float16)
            for w in ("nt", "nn") for shape in shapes for tile in (0, 1)]


def _rs_matrix(rank, tp, seed):
    poison_outputs()
    for i, (node_size, dtype, layout, (m, k, n), tile) in enumerate(_rs_cases(tp)):
        _set_layout(node_size, "auto", "")
        _rs_one_call(rank, tp, seed + i, m, k, n, dtype, layout, with_bias=bool(i % 2), tile=tile)
    torch.cuda.synchronize()


def test_nccl_gemm_rs_layouts_dtypes_shapes():
    run_distributed(_rs_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _rs_late_many_deterministic(rank, tp, seed):
    poison_outputs()
    _set_layout(*MULTI_NODE)
    m = rows_per_rank(2048, tp) * tp
    for late in (0, 1):
        _rs_one_call(rank, tp, seed + late, m, 1024 * tp, 1024, torch.bfloat16, "nt", late_rank=late)
    n = 1024 if shared_gpu() else 2048
    first = _rs_one_call(rank, tp, seed + 5, m, 1024 * tp, n, torch.bfloat16, "nt")
    again = _rs_one_call(rank, tp, seed + 5, m, 1024 * tp, n, torch.bfloat16, "nt")
    assert torch.equal(first, again), f"rank {rank}: two NCCL gemm_rs runs on the same inputs differ bitwise"
    from flux_layers.runtime.workspace import RsWorkspace
    ws = RsWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 256, over_nccl=True)
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    calls = 40 if lean() else 200
    for i in range(calls):
        m = rows[i % len(rows)] * tp
        _rs_one_call(rank, tp, seed + 100 + i, m, 256 * tp, 256, torch.bfloat16, "nt" if i % 3 else "nn",
                     with_bias=bool(i % 2), ws=ws, tile=i % 2)
    assert ws.epoch == calls
    from flux_layers.ops import fused_gemm_rs
    with pytest.raises(ValueError, match="max_m"):  # rejected before anything runs
        fused_gemm_rs.gemm_rs(torch.empty(4096 * tp, 256, device="cuda", dtype=torch.bfloat16),
                              torch.empty(256, 256, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD, ws=ws)
    ws.check()
    torch.cuda.synchronize()


def test_nccl_gemm_rs_late_rank_back_to_back_and_bitwise_repeatable():
    run_distributed(_rs_late_many_deterministic, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _rs_dispatched(rank, tp, seed):
    from flux_layers import ops
    from flux_layers.runtime.multinode.nccl_rs_transport import CAPTURE_REFUSAL
    from flux_layers.runtime.multinode.sendrecv import STAND_IN_NOTE
    poison_outputs()
    m, k, n = rows_per_rank(1536, tp) * tp, 512 * tp, 1024
    x, w, b = global_inputs(seed, m, k, n, torch.bfloat16, "nt")
    x_shard_k, w_shard_k = x.chunk(tp, dim=1)[rank].contiguous(), w.chunk(tp, dim=1)[rank].contiguous()
    # A group over several nodes without forcing: the reduce-scatter keeps the reference path.
    _set_layout(*MULTI_NODE)
    os.environ["FLUX_LAYERS_TRANSPORT"] = "auto"
    ops.refresh_settings()
    choice = ops.plan("gemm_rs", x_shard_k, w_shard_k, group=dist.group.WORLD)
    assert choice.path == "reference" and "FLUX_LAYERS_TRANSPORT=nccl" in choice.reason, choice
    os.environ["FLUX_LAYERS_TRANSPORT"] = "nccl"
    ops.refresh_settings()
    choice = ops.plan("gemm_rs", x_shard_k, w_shard_k, group=dist.group.WORLD)
    assert choice.path == "fused" and "not yet run on GPUs" in choice.reason, choice
    assert (STAND_IN_NOTE in choice.reason) == shared_gpu(), choice.reason
    full, cublas = references(x, w, b, "nt")
    for _ in range(3):
        out = ops.gemm_rs(x_shard_k, w_shard_k, b, group=dist.group.WORLD)
        assert_close_rel(out, full.chunk(tp)[rank], cublas.chunk(tp)[rank], f"rank {rank} ops.gemm_rs nccl")
    decision = ops.decide("gemm_rs", x_shard_k, w_shard_k, group=dist.group.WORLD)
    assert decision.transport == "nccl" and decision.plan.transport == "external", decision
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match="CUDA-graph capture"):
            ops.gemm_rs(x_shard_k, w_shard_k, group=dist.group.WORLD, backend="fused")
    assert "CUDA-graph capture" in CAPTURE_REFUSAL
    torch.cuda.synchronize()


def test_nccl_gemm_rs_taken_by_the_dispatcher_only_when_forced():
    run_distributed(_rs_dispatched, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


# ---------------------------------------------------------------- a peer on another node dies

def _calls(rank, tp, seed):
    """One dispatched call of each operator on the NCCL transport, checked."""
    from flux_layers import ops
    x, w, _ = global_inputs(seed, 256 * tp, 256, 128 * tp, torch.bfloat16, "nt")
    w_shard_n = w.chunk(tp)[rank].contiguous()
    out = ops.ag_gemm(x.chunk(tp)[rank], w_shard_n, group=dist.group.WORLD, backend="fused")
    assert_close_rel(out, *references(x, w_shard_n, None, "nt"), f"rank {rank} ag_gemm")
    x, w, b = global_inputs(seed + 1, 256 * tp, 128 * tp, 256, torch.bfloat16, "nt")
    out = ops.gemm_rs(x.chunk(tp, dim=1)[rank].contiguous(), w.chunk(tp, dim=1)[rank].contiguous(), b,
                      group=dist.group.WORLD, backend="fused")
    full, cublas = references(x, w, b, "nt")
    assert_close_rel(out, full.chunk(tp)[rank], cublas.chunk(tp)[rank], f"rank {rank} gemm_rs")


def _after_death(tp, op):
    """A call of ``op`` with the shapes :func:`_calls` decided (random inputs: nothing is checked but that it
    raises)."""
    from flux_layers import ops
    if op == "ag_gemm":
        ops.ag_gemm(torch.randn(256, 256, device="cuda", dtype=torch.bfloat16),
                    torch.randn(128, 256, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD, backend="fused")
    else:
        ops.gemm_rs(torch.randn(256 * tp, 128, device="cuda", dtype=torch.bfloat16),
                    torch.randn(256, 128, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD,
                    backend="fused")


def _peer_death_across_nodes(rank, tp, seed):
    from flux_layers import ops
    os.environ["FLUX_LAYERS_TIMEOUT_S"] = str(TIMEOUT_S)  # read when the workspaces and the stand-in are made
    _set_layout(*MULTI_NODE)
    ops.refresh_settings()
    for i in range(2):
        _calls(rank, tp, seed + 10 * i)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == tp - 1:
        os._exit(0)  # the last node loses a rank between calls: no error, no goodbye
    # calls of both operators after it (shapes decided before the death: no collective)
    survive_peer_death(rank, [lambda: _after_death(tp, "ag_gemm"), lambda: _after_death(tp, "gemm_rs")], TIMEOUT_S)


@pytest.mark.skipif(not shared_gpu(), reason="NCCL's own receive from a dead peer stays pending until its watchdog "
                    "aborts the communicator (docs/design.md §7); the host-staged stand-in gives up within the timeout")
@pytest.mark.parametrize("connections", ["8", "1"])
def test_dead_peer_on_another_node_raises_instead_of_hanging(connections, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    run_distributed(_peer_death_across_nodes, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl",
                    timeout_s=120)
