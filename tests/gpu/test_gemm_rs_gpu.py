"""Fused GEMM+ReduceScatter on TP GPUs (one process each, NCCL), or TP ranks sharing one GPU
(FLUX_LAYERS_TEST_SHARED_GPU=1, FLUX_LAYERS_TEST_TP), against an fp32 reference; each call's plan (the store,
the copy engine's chunk columns) is checked to be the variant asked for. At TP > 2 every tile of this rank's rows adds
tp - 1 partials (the own-row loads' second partial replacing the first in the sub-tile buffer)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, shared_gpu, tp_under_test
from flux_layers.runtime.tuning import RS_TRANSPORTS as TRANSPORTS
from tests.gpu.gpu_support import (
    assert_close_rel,
    at_tp2_when_lean,
    gemm_rs_checked,
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
# N of the larger shapes: where the ranks share one GPU, within its budget (gpu_support.check_shared_budget)
N_LARGE = 1024 if shared_gpu() else 2048


def _one_call(rank, tp, seed, m, k, n, dtype, layout, **kwargs):
    return gemm_rs_checked(rank, tp, seed, m, k, n, dtype, layout, what="gemm_rs", **kwargs)


def _check_plan(rank, tp, m, k, n, dtype, tile, transport, chunk_cols) -> None:
    """The call just made on the cached workspace registered the plan asked for: ``transport``'s store and
    ``chunk_cols`` copy-engine columns."""
    from flux_layers.ops import fused_gemm_rs
    from flux_layers.runtime import workspace
    ws = workspace.get_rs_workspace(dist.group.WORLD, dtype, m, n)
    plan = fused_gemm_rs.plan_call(ws, m=m, k=k // tp, n=n, tile=tile, transport=transport, chunk_cols=chunk_cols)
    assert (plan.transport, plan.chunk_cols) == (transport, chunk_cols), f"rank {rank}: plan {plan}"
    assert plan in ws._plans, f"rank {rank}: the call did not run {plan}"


def _matrix_cases(tp):
    """(transport, chunk columns, dtype, weight layout, (M, K, N), tile, bias): every combination (chunk columns
    varied along), or where lean each store with both tiles and the copy engine with 1, 2 and 4 tiles' columns (0:
    the default width), the other axes varied across them."""
    # M/tp a multiple of the tile, one that is not a multiple of 128, and several chunks per peer
    shapes = ((rows_per_rank(1024, tp) * tp, 512 * tp, 768), (rows_per_rank(1000, tp) * tp, 264 * tp, 264),
              (rows_per_rank(2048, tp) * tp, 1024 * tp, N_LARGE))
    if not lean():
        return [(transport, (0, 256, 512)[i % 3], dtype, layout, shape, tile, bool(i % 2)) for i, (
            dtype, layout, shape, tile, transport) in enumerate(itertools.product(DTYPES, LAYOUTS, shapes, (0, 1),
                                                                                   TRANSPORTS))]
    variants = [("epilogue", 0, 0), ("epilogue", 0, 1), ("copy_engine", 0, 1), ("copy_engine", 256, 0),
                ("copy_engine", 512, 1)]
    return [(transport, cols, DTYPES[i % 2], LAYOUTS[(i // 2) % 2], shapes[i % 3], tile, bool(i % 2))
            for i, (transport, cols, tile) in enumerate(variants)]


def _matrix(rank, tp, seed):
    poison_outputs()
    for i, (transport, cols, dtype, layout, (m, k, n), tile, bias) in enumerate(_matrix_cases(tp)):
        _one_call(rank, tp, seed + i, m, k, n, dtype, layout, with_bias=bias, tile=tile, transport=transport,
                  chunk_cols=cols)
        _check_plan(rank, tp, m, k, n, dtype, tile, transport, cols)
    torch.cuda.synchronize()


def test_gemm_rs_dtypes_layouts_shapes():
    run_distributed(_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _late_many_deterministic(rank, tp, seed):
    poison_outputs()
    m = rows_per_rank(2048, tp) * tp
    for transport in TRANSPORTS:
        for late in (0, 1):
            _one_call(rank, tp, seed + late, m, 1024 * tp, 1024, torch.bfloat16, "nt", late_rank=late,
                      transport=transport)
        first = _one_call(rank, tp, seed + 5, m, 2048 * tp, N_LARGE, torch.bfloat16, "nt", transport=transport)
        again = _one_call(rank, tp, seed + 5, m, 2048 * tp, N_LARGE, torch.bfloat16, "nt", transport=transport)
        assert torch.equal(first, again), f"rank {rank}: two {transport} runs on the same inputs differ bitwise"
    from flux_layers.runtime.workspace import RsWorkspace
    ws = RsWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 256)
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    for i in range(40 if lean() else 200):  # the two transports alternate in pairs on one workspace
        m = rows[i % len(rows)] * tp
        _one_call(rank, tp, seed + 100 + i, m, 256 * tp, 256, torch.bfloat16, "nt" if i % 3 else "nn",
                  with_bias=bool(i % 2), ws=ws, transport=TRANSPORTS[(i // 2) % 2])
    from flux_layers.ops import fused_gemm_rs
    with pytest.raises(ValueError, match="max_m"):  # rejected before anything runs
        fused_gemm_rs.gemm_rs(torch.empty(4096 * tp, 256, device="cuda", dtype=torch.bfloat16),
                              torch.empty(256, 256, device="cuda", dtype=torch.bfloat16), group=dist.group.WORLD, ws=ws)
    torch.cuda.synchronize()


def _stream_k(rank, tp, seed):
    poison_outputs()
    i = 0
    for layout in ("nt", "nn"):
        # (M / tp, K / tp, N); the SM limit makes the split items (the last wave) all lie in this rank's own rows
        for (rows, k_local, n) in ((rows_per_rank(2048, tp), 2048, 1024), (rows_per_rank(1000, tp), 4096, 520)):
            sms = split_sm_count(rows, n, k_local, tp, reduce_scatter=True)
            transport = TRANSPORTS[i % 2]
            first = _one_call(rank, tp, seed + i, rows * tp, k_local * tp, n, torch.bfloat16, layout, tile=1,
                              stream_k=True, sm_count=sms, transport=transport)
            again = _one_call(rank, tp, seed + i, rows * tp, k_local * tp, n, torch.bfloat16, layout, tile=1,
                              stream_k=True, sm_count=sms, transport=transport)
            assert torch.equal(first, again), f"rank {rank}: stream-K gemm_rs differs bitwise between runs"
            i += 1
    torch.cuda.synchronize()


def test_gemm_rs_stream_k_tail():
    run_distributed(_stream_k, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def test_gemm_rs_late_rank_back_to_back_and_bitwise_repeatable():
    run_distributed(_late_many_deterministic, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _timeout(rank, tp, transport):
    from flux_layers.ops import fused_gemm_rs
    from flux_layers.runtime.workspace import RsWorkspace, WorkspaceError
    ws = RsWorkspace(dist.group.WORLD, torch.bfloat16, 256 * tp, 256)
    ws.timeout_s = 0.5
    if rank == 0:
        x = torch.randn(256 * tp, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        fused_gemm_rs.gemm_rs(x, w, group=dist.group.WORLD, ws=ws, transport=transport)
        with pytest.raises(WorkspaceError, match=r"rank 0 timed out .* epoch 1"):
            ws.check(timeout_s=20)
    torch.cuda.synchronize()


@at_tp2_when_lean("one rank calls alone")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gemm_rs_timeout_raises_instead_of_hanging(transport):
    run_distributed(_timeout, TP, transport, backend="nccl", timeout_s=120)


def _repeatable_at_layer_shapes(rank, tp, seed):
    # A race between a tile's data and its flag (or a partial's load and its use) shows as sporadic differences
    # between calls on the same inputs; the layer-sized shapes give many tiles per CTA and long copy-engine queues,
    # and an AllGather call between the calls keeps other fused traffic in flight.
    from flux_layers.ops import fused_ag_gemm, fused_gemm_rs
    poison_outputs()
    gen = torch.Generator(device="cuda").manual_seed(seed + 7)
    x_other_shard_m = torch.randn(4096, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    w_other = torch.randn(4096, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    for i, (m, k, n) in enumerate(((8192, 4096 * tp, 8192), (16384, 2048 * tp, 4096))):
        for transport in TRANSPORTS:
            x, w, b = global_inputs(seed + i, m, k, n, torch.bfloat16, "nt")
            x_shard_k = x.chunk(tp, dim=1)[rank].contiguous()
            w_shard_k = w.chunk(tp, dim=1)[rank].contiguous()
            outs = []
            for _ in range(12):
                outs.append(fused_gemm_rs.gemm_rs(x_shard_k, w_shard_k, b, group=dist.group.WORLD, transport=transport))
                fused_ag_gemm.ag_gemm(x_other_shard_m, w_other, group=dist.group.WORLD)
            full, cublas = references(x, w, b, "nt")
            assert_close_rel(outs[0], full.chunk(tp)[rank], cublas.chunk(tp)[rank],
                             f"rank {rank} gemm_rs M={m} K={k} N={n}")
            differing = [j for j, out in enumerate(outs) if not torch.equal(out, outs[0])]
            assert not differing, f"rank {rank} {transport} M={m} K={k} N={n}: calls {differing} differ from the first"
    torch.cuda.synchronize()


@pytest.mark.skipif(shared_gpu(), reason="12 calls in flight per rank: processes sharing one GPU can hold it "
                    "spinning on a peer that cannot run until the timeout")
def test_gemm_rs_repeatable_at_layer_shapes():
    run_distributed(_repeatable_at_layer_shapes, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")
