"""The fused AllGather+GEMM on its hybrid transport (FLUX_LAYERS_TRANSPORT=hybrid; flux_layers/ops/fused_ag_gemm.py):
NCCL between nodes, host-driven copy-engine pushes inside them into a workspace mapped over the node's own process
group, against an fp32 reference with NaN-poisoned outputs. TP GPUs with a process each and NCCL, or TP ranks sharing
one GPU (FLUX_LAYERS_TEST_SHARED_GPU=1, FLUX_LAYERS_TEST_TP), whose NCCL send/recv the host-staged stand-in runs
(flux_layers/runtime/multinode/sendrecv.py; the pushes, flags, handshake and workspace are the transport's own).

Layouts (FLUX_LAYERS_TEST_NODES): 0, the default: at TP = 2 one node (every chunk pushed), at TP >= 4 two emulated
nodes of TP / 2 ranks; N >= 2: N nodes of TP / N (FLUX_LAYERS_NODE_SIZE). Each in the internode order and, where a
node holds two NUMA halves, in numa2d (FLUX_LAYERS_NUMA_MAP forced).

Checked: every layout, both dtypes, both weight layouts, M/tp a multiple of the tile and not, chunked and not (lean
runs spread dtype and weight layout over the rest); the gathered input bitwise; each call's plan and workspace (its
mapped ranks are the node's) and, on the stand-in, that only the plan's NCCL chunks crossed it (the node's went by
pushes); a late rank; back-to-back calls with varying M and the order changing between calls on one workspace (the
done handshake); the dispatched op on FLUX_LAYERS_TRANSPORT=hybrid, saying it has not run on GPUs; captured calls
refused; a rank of the last node dying makes the survivors raise within the timeout (on the stand-in)."""
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
        nodes = 1 if tp == 2 else 2
    if tp % nodes:
        raise ValueError(f"FLUX_LAYERS_TEST_NODES={nodes} must split FLUX_LAYERS_TEST_TP={tp} into nodes")
    size = tp // nodes
    layouts = [(str(size), "internode" if nodes > 1 else "mesh", "")]
    if nodes > 1 and size % 2 == 0:  # two NUMA halves per node
        layouts.append((str(size), "numa2d", ",".join(["0"] * (size // 2) + ["1"] * (size // 2))))
    return layouts


LAYOUTS = _layouts(TP, _env.get_int("TEST_NODES"))


def _set_layout(node_size: str, order: str, numa: str) -> None:
    set_layout("hybrid", node_size, order, numa)


def _check_plan(rank, tp, m, k, n_local, dtype, chunk_rows, received_before) -> None:
    """The call just made ran the hybrid plan of the layout set, on a workspace mapped over its node, and (on the
    stand-in) received exactly its batches' NCCL chunks: the node's came by pushes."""
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.runtime import workspace
    ws = workspace.get_ag_workspace(dist.group.WORLD, dtype, m, k, "hybrid")
    registered = len(ws._plans)
    call = fused_ag_gemm.plan_nccl_call(ws, m=m, k=k, n=n_local, chunk_rows=chunk_rows)
    plan, what = call.executor.plan, f"rank {rank} hybrid {layout_name()}"
    size = int(os.environ["FLUX_LAYERS_NODE_SIZE"])
    node = tuple(range(rank // size * size, (rank // size + 1) * size))
    assert plan.layout.nnodes == tp // size and ws.mapped == node, f"{what}: plan {plan.order}, maps {ws.mapped}"
    assert len(ws._plans) == registered and call.plan.mode == "external", f"{what}: the call did not run {call.plan}"
    assert call.pushes is not None and call.pushes.peers == tuple(q for q in node if q != rank), what
    assert bool(call.pushes.targets) == (size > 1), f"{what}: pushes to {call.pushes.targets}"
    got = check_received(call, m, tp, k, dtype, received_before, what)
    assert not set(got) & set(node), f"{what}: chunks of the node crossed the stand-in: {dict(got)}"


def _one_call(rank, tp, seed, m, k, n, dtype, layout, **kwargs):
    ag_gemm_checked(rank, tp, seed, m, k, n, dtype, layout, transport="hybrid", **kwargs,
                    what=f"hybrid {layout_name()}")


def _matrix(rank, tp, seed):
    ag_matrix(rank, tp, seed, "hybrid", LAYOUTS, _check_plan)


def test_hybrid_ag_gemm_layouts_dtypes_weight_layouts():
    run_distributed(_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _late_and_many(rank, tp, seed):
    poison_outputs()
    _set_layout(*LAYOUTS[0])
    rows = rows_per_rank(2048, tp)
    for late in (0, 1):
        _one_call(rank, tp, seed + late, rows * tp, 1024, 512 * tp, torch.bfloat16, "nt", late_rank=late)
    # Back-to-back calls on one workspace with varying M, chunked and not, and the order changing between calls
    # where the layout has two: a push waits for its target's previous call whichever plan that call ran.
    from flux_layers.runtime.workspace import AgWorkspace
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 512, transport="hybrid")
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    calls = 40 if lean() else 200
    for i in range(calls):
        _set_layout(*LAYOUTS[i % len(LAYOUTS)])
        m = rows[i % len(rows)] * tp
        _one_call(rank, tp, seed + 100 + i, m, 512, 128 * tp, torch.bfloat16, "nt" if i % 3 else "nn",
                  with_bias=bool(i % 2), ws=ws, chunk_rows=(0, 256)[i % 2])
    assert ws.epoch == calls
    ws.check()
    torch.cuda.synchronize()


def test_hybrid_ag_gemm_late_rank_and_back_to_back():
    run_distributed(_late_and_many, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _dispatched(rank, tp, seed):
    from flux_layers import ops
    from flux_layers.runtime.multinode.sendrecv import STAND_IN_NOTE
    poison_outputs()
    _set_layout(*LAYOUTS[0])
    ops.refresh_settings()
    x, w, _ = global_inputs(seed, 1536 * tp, 1024, 256 * tp, torch.bfloat16, "nt")
    x_shard_m, w_shard_n = x.chunk(tp)[rank], w.chunk(tp)[rank].contiguous()
    for _ in range(3):
        out = ops.ag_gemm(x_shard_m, w_shard_n, group=dist.group.WORLD, backend="fused")
        assert_close_rel(out, *references(x, w_shard_n, None, "nt"), f"rank {rank} ops.ag_gemm hybrid")
    decision = ops.decide("ag_gemm", x_shard_m, w_shard_n, group=dist.group.WORLD, backend="fused")
    assert decision.transport == "hybrid" and decision.plan.mode == "external", decision
    assert "not yet run on GPUs" in decision.reason, decision.reason
    assert (STAND_IN_NOTE in decision.reason) == shared_gpu(), decision.reason
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match="CUDA-graph capture"):
            ops.ag_gemm(x_shard_m, w_shard_n, group=dist.group.WORLD, backend="fused")
    torch.cuda.synchronize()


def test_hybrid_transport_taken_by_the_dispatcher_when_forced():
    run_distributed(_dispatched, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


# ---------------------------------------------------------------- a peer dies

TIMEOUT_S = 5.0  # the dead peer is found within it; the calls before the death must fit in it too


def _after_death():
    """A call with the shape decided before the death (random inputs: nothing is checked but that it raises)."""
    from flux_layers import ops
    ops.ag_gemm(torch.randn(256, 256, device="cuda", dtype=torch.bfloat16),
                torch.randn(128, 256, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD, backend="fused")


def _peer_death(rank, tp, seed):
    from flux_layers import ops
    os.environ["FLUX_LAYERS_TIMEOUT_S"] = str(TIMEOUT_S)  # read when the workspaces and the stand-in are made
    _set_layout(*LAYOUTS[0])
    ops.refresh_settings()
    for i in range(2):
        x, w, _ = global_inputs(seed + i, 256 * tp, 256, 128 * tp, torch.bfloat16, "nt")
        w_shard_n = w.chunk(tp)[rank].contiguous()
        out = ops.ag_gemm(x.chunk(tp)[rank], w_shard_n, group=dist.group.WORLD, backend="fused")
        assert_close_rel(out, *references(x, w_shard_n, None, "nt"), f"rank {rank} hybrid ag_gemm")
    torch.cuda.synchronize()
    dist.barrier()
    if rank == tp - 1:
        os._exit(0)  # the last node loses a rank between calls: no error, no goodbye
    survive_peer_death(rank, [_after_death], TIMEOUT_S)


@pytest.mark.skipif(not shared_gpu(), reason="NCCL's own receive from a dead peer stays pending until its watchdog "
                    "aborts the communicator (docs/design.md §7); the host-staged stand-in gives up within the timeout")
def test_dead_peer_raises_on_the_survivors_instead_of_hanging():
    run_distributed(_peer_death, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl", timeout_s=120)
