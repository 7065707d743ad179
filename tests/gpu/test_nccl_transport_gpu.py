"""The fused operators over their NCCL transports on 2+ GPUs, one process each, against an fp32 reference with
NaN-poisoned outputs (flux_layers/devtools/oracle.py).

AllGather+GEMM (flux_layers/runtime/nccl_transport.py): node size 1 (every peer on another "node": all transfers by
NCCL), one node with NCCL forced, and the NUMA-2D order forced; a late rank; 200 back-to-back calls with varying M;
the dispatched op (ops.ag_gemm) choosing NCCL by itself; captured calls refused.

GEMM+ReduceScatter (flux_layers/runtime/nccl_rs_transport.py): both weight layouts, both dtypes, both tile
configurations, M/tp a multiple of 128 and not; a late rank; 200 back-to-back calls with varying M; bitwise equal
results across runs; the dispatched op (ops.gemm_rs) taking NCCL only when FLUX_LAYERS_TRANSPORT=nccl; captured
calls refused.

Needs a GPU per rank: NCCL refuses two ranks on one GPU, so FLUX_LAYERS_TEST_SHARED_GPU=1 does not run these."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed
from tests.gpu.gpu_support import (
    ag_gemm_checked,
    assert_close_rel,
    gemm_rs_checked,
    global_inputs,
    needs_gpus,
    poison_outputs,
    references,
)

pytestmark = [pytest.mark.gpu, needs_gpus(2, shared=False)]

TP = min(max(torch.cuda.device_count(), 2), 8)

# (FLUX_LAYERS_NODE_SIZE, FLUX_LAYERS_AG_ORDER, FLUX_LAYERS_NUMA_MAP of one node)
HALVES = ",".join(["0"] * (TP // 2) + ["1"] * (TP // 2))
LAYOUTS = [("1", "auto", ""), (str(TP), "auto", ""), (str(TP), "numa2d", HALVES)]


def _set_layout(node_size: str, order: str, numa: str) -> None:
    os.environ["FLUX_LAYERS_TRANSPORT"] = "nccl"
    os.environ["FLUX_LAYERS_NODE_SIZE"] = node_size
    os.environ["FLUX_LAYERS_AG_ORDER"] = order
    os.environ["FLUX_LAYERS_NUMA_MAP"] = numa


def _one_call(rank, tp, seed, m, k, n, dtype, layout, **kwargs):
    ag_gemm_checked(rank, tp, seed, m, k, n, dtype, layout, transport="nccl", **kwargs,
                    what=f"nccl ag_gemm node_size={os.environ['FLUX_LAYERS_NODE_SIZE']} "
                         f"order={os.environ['FLUX_LAYERS_AG_ORDER']}")


def _matrix(rank, tp, seed):
    poison_outputs()
    i = 0
    for node_size, order, numa in LAYOUTS:
        _set_layout(node_size, order, numa)
        for dtype in (torch.bfloat16, torch.float16):
            for layout in ("nt", "nn"):
                # per-rank share a multiple of the tile, and one that is not a multiple of 128
                for (m, k, n) in ((1024 * tp, 1024, 384 * tp), (1000 * tp, 520, 136 * tp)):
                    for chunk_rows in (0, 128):
                        _one_call(rank, tp, seed + i, m, k, n, dtype, layout, chunk_rows=chunk_rows)
                        i += 1
    torch.cuda.synchronize()


def test_nccl_ag_gemm_layouts_dtypes_weight_layouts():
    run_distributed(_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _late_and_many(rank, tp, seed):
    poison_outputs()
    _set_layout("1", "auto", "")
    for late in (0, 1):
        _one_call(rank, tp, seed + late, 2048 * tp, 1024, 512 * tp, torch.bfloat16, "nt", late_rank=late)
    # 200 back-to-back calls with varying M on one workspace (max M fixed up front), chunked and not.
    from flux_layers.runtime.workspace import AgWorkspace
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 512, transport="nccl")
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    for i in range(200):
        m = rows[i % len(rows)] * tp
        _one_call(rank, tp, seed + 100 + i, m, 512, 128 * tp, torch.bfloat16, "nt" if i % 3 else "nn",
                  with_bias=bool(i % 2), ws=ws, chunk_rows=(0, 256)[i % 2])
    assert ws.epoch == 200
    with pytest.raises(ValueError, match="max_m"):
        _one_call(rank, tp, seed, 4096 * tp, 512, 128 * tp, torch.bfloat16, "nt", ws=ws)
    torch.cuda.synchronize()


def test_nccl_ag_gemm_late_rank_and_back_to_back():
    run_distributed(_late_and_many, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _dispatched(rank, tp, seed):
    from flux_layers import ops
    from flux_layers.runtime.nccl_transport import CAPTURE_REFUSAL
    poison_outputs()
    _set_layout("1", "auto", "")
    os.environ["FLUX_LAYERS_TRANSPORT"] = "auto"  # node size 1: the group spans nodes, so NCCL by itself
    ops.refresh_settings()
    x, w, b = global_inputs(seed, 1536 * tp, 1024, 256 * tp, torch.bfloat16, "nt")
    x_shard_m, w_shard_n = x.chunk(tp)[rank], w.chunk(tp)[rank].contiguous()
    for _ in range(3):
        out = ops.ag_gemm(x_shard_m, w_shard_n, group=dist.group.WORLD, backend="fused")
        assert_close_rel(out, *references(x, w_shard_n, None, "nt"), f"rank {rank} ops.ag_gemm nccl")
    decision = ops.decide("ag_gemm", x_shard_m, w_shard_n, group=dist.group.WORLD, backend="fused")
    assert decision.transport == "nccl" and decision.plan.mode == "external", decision
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
                           what=f"nccl gemm_rs tile={kwargs.get('tile')} node_size="
                                f"{os.environ['FLUX_LAYERS_NODE_SIZE']}")


def _rs_matrix(rank, tp, seed):
    poison_outputs()
    i = 0
    for node_size in ("1", str(tp)):
        _set_layout(node_size, "auto", "")
        for dtype in (torch.bfloat16, torch.float16):
            for layout in ("nt", "nn"):
                # M/tp a multiple of the tile, one that is not a multiple of 128, and several chunks per peer
                for (m, k, n) in ((1024 * tp, 512 * tp, 768), (1000 * tp, 264 * tp, 264), (4096 * tp, 256 * tp, 512)):
                    for tile in (0, 1):
                        _rs_one_call(rank, tp, seed + i, m, k, n, dtype, layout, with_bias=bool(i % 2), tile=tile)
                        i += 1
    torch.cuda.synchronize()


def test_nccl_gemm_rs_layouts_dtypes_shapes():
    run_distributed(_rs_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _rs_late_many_deterministic(rank, tp, seed):
    poison_outputs()
    _set_layout("1", "auto", "")
    for late in (0, 1):
        _rs_one_call(rank, tp, seed + late, 2048 * tp, 1024 * tp, 1024, torch.bfloat16, "nt", late_rank=late)
    first = _rs_one_call(rank, tp, seed + 5, 4096 * tp, 1024 * tp, 2048, torch.bfloat16, "nt")
    again = _rs_one_call(rank, tp, seed + 5, 4096 * tp, 1024 * tp, 2048, torch.bfloat16, "nt")
    assert torch.equal(first, again), f"rank {rank}: two NCCL gemm_rs runs on the same inputs differ bitwise"
    from flux_layers.runtime.workspace import RsWorkspace
    ws = RsWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 256, nccl=True)
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    for i in range(200):
        m = rows[i % len(rows)] * tp
        _rs_one_call(rank, tp, seed + 100 + i, m, 256 * tp, 256, torch.bfloat16, "nt" if i % 3 else "nn",
                     with_bias=bool(i % 2), ws=ws, tile=i % 2)
    assert ws.epoch == 200
    with pytest.raises(ValueError, match="max_m"):
        _rs_one_call(rank, tp, seed, 4096 * tp, 256 * tp, 256, torch.bfloat16, "nt", ws=ws)
    ws.check()
    torch.cuda.synchronize()


def test_nccl_gemm_rs_late_rank_back_to_back_and_bitwise_repeatable():
    run_distributed(_rs_late_many_deterministic, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _rs_dispatched(rank, tp, seed):
    from flux_layers import ops
    from flux_layers.runtime.nccl_rs_transport import CAPTURE_REFUSAL
    poison_outputs()
    m, k, n = 1536 * tp, 512 * tp, 1024
    x, w, b = global_inputs(seed, m, k, n, torch.bfloat16, "nt")
    x_shard_k, w_shard_k = x.chunk(tp, dim=1)[rank].contiguous(), w.chunk(tp, dim=1)[rank].contiguous()
    # Node size 1 without forcing: the group spans nodes, and the reduce-scatter keeps the reference path.
    _set_layout("1", "auto", "")
    os.environ["FLUX_LAYERS_TRANSPORT"] = "auto"
    ops.refresh_settings()
    choice = ops.plan("gemm_rs", x_shard_k, w_shard_k, group=dist.group.WORLD)
    assert choice.path == "reference" and "FLUX_LAYERS_TRANSPORT=nccl" in choice.reason, choice
    os.environ["FLUX_LAYERS_TRANSPORT"] = "nccl"
    ops.refresh_settings()
    choice = ops.plan("gemm_rs", x_shard_k, w_shard_k, group=dist.group.WORLD)
    assert choice.path == "fused" and "not yet run on GPUs" in choice.reason, choice
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
