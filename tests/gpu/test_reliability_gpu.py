"""The fused ops when a peer misbehaves: a dead peer raises instead of hanging, a rejected call leaves the ranks
in step, M = 0 is a no-op (2 GPUs, or one shared under FLUX_LAYERS_TEST_SHARED_GPU=1)."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed
from tests.gpu.gpu_support import assert_close_rel, global_inputs, needs_gpus, poison_outputs, references

pytestmark = [pytest.mark.gpu, needs_gpus(2)]

TP = min(max(torch.cuda.device_count(), 2), 8)
TIMEOUT_S = 2.0


def _ag_call(rank, tp, seed, ws, m=256, k=256, n=128):
    from flux_layers.ops import fused_ag_gemm
    x, w, _ = global_inputs(seed, m * tp, k, n * tp, torch.bfloat16, "nt")
    w_shard_n = w.chunk(tp)[rank].contiguous()
    out = fused_ag_gemm.ag_gemm(x.chunk(tp)[rank], w_shard_n, group=dist.group.WORLD, ws=ws)
    return out, *references(x, w_shard_n, None, "nt")


def _peer_death(rank, tp, seed):
    from flux_layers.runtime.workspace import AgWorkspace, WorkspaceError
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 256 * tp, 256)
    ws.timeout_s = TIMEOUT_S
    for i in range(2):
        assert_close_rel(*_ag_call(rank, tp, seed + i, ws), f"rank {rank} call {i} before the peer died")
    torch.cuda.synchronize()
    dist.barrier()
    if rank == tp - 1:
        os._exit(0)  # dies between calls: no error, no goodbye
    began = time.monotonic()
    for i in range(3):  # enqueued behind calls that wait for the dead rank: the first may or may not raise
        try:
            _ag_call(rank, tp, seed + 10 + i, ws)
        except WorkspaceError:
            break
    torch.cuda.synchronize()  # returns: the kernels' waits time out and the watchdog releases the stream waits
    elapsed = time.monotonic() - began
    assert elapsed < TIMEOUT_S + 10, f"rank {rank}: the device drained only after {elapsed:.1f} s"
    with pytest.raises(WorkspaceError, match=rf"rank {rank} timed out after .* waiting for .*rank {tp - 1}"):
        _ag_call(rank, tp, seed + 20, ws)
    os._exit(0)  # the peer is gone: no collective shutdown


def test_dead_peer_raises_instead_of_hanging():
    run_distributed(_peer_death, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl", timeout_s=180)


def _rejected_then_valid(rank, tp, seed):
    from flux_layers.ops import fused_ag_gemm, fused_gemm_rs
    from flux_layers.runtime.workspace import AgWorkspace, RsWorkspace
    poison_outputs()
    ag = AgWorkspace(dist.group.WORLD, torch.bfloat16, 512 * tp, 256)
    rs = RsWorkspace(dist.group.WORLD, torch.bfloat16, 512 * tp, 256)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    if rank == 0:  # rejected calls on one rank only: nothing may be enqueued and no epoch may advance
        with pytest.raises(ValueError, match="N = 2044 .* must be a multiple of 8"):
            fused_ag_gemm.ag_gemm(x, torch.randn(2044, 256, device="cuda", dtype=torch.bfloat16),
                                  group=dist.group.WORLD, ws=ag)
        with pytest.raises(ValueError, match="bias must be contiguous"):
            fused_gemm_rs.gemm_rs(x, torch.randn(256, 256, device="cuda", dtype=torch.bfloat16),
                                  torch.randn(512, device="cuda", dtype=torch.bfloat16)[::2],
                                  group=dist.group.WORLD, ws=rs)
    epochs = (ag.epoch, rs.epoch)
    empty = fused_ag_gemm.ag_gemm(x[:0], torch.randn(128, 256, device="cuda", dtype=torch.bfloat16),
                                  group=dist.group.WORLD, ws=ag)
    assert empty.shape == (0, 128) and (ag.epoch, rs.epoch) == epochs == (0, 0), "M = 0 must be a no-op"
    for i in range(3):  # every rank in step: valid calls are right
        assert_close_rel(*_ag_call(rank, tp, seed + i, ag), f"rank {rank} ag_gemm call {i} after rejected calls")
        xg, wg, bg = global_inputs(seed + 100 + i, 256 * tp, 128 * tp, 256, torch.bfloat16, "nt")
        y = fused_gemm_rs.gemm_rs(xg.chunk(tp, dim=1)[rank].contiguous(), wg.chunk(tp, dim=1)[rank].contiguous(),
                                  bg, group=dist.group.WORLD, ws=rs)
        ref, cublas = references(xg, wg, bg, "nt")
        assert_close_rel(y, ref.chunk(tp)[rank], cublas.chunk(tp)[rank],
                         f"rank {rank} gemm_rs call {i} after rejected calls")
    assert (ag.epoch, rs.epoch) == (3, 3)
    torch.cuda.synchronize()


def test_rejected_call_leaves_ranks_in_step():
    run_distributed(_rejected_then_valid, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")
