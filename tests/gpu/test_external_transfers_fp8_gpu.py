"""FP8 operands over the host-driven transports: the fused AllGather+GEMM on the NCCL and hybrid transports, the
GEMM+ReduceScatter on the NCCL one (FLUX_LAYERS_TRANSPORT), through ``ops`` as a user calls them, against an fp32
matmul of the dequantized operands beside the reference backend's error on the same operands, outputs poisoned with
NaN. TP GPUs with a process each and NCCL, or TP ranks sharing one GPU (FLUX_LAYERS_TEST_SHARED_GPU=1,
FLUX_LAYERS_TEST_TP) whose send/recv the host-staged stand-in runs (flux_layers/runtime/multinode/sendrecv.py).

Nodes (FLUX_LAYERS_TEST_NODES): 0, the default, every rank its own node; N >= 2, N emulated nodes of TP / N ranks
(FLUX_LAYERS_NODE_SIZE; the hybrid transport's pushes run inside them).

AllGather+GEMM: both transports, both scale modes (each rank's shard with its own scale, or one per row), M/tp a
multiple of the tile and not, one chunk per shard and several; the decision taken (fused, the transport, external
transfers); gathered FP8 rows and scales exact; back-to-back calls with their own scales and the shard rows changing
(each call's scales in the half of its epoch's parity). GEMM+ReduceScatter over NCCL: both scale modes, split and
fast accumulation, bitwise equal across runs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, tp_under_test
from tests.gpu.external_transfers import node_size_under_test
from tests.gpu.gpu_support import (
    apply_settings,
    check_fp8_all_gather,
    check_fp8_output,
    fp8_global_inputs,
    fp8_w_scale,
    needs_gpus,
    poison_outputs,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP)]
E4M3 = torch.float8_e4m3fn


def _node_size(tp: int) -> int:
    return node_size_under_test(tp, tp)


def _ag_call(rank, tp, seed, rows, k, n, mode, transport, shards_scale=1.0):
    """One FP8 all-gather through ops.ag_gemm on fresh inputs: (out, gathered, the shards, the weight, bias)."""
    from flux_layers import ops
    from flux_layers.ops.fp8 import ScaledTensor, quantize
    x, w, bias = fp8_global_inputs(seed, rows * tp, k, n * tp)
    shards = [quantize(s, E4M3, rowwise=mode == "row") for s in x.chunk(tp)]
    shards = [ScaledTensor(s.data, s.scale * shards_scale) for s in shards]
    wq = quantize(w.chunk(tp)[rank].contiguous(), E4M3, rowwise=mode == "row")
    b = bias[rank * n:(rank + 1) * n]
    mine = shards[rank]
    out, gathered = ops.ag_gemm(mine.data, wq.data, b, group=dist.group.WORLD, return_gathered=True,
                                x_scale=mine.scale, w_scale=fp8_w_scale(wq, mode), backend="fused")
    decision = ops.decide("ag_gemm", mine.data, wq.data, group=dist.group.WORLD, backend="fused")
    what = f"rank {rank} {transport} ag fp8 {rows * tp}x{k}x{n} {mode}"
    assert decision.path == "fused" and decision.transport == transport and decision.plan.mode == "external", \
        f"{what}: ran {decision}"
    return out, gathered, shards, wq, b, what


def _ag_matrix(rank, tp, seed):
    poison_outputs()
    i = 0
    for transport in ("nccl", "hybrid"):
        for chunk_rows in ("0", "128"):
            apply_settings(TRANSPORT=transport, NODE_SIZE=str(_node_size(tp)), AG_ORDER="auto", CHUNK_ROWS=chunk_rows)
            for mode in ("tensor", "row"):
                for rows, k, n in ((512, 1024, 256), (500, 528, 272)):
                    out, gathered, shards, wq, b, what = _ag_call(rank, tp, seed + i, rows, k, n, mode, transport)
                    check_fp8_all_gather(rank, out, gathered, shards, wq, b, fp8_w_scale(wq, mode),
                                         f"{what} chunk_rows={chunk_rows}")
                    i += 1
    torch.cuda.synchronize()


def test_fp8_ag_gemm_over_nccl_and_hybrid():
    run_distributed(_ag_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _ag_back_to_back(rank, tp, seed):
    """Calls enqueued back to back, the shard rows changing and each call's scales doubled, checked once all are
    done: a call given another call's scales (the wrong half of the scale region, or one still being read) shows."""
    poison_outputs()
    for i, (transport, mode) in enumerate((("nccl", "tensor"), ("hybrid", "row"))):
        apply_settings(TRANSPORT=transport, NODE_SIZE=str(_node_size(tp)), AG_ORDER="auto", CHUNK_ROWS="0")
        calls = [_ag_call(rank, tp, seed + 10 * i + j, rows, 512, 256, mode, transport, 2.0**j)
                 for j, rows in enumerate((512, 256, 384, 512))]
        torch.cuda.synchronize()
        for j, call in enumerate(calls):
            out, gathered, shards, wq, b, what = call
            check_fp8_all_gather(rank, out, gathered, shards, wq, b, fp8_w_scale(wq, mode),
                                 f"{what} call {j} of 4 back to back")
    torch.cuda.synchronize()


def test_fp8_ag_gemm_back_to_back_over_nccl_and_hybrid():
    run_distributed(_ag_back_to_back, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _rs_matrix(rank, tp, seed):
    from flux_layers import ops
    from flux_layers.ops.fp8 import dequantize, quantize
    poison_outputs()
    apply_settings(TRANSPORT="nccl", NODE_SIZE=str(_node_size(tp)), AG_ORDER="auto", CHUNK_ROWS="0")
    group, i = dist.group.WORLD, 0
    for mode in ("tensor", "row"):
        for accum in ("split", "fast"):
            for m, k_local, n in ((1024, 512, 512), (1000, 272, 528)):
                x, w, bias = fp8_global_inputs(seed + i, m, k_local * tp, n)
                i += 1
                xq = quantize(x.chunk(tp, dim=1)[rank].contiguous(), E4M3, rowwise=mode == "row")
                wq = quantize(w.chunk(tp, dim=1)[rank].contiguous(), E4M3, rowwise=mode == "row")
                args = dict(group=group, x_scale=xq.scale, w_scale=fp8_w_scale(wq, mode), fast_accum=accum == "fast")
                out = ops.gemm_rs(xq.data, wq.data, bias, backend="fused", **args)
                again = ops.gemm_rs(xq.data, wq.data, bias, backend="fused", **args)
                what = f"rank {rank} nccl rs fp8 {m}x{k_local}x{n} {mode} {accum}"
                decision = ops.decide("gemm_rs", xq.data, wq.data, group=group, backend="fused",
                                      fast_accum=accum == "fast")
                assert decision.path == "fused" and decision.transport == "nccl", f"{what}: ran {decision}"
                assert decision.plan.accumulation == accum, f"{what}: ran {decision.plan}"
                assert torch.equal(out, again), f"{what}: two runs differ bitwise"
                reference = ops.gemm_rs(xq.data, wq.data, bias, backend="reference", **args)
                partial = dequantize(xq) @ dequantize(wq).t()
                dist.all_reduce(partial, group=group)
                check_fp8_output(out, partial.chunk(tp)[rank] + bias.float(), reference, what)
    torch.cuda.synchronize()


def test_fp8_gemm_rs_over_nccl():
    run_distributed(_rs_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")
