"""Fused AllGather+GEMM on 2 GPUs (one process each, NCCL) against an fp32 reference."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed
from tests.gpu.gpu_support import (
    ag_gemm_checked,
    assert_close_rel,
    global_inputs,
    needs_gpus,
    poison_outputs,
    references,
    split_sm_count,
)

pytestmark = [pytest.mark.gpu, needs_gpus(2)]

# Every visible GPU takes part (2 on the 2-GPU machine; 4 or 8 where lent), at least 2.
TP = min(max(torch.cuda.device_count(), 2), 8)


def _one_call(rank, tp, seed, m, k, n, dtype, layout, **kwargs):
    ag_gemm_checked(rank, tp, seed, m, k, n, dtype, layout, **kwargs,
                    what=f"ag_gemm mode={os.environ.get('FLUX_LAYERS_AG_MODE')} "
                         f"order={os.environ.get('FLUX_LAYERS_AG_ORDER')}")


def _matrix(rank, tp, seed):
    poison_outputs()
    i = 0
    for mode in ("pull", "push"):
        for order in ("mesh", "ring"):
            os.environ["FLUX_LAYERS_AG_MODE"] = mode
            os.environ["FLUX_LAYERS_AG_ORDER"] = order
            for dtype in (torch.bfloat16, torch.float16):
                for layout in ("nt", "nn"):
                    # per-rank share a multiple of the tile, and one that is not a multiple of 128
                    for (m, k, n) in ((1024 * tp, 1024, 384 * tp), (1000 * tp, 520, 136 * tp)):
                        for chunk_rows in ("0", "128"):
                            os.environ["FLUX_LAYERS_CHUNK_ROWS"] = chunk_rows
                            _one_call(rank, tp, seed + i, m, k, n, dtype, layout, tile=i % 2)
                            i += 1
    torch.cuda.synchronize()


def test_ag_gemm_modes_orders_dtypes_layouts():
    run_distributed(_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _late_and_many(rank, tp, seed):
    poison_outputs()
    os.environ["FLUX_LAYERS_AG_MODE"] = "pull"
    os.environ["FLUX_LAYERS_AG_ORDER"] = "mesh"
    os.environ["FLUX_LAYERS_CHUNK_ROWS"] = "0"
    for late in (0, 1):
        _one_call(rank, tp, seed + late, 2048 * tp, 1024, 512 * tp, torch.bfloat16, "nt", late_rank=late)
    # 200 back-to-back calls with varying M on one workspace (no re-allocation: max M fixed up front).
    from flux_layers.runtime.workspace import AgWorkspace
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 512)
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    for i in range(200):
        m = rows[i % len(rows)] * tp
        _one_call(rank, tp, seed + 100 + i, m, 512, 128 * tp, torch.bfloat16, "nt" if i % 3 else "nn",
                  with_bias=bool(i % 2), ws=ws)
    with pytest.raises(ValueError, match="max_m"):
        _one_call(rank, tp, seed, 4096 * tp, 512, 128 * tp, torch.bfloat16, "nt", ws=ws)
    # Pull with x written straight into the workspace (no staging copy), both modes on the same workspace.
    from flux_layers.ops import fused_ag_gemm
    for mode in ("pull", "push", "pull"):
        os.environ["FLUX_LAYERS_AG_MODE"] = mode
        x, w, b = global_inputs(seed + 7, 1024 * tp, 512, 128 * tp, torch.bfloat16, "nt")
        x_shard_m = ws.input_buffer(1024 * tp)
        x_shard_m.copy_(x.chunk(tp)[rank])
        w_shard_n = w.chunk(tp)[rank].contiguous()
        out = fused_ag_gemm.ag_gemm(x_shard_m, w_shard_n, group=dist.group.WORLD, ws=ws)
        assert_close_rel(out, *references(x, w_shard_n, None, "nt"), f"rank {rank} {mode} in-buffer x")
    torch.cuda.synchronize()


def _stream_k(rank, tp, seed):
    poison_outputs()
    os.environ["FLUX_LAYERS_AG_MODE"] = "push"
    os.environ["FLUX_LAYERS_AG_ORDER"] = "mesh"
    os.environ["FLUX_LAYERS_CHUNK_ROWS"] = "0"
    i = 0
    for layout in ("nt", "nn"):
        for (rows, k, n_local) in ((2048, 2048, 1024), (1000, 4096, 520)):
            sms = split_sm_count(rows, n_local, k, tp)
            _one_call(rank, tp, seed + i, rows * tp, k, n_local * tp, torch.bfloat16, layout, tile=1,
                      stream_k=True, sm_count=sms)
            i += 1
    torch.cuda.synchronize()


def test_ag_gemm_stream_k_tail():
    run_distributed(_stream_k, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def test_ag_gemm_late_rank_and_back_to_back():
    run_distributed(_late_and_many, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _timeout(rank, tp):
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.runtime.workspace import AgWorkspace, WorkspaceError
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 512 * tp, 256)
    ws.timeout_s = 0.5
    if rank == 0:  # rank 1 never enters the call
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
        fused_ag_gemm.ag_gemm(x, w, group=dist.group.WORLD, ws=ws)
        with pytest.raises(WorkspaceError, match=r"rank 0 timed out .* epoch 1"):
            ws.check(timeout_s=20)
        with pytest.raises(WorkspaceError):
            fused_ag_gemm.ag_gemm(x, w, group=dist.group.WORLD, ws=ws)
    torch.cuda.synchronize()


def test_ag_gemm_timeout_raises_instead_of_hanging():
    run_distributed(_timeout, TP, backend="nccl", timeout_s=120)


def _bad_args(rank, tp):
    from flux_layers.ops import fused_ag_gemm
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        fused_ag_gemm.ag_gemm(x.float(), w.float(), group=dist.group.WORLD)
    with pytest.raises(ValueError, match="disagree on K"):
        fused_ag_gemm.ag_gemm(x, w[:, :256], group=dist.group.WORLD)
    with pytest.raises(ValueError, match="CUDA"):
        fused_ag_gemm.ag_gemm(x.cpu(), w.cpu(), group=dist.group.WORLD)


def test_ag_gemm_bad_arguments():
    run_distributed(_bad_args, TP, backend="nccl")
