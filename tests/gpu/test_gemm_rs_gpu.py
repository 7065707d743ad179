"""Fused GEMM+ReduceScatter on 2 GPUs (one process each, NCCL) against an fp32 reference."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, shared_gpu
from flux_layers.runtime.tuning import RS_TRANSPORTS as TRANSPORTS
from tests.gpu.gpu_support import (
    assert_close_rel,
    gemm_rs_checked,
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
    return gemm_rs_checked(rank, tp, seed, m, k, n, dtype, layout, what="gemm_rs", **kwargs)


def _matrix(rank, tp, seed):
    poison_outputs()
    i = 0
    for dtype in (torch.bfloat16, torch.float16):
        for layout in ("nt", "nn"):
            for (m, k, n) in ((1024 * tp, 512 * tp, 768), (1000 * tp, 264 * tp, 264), (2048 * tp, 1024 * tp, 2048)):
                for tile in (0, 1):
                    for transport in TRANSPORTS:
                        # copy-engine chunks of 1, 2 or 4 tiles' columns (0: the default width)
                        _one_call(rank, tp, seed + i, m, k, n, dtype, layout, with_bias=bool(i % 2), tile=tile,
                                  transport=transport, chunk_cols=(0, 256, 512)[i % 3])
                        i += 1
    torch.cuda.synchronize()


def test_gemm_rs_dtypes_layouts_shapes():
    run_distributed(_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _late_many_deterministic(rank, tp, seed):
    poison_outputs()
    for transport in TRANSPORTS:
        for late in (0, 1):
            _one_call(rank, tp, seed + late, 2048 * tp, 1024 * tp, 1024, torch.bfloat16, "nt", late_rank=late,
                      transport=transport)
        first = _one_call(rank, tp, seed + 5, 2048 * tp, 2048 * tp, 2048, torch.bfloat16, "nt", transport=transport)
        again = _one_call(rank, tp, seed + 5, 2048 * tp, 2048 * tp, 2048, torch.bfloat16, "nt", transport=transport)
        assert torch.equal(first, again), f"rank {rank}: two {transport} runs on the same inputs differ bitwise"
    from flux_layers.runtime.workspace import RsWorkspace
    ws = RsWorkspace(dist.group.WORLD, torch.bfloat16, 2048 * tp, 256)
    rows = [2048, 1000, 128, 2048, 64, 1536, 8, 1024]
    for i in range(200):  # the two transports alternate in pairs on one workspace
        m = rows[i % len(rows)] * tp
        _one_call(rank, tp, seed + 100 + i, m, 256 * tp, 256, torch.bfloat16, "nt" if i % 3 else "nn",
                  with_bias=bool(i % 2), ws=ws, transport=TRANSPORTS[(i // 2) % 2])
    with pytest.raises(ValueError, match="max_m"):
        _one_call(rank, tp, seed, 4096 * tp, 256 * tp, 256, torch.bfloat16, "nt", ws=ws)
    torch.cuda.synchronize()


def _stream_k(rank, tp, seed):
    poison_outputs()
    i = 0
    for layout in ("nt", "nn"):
        # (M / tp, K / tp, N); the SM limit makes the split items (the last wave) all lie in this rank's own rows
        for (rows, k_local, n) in ((2048, 2048, 1024), (1000, 4096, 520)):
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
