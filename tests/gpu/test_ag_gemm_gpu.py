"""Fused AllGather+GEMM on TP GPUs (one process each, NCCL), or TP ranks sharing one GPU
(FLUX_LAYERS_TEST_SHARED_GPU=1, FLUX_LAYERS_TEST_TP), against an fp32 reference. Each call's plan (direction, order,
rows per chunk) is checked to be the variant asked for."""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, tp_under_test
from tests.gpu.gpu_support import (
    ag_gemm_checked,
    assert_close_rel,
    at_tp2_when_lean,
    global_inputs,
    lean,
    needs_gpus,
    poison_outputs,
    references,
    rows_per_rank,
    split_sm_count,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP)]
DTYPES = (torch.bfloat16, torch.float16)
LAYOUTS = ("nt", "nn")


def _check_plan(rank, tp, m, k, n, dtype, tile, chunk_rows: int) -> None:
    """The call just made on the cached workspace registered the plan of the settings: FLUX_LAYERS_AG_MODE's
    direction, FLUX_LAYERS_AG_ORDER's order, and ``chunk_rows`` rows per chunk (0: the heuristic's)."""
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.runtime import schedules, workspace
    ws = workspace.get_ag_workspace(dist.group.WORLD, dtype, m, k)
    plan = fused_ag_gemm.plan_call(ws, m=m, k=k, n=n // tp, tile=tile)
    rows = m // tp
    rows_per_chunk = chunk_rows or schedules.default_rows_per_chunk(rows, k * dtype.itemsize, tp)
    want = (os.environ["FLUX_LAYERS_AG_MODE"], os.environ["FLUX_LAYERS_AG_ORDER"], rows_per_chunk)
    assert (plan.mode, plan.order, plan.rows_per_chunk) == want, f"rank {rank}: plan {plan}, asked for {want}"
    assert plan in ws._plans, f"rank {rank}: the call did not run {plan}"
    if chunk_rows:
        assert schedules.chunk_count(rows, plan.rows_per_chunk) > 1, f"rank {rank}: {rows} rows in one chunk"


def _one_call(rank, tp, seed, m, k, n, dtype, layout, **kwargs):
    ag_gemm_checked(rank, tp, seed, m, k, n, dtype, layout, **kwargs,
                    what=f"ag_gemm mode={os.environ.get('FLUX_LAYERS_AG_MODE')} "
                         f"order={os.environ.get('FLUX_LAYERS_AG_ORDER')}")


def _matrix_cases(tp):
    """(mode, order, chunk rows, dtype, weight layout, (M, K, N), tile): every combination, or where lean every
    transfer variant (direction x order x chunking) once, the other axes varied across them (each value meets both
    directions, both orders and both chunkings)."""
    # per-rank share a multiple of the tile, and one that is not a multiple of 128
    shapes = ((1024 * tp, 1024, 384 * tp), (1000 * tp, 520, 136 * tp))
    variants = list(itertools.product(("pull", "push"), ("mesh", "ring"), (0, 128)))
    if not lean():
        return [(*v, dtype, layout, shape, i % 2) for i, (v, dtype, layout, shape) in
                enumerate(itertools.product(variants, DTYPES, LAYOUTS, shapes))]
    cases = []
    for i, v in enumerate(variants):
        mode_bit, order_bit, chunk_bit = i >> 2, (i >> 1) & 1, i & 1
        cases.append((*v, DTYPES[chunk_bit ^ order_bit], LAYOUTS[order_bit ^ mode_bit],
                      shapes[chunk_bit ^ mode_bit], mode_bit ^ order_bit ^ chunk_bit))
    return cases


def _matrix(rank, tp, seed):
    poison_outputs()
    for i, (mode, order, chunk_rows, dtype, layout, (m, k, n), tile) in enumerate(_matrix_cases(tp)):
        os.environ.update(FLUX_LAYERS_AG_MODE=mode, FLUX_LAYERS_AG_ORDER=order, FLUX_LAYERS_CHUNK_ROWS=str(chunk_rows))
        _one_call(rank, tp, seed + i, m, k, n, dtype, layout, tile=tile)
        _check_plan(rank, tp, m, k, n, dtype, tile, chunk_rows)
    torch.cuda.synchronize()


def test_ag_gemm_modes_orders_dtypes_layouts():
    run_distributed(_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _late_and_many(rank, tp, seed):
    poison_outputs()
    os.environ["FLUX_LAYERS_AG_MODE"] = "pull"
    os.environ["FLUX_LAYERS_AG_ORDER"] = "mesh"
    os.environ["FLUX_LAYERS_CHUNK_ROWS"] = "0"
    late_rows = rows_per_rank(2048, tp)
    for late in (0, 1):
        _one_call(rank, tp, seed + late, late_rows * tp, 1024, 512 * tp, torch.bfloat16, "nt", late_rank=late)
    # Back-to-back calls with varying M on one workspace (no re-allocation: max M fixed up front): 200, or where
    # lean 40 (each rank's calls then wait for TP time-sliced processes).
    from flux_layers.runtime.workspace import AgWorkspace
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 512)
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    for i in range(40 if lean() else 200):
        m = rows[i % len(rows)] * tp
        _one_call(rank, tp, seed + 100 + i, m, 512, 128 * tp, torch.bfloat16, "nt" if i % 3 else "nn",
                  with_bias=bool(i % 2), ws=ws)
    from flux_layers.ops import fused_ag_gemm
    with pytest.raises(ValueError, match="max_m"):  # rejected before anything runs
        fused_ag_gemm.ag_gemm(torch.empty(4096, 512, device="cuda", dtype=torch.bfloat16),
                              torch.empty(128, 512, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD, ws=ws)
    # Pull with x written straight into the workspace (no staging copy), both modes on the same workspace.
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
        for (rows, k, n_local) in ((rows_per_rank(2048, tp), 2048, 1024), (rows_per_rank(1000, tp), 4096, 520)):
            sms = split_sm_count(rows, n_local, k, tp)
            _one_call(rank, tp, seed + i, rows * tp, k, n_local * tp, torch.bfloat16, layout, tile=1,
                      stream_k=True, sm_count=sms)
            i += 1
    torch.cuda.synchronize()


def test_ag_gemm_stream_k_tail():
    run_distributed(_stream_k, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def test_ag_gemm_late_rank_and_back_to_back():
    run_distributed(_late_and_many, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _x_overwritten(rank, tp, seed):
    """x is the caller's again once the call is enqueued: overwriting it at once on the stream leaves every rank's
    output and gathered input right (push: the GEMM's last CTA waits for the transfers that read x; pull: the comm
    streams are joined). Shards of 16 MiB with a narrow GEMM, so that a transfer not waited for would still run."""
    from flux_layers.ops import fused_ag_gemm
    poison_outputs()
    rows, k, n_local = 2048, 4096, 128
    for i, (mode, gathered) in enumerate(itertools.product(("push", "pull"), (False, True))):
        x, w, _ = global_inputs(seed + i, rows * tp, k, n_local * tp, torch.bfloat16, "nt")
        x_shard_m = x.chunk(tp)[rank].clone()  # not a view of x, the reference's input
        w_shard_n = w.chunk(tp)[rank].contiguous()
        result = fused_ag_gemm.ag_gemm(x_shard_m, w_shard_n, group=dist.group.WORLD, mode=mode,
                                       order="mesh", chunk_rows=0, return_gathered=gathered)
        x_shard_m.fill_(float("nan"))
        out = result[0] if gathered else result
        assert_close_rel(out, *references(x, w_shard_n, None, "nt"), f"rank {rank} {mode} x overwritten")
        if gathered:
            assert torch.equal(result[1], x), f"rank {rank} {mode}: gathered input differs from x"
    torch.cuda.synchronize()


def test_ag_gemm_x_overwritten_after_the_call():
    run_distributed(_x_overwritten, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


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


@at_tp2_when_lean("one rank calls alone")
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


@at_tp2_when_lean("the arguments' checks")
def test_ag_gemm_bad_arguments():
    run_distributed(_bad_args, TP, backend="nccl")
