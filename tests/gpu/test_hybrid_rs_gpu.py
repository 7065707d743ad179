"""The fused GEMM+ReduceScatter on its hybrid transport (FLUX_LAYERS_TRANSPORT=hybrid,
flux_layers/ops/fused_gemm_rs.py): the two-level plan, the epilogue's stores inside each node into the owners' and
collectors' slots, the collectors' node partials by NCCL between nodes (csrc/include/flux/workspace_layout.h
RsTwoLevel), against an fp32 reference with NaN-poisoned outputs. TP GPUs with a process each and NCCL, or TP ranks
sharing one GPU (FLUX_LAYERS_TEST_SHARED_GPU=1, FLUX_LAYERS_TEST_TP), whose NCCL send/recv the host-staged stand-in
runs (flux_layers/runtime/multinode/sendrecv.py).

Nodes (FLUX_LAYERS_TEST_NODES): 0, the default, two nodes of TP / 2 ranks (at TP = 2 one rank each: every block
collected alone, the node partials alone crossing); N >= 2, N nodes of TP / N.

Checked: both dtypes, both weight layouts, M/tp a multiple of 128 and not, both tile configurations; the same bits on
a second run; what the call ran (the two-level plan, its node size); on the stand-in, that only node partials crossed
it (one per block of another node and chunk, from this node's collector); back-to-back calls with varying M on one
workspace (the consumed handshake inside the node); first calls of fresh workspaces; FP8 operands through
ops.gemm_rs; the dispatcher taking it on FLUX_LAYERS_TRANSPORT=hybrid and saying it has not run on GPUs; captured
calls refused; a rank of the last node dying makes the survivors raise within the timeout (on the stand-in)."""
from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, shared_gpu, tp_under_test
from tests.gpu.external_transfers import node_size_under_test, received_bytes, survive_peer_death
from tests.gpu.gpu_support import (
    apply_settings,
    check_fp8_output,
    fp8_global_inputs,
    fp8_w_scale,
    gemm_rs_checked,
    lean,
    needs_gpus,
    poison_outputs,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP)]


def _node_size(tp: int) -> int:
    return node_size_under_test(tp, 2)


def _hybrid(tp: int) -> None:
    apply_settings(TRANSPORT="hybrid", NODE_SIZE=str(_node_size(tp)), AG_ORDER="auto")


def _check_crossings(rank, tp, m, n, dtype, before: collections.Counter, what: str) -> None:
    """On the stand-in, the call just made received node partials only: from the collector with this rank's local
    index on each other node, one block's rows of N columns each."""
    if not shared_gpu():
        return
    size = _node_size(tp)
    want = collections.Counter({(o * size + rank % size): m // tp * n * dtype.itemsize
                                for o in range(tp // size) if o != rank // size})
    got = received_bytes() - before
    assert got == want, f"{what}: the stand-in received {dict(got)} bytes by peer, the two-level plan {dict(want)}"


def _matrix(rank, tp, seed):
    from flux_layers.ops import fused_gemm_rs
    from flux_layers.runtime import workspace
    poison_outputs()
    _hybrid(tp)
    cases = [(dtype, layout, m, tile) for dtype in (torch.bfloat16, torch.float16) for layout in ("nt", "nn")
             for m, tile in ((512 * tp, 1), (500 * tp, 0))]
    if lean():  # every shape and tile, the dtype and weight layout varied over them
        cases = [c for i, c in enumerate(cases) if i % 3 == 0]
    for i, (dtype, layout, m, tile) in enumerate(cases):
        what = f"hybrid gemm_rs node_size={_node_size(tp)} tile {tile}"
        before = received_bytes()
        out = gemm_rs_checked(rank, tp, seed + i, m, 256 * tp, 768, dtype, layout, what=what, transport="hybrid",
                              tile=tile, node_size=_node_size(tp))
        _check_crossings(rank, tp, m, 768, dtype, before, f"rank {rank} {what}")
        again = gemm_rs_checked(rank, tp, seed + i, m, 256 * tp, 768, dtype, layout, what=what, transport="hybrid",
                                tile=tile, node_size=_node_size(tp))
        assert torch.equal(out, again), f"rank {rank} {what} {dtype} {layout}: two runs differ bitwise"
        ws = workspace.get_rs_workspace(dist.group.WORLD, dtype, m, 768, hybrid=True)
        call = fused_gemm_rs.plan_nccl_call(ws, m=m, k=256, n=768, tile=tile)
        assert call.plan.transport == "hybrid" and call.plan.node_size == _node_size(tp), call.plan
    torch.cuda.synchronize()


def test_hybrid_gemm_rs_dtypes_layouts_tiles():
    run_distributed(_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _late_and_many(rank, tp, seed):
    from flux_layers.runtime.workspace import RsWorkspace
    poison_outputs()
    _hybrid(tp)
    for late in (0, 1):
        gemm_rs_checked(rank, tp, seed + late, 1024 * tp // 2, 512, 1024, torch.bfloat16, "nt", late_rank=late,
                        what="hybrid gemm_rs late rank", transport="hybrid", node_size=_node_size(tp))
    # Back-to-back calls with varying M on one workspace: a store into a node peer's slot waits for its previous
    # call's consumed word, which it writes after its kernel.
    ws = RsWorkspace(dist.group.WORLD, torch.bfloat16, 1024 * tp, 512, hybrid=True)
    rows = [1024, 500, 128, 1024, 64, 768, 8, 256]
    calls = 24 if lean() else 80
    for i in range(calls):
        gemm_rs_checked(rank, tp, seed + 100 + i, rows[i % len(rows)] * tp, 256, 512, torch.bfloat16,
                        "nt" if i % 3 else "nn", with_bias=bool(i % 2), what=f"hybrid gemm_rs back to back {i}",
                        ws=ws, node_size=_node_size(tp))
    assert ws.epoch == calls
    ws.check()
    torch.cuda.synchronize()


def test_hybrid_gemm_rs_late_rank_and_back_to_back():
    run_distributed(_late_and_many, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _first_calls(rank, tp, seed):
    from flux_layers.runtime.workspace import RsWorkspace
    poison_outputs()
    _hybrid(tp)
    for i in range(3 if lean() else 6):
        ws = RsWorkspace(dist.group.WORLD, torch.bfloat16, 512 * tp, 768, hybrid=True)
        gemm_rs_checked(rank, tp, seed + i, 512 * tp, 256 * tp, 768, torch.bfloat16, "nt", ws=ws,
                        what=f"hybrid gemm_rs first call of workspace {i}", node_size=_node_size(tp))
        ws.check()
        dist.barrier()  # no peer writes into it any more
        ws.close()
    torch.cuda.synchronize()


def test_hybrid_gemm_rs_first_calls_of_fresh_workspaces():
    """Each call the first of its workspace: bf7dfb2's intermittent faults at 8 ranks (a node's outputs wrong, two
    rows of a rank unwritten) came in tests' first calls."""
    run_distributed(_first_calls, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _dispatched(rank, tp, seed):
    from flux_layers import ops
    from flux_layers.ops.fp8 import dequantize, quantize
    from flux_layers.runtime.multinode.sendrecv import STAND_IN_NOTE
    poison_outputs()
    _hybrid(tp)
    group, i = dist.group.WORLD, 0
    for mode in ("tensor", "row"):
        for accum in ("split", "fast"):
            x, w, bias = fp8_global_inputs(seed + i, 512 * tp, 256 * tp, 512)
            i += 1
            xq = quantize(x.chunk(tp, dim=1)[rank].contiguous(), torch.float8_e4m3fn, rowwise=mode == "row")
            wq = quantize(w.chunk(tp, dim=1)[rank].contiguous(), torch.float8_e4m3fn, rowwise=mode == "row")
            args = dict(group=group, x_scale=xq.scale, w_scale=fp8_w_scale(wq, mode), fast_accum=accum == "fast")
            out = ops.gemm_rs(xq.data, wq.data, bias, backend="fused", **args)
            what = f"rank {rank} ops.gemm_rs fp8 hybrid {mode} {accum}"
            decision = ops.decide("gemm_rs", xq.data, wq.data, group=group, backend="fused",
                                  fast_accum=accum == "fast")
            assert decision.transport == "hybrid" and decision.plan.transport == "hybrid", f"{what}: {decision}"
            assert "not yet run on GPUs" in decision.reason and (STAND_IN_NOTE in decision.reason) == shared_gpu(), \
                decision.reason
            assert torch.equal(out, ops.gemm_rs(xq.data, wq.data, bias, backend="fused", **args)), \
                f"{what}: two runs differ bitwise"
            reference = ops.gemm_rs(xq.data, wq.data, bias, backend="reference", **args)
            partial = dequantize(xq) @ dequantize(wq).t()
            dist.all_reduce(partial, group=group)
            check_fp8_output(out, partial.chunk(tp)[rank] + bias.float(), reference, what)
    torch.cuda.synchronize()
    x = torch.randn(512 * tp, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    ops.gemm_rs(x, w, group=group, backend="fused")  # decided eagerly first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match="CUDA-graph capture"):
            ops.gemm_rs(x, w, group=group, backend="fused")
    torch.cuda.synchronize()


def test_hybrid_gemm_rs_taken_by_the_dispatcher_when_forced():
    run_distributed(_dispatched, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


# ---------------------------------------------------------------- a peer dies

TIMEOUT_S = 5.0  # the dead peer is found within it; the calls before the death must fit in it too


def _after_death(tp):
    """A call with the shape decided before the death (random inputs: nothing is checked but that it raises)."""
    from flux_layers import ops
    ops.gemm_rs(torch.randn(256 * tp, 128, device="cuda", dtype=torch.bfloat16),
                torch.randn(256, 128, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD, backend="fused")


def _peer_death(rank, tp, seed):
    from flux_layers import ops
    os.environ["FLUX_LAYERS_TIMEOUT_S"] = str(TIMEOUT_S)  # read when the workspaces and the stand-in are made
    _hybrid(tp)
    for i in range(2):
        gemm_rs_checked(rank, tp, seed + i, 256 * tp, 128 * tp, 256, torch.bfloat16, "nt",
                        what="hybrid gemm_rs before a death", transport="hybrid", node_size=_node_size(tp))
        ops.gemm_rs(torch.randn(256 * tp, 128, device="cuda", dtype=torch.bfloat16),
                    torch.randn(256, 128, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD,
                    backend="fused")  # the shape _after_death calls, decided while every rank is alive
    torch.cuda.synchronize()
    dist.barrier()
    if rank == tp - 1:
        os._exit(0)  # the last node loses a rank between calls: no error, no goodbye
    survive_peer_death(rank, [lambda: _after_death(tp)], TIMEOUT_S)


@pytest.mark.skipif(not shared_gpu(), reason="NCCL's own receive from a dead peer stays pending until its watchdog "
                    "aborts the communicator (docs/design.md §7); the host-staged stand-in gives up within the timeout")
def test_dead_peer_raises_on_the_survivors_instead_of_hanging():
    run_distributed(_peer_death, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl", timeout_s=120)
