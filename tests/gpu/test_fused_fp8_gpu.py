"""Fused AllGather+GEMM and GEMM+ReduceScatter with FP8 operands (TP GPUs, or TP ranks sharing one with
FLUX_LAYERS_TEST_SHARED_GPU=1 and FLUX_LAYERS_TEST_TP) against an fp32 matmul of the dequantized operands, beside the
reference backend's error on the same operands: every scale mode, both directions and orders, both reduce-scatter
stores, split and fast accumulation; gathered FP8 rows and scales exact; back-to-back all-gathers with their own
scales; reduce-scatter bitwise-repeatable; CUDA-graph replays; bad inputs refused with later calls right. The variant
asked for is checked to be the one that ran (ops.decide). Lean runs (ranks sharing one GPU at TP > 2) keep every
transfer variant with each scale mode and spread the other axes over them."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, tp_under_test
from tests.gpu.gpu_support import (
    apply_settings,
    check_fp8_all_gather,
    check_fp8_output,
    fp8_global_inputs,
    fp8_w_scale,
    lean,
    needs_gpus,
    poison_outputs,
    rows_per_rank,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP)]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _ag_case(rank, tp, seed, rows, k, n, pair, mode, accum, direction, order):
    from flux_layers import ops
    from flux_layers.ops.fp8 import quantize
    group = dist.group.WORLD
    x, w, bias = fp8_global_inputs(seed, rows * tp, k, n * tp)
    # Each rank casts its own shard with its own scale (no collective before the cast).
    shards = [quantize(s, pair[0], rowwise=mode == "row") for s in x.chunk(tp)]
    wq = quantize(w.chunk(tp)[rank].contiguous(), pair[1], rowwise=mode == "row")
    mine, ws_ = shards[rank], fp8_w_scale(wq, mode)
    fast = accum == "fast"
    out, gathered = ops.ag_gemm(mine.data, wq.data, bias[rank * n:(rank + 1) * n], group=group, return_gathered=True,
                                x_scale=mine.scale, w_scale=ws_, fast_accum=fast, backend="fused")
    what = f"rank {rank} ag fp8 {rows}x{k}x{n} {pair} {mode} {accum} {direction} {order}"
    decision = ops.decide("ag_gemm", mine.data, wq.data, group=group, backend="fused", fast_accum=fast)
    assert decision.path == "fused" and decision.plan.mode == direction and decision.plan.order == order, \
        f"{what}: ran {decision}"
    assert decision.plan.accumulation == accum, f"{what}: ran {decision.plan}"
    check_fp8_all_gather(rank, out, gathered, shards, wq, bias[rank * n:(rank + 1) * n], ws_, what, fast)


def _ag_cases(tp):
    """(direction, order, pair, scale mode, accumulation, (shard rows, K, N)): every combination, or where lean each
    transfer variant with each scale mode, the pair, accumulation and shape varied across them (each value meets both
    directions, both orders and both scale modes). Shard rows a multiple of 128 and one that is not, each rank's GEMM
    of the TP = 2 size where the ranks share one GPU."""
    shapes = ((rows_per_rank(512, tp), 1024, 512), (rows_per_rank(500, tp), 528, 272))
    pairs = ((E4M3, E4M3), (E5M2, E4M3))
    variants = (("push", "mesh"), ("pull", "mesh"), ("push", "ring"), ("pull", "ring"))
    if not lean():
        return list(itertools.product(variants, pairs, ("tensor", "row"), ("split", "fast"), shapes))
    return [((direction, order), pairs[(i + m) % 2], mode, ("split", "fast")[(i >> 1) ^ m], shapes[(i & 1) ^ m])
            for i, (direction, order) in enumerate(variants) for m, mode in enumerate(("tensor", "row"))]


def _ag_matrix(rank, tp, seed):
    poison_outputs()
    for i, ((direction, order), pair, mode, accum, (rows, k, n)) in enumerate(_ag_cases(tp)):
        apply_settings(AG_MODE=direction, AG_ORDER=order)
        _ag_case(rank, tp, seed + i, rows, k, n, pair, mode, accum, direction, order)
    torch.cuda.synchronize()


def test_ag_gemm_fp8_modes_orders_scales():
    run_distributed(_ag_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _back_to_back_scales(rank, tp, seed):
    """Calls enqueued back to back, each with its own x scales (the same FP8 rows, the scales doubled from one call
    to the next) and the shard rows changing between them, checked once all are done. Each rank's region of the
    gathered scales has two halves, the call's epoch parity picking one (csrc/runtime/ag_gemm.cpp); the eager push
    mesh's GEMM stores its scales into the peers' at its start: a half that a call still running reads, or the wrong
    half, gives a call another call's scales."""
    from flux_layers import ops
    from flux_layers.ops.fp8 import ScaledTensor, quantize
    poison_outputs()
    group = dist.group.WORLD
    shard_rows, k, n = (512, 256, 512, 384, 512, 256), 512, 256  # the first call the largest: one workspace
    if lean():  # each rank's GEMMs of the TP = 2 size, and four calls in flight (two of each epoch parity)
        shard_rows = tuple(rows_per_rank(rows, tp) for rows in shard_rows[:4])
    for i, (direction, mode) in enumerate((("push", "tensor"), ("push", "row"), ("pull", "tensor"), ("pull", "row"))):
        apply_settings(AG_MODE=direction, AG_ORDER="mesh")
        x, w, bias = fp8_global_inputs(seed + i, max(shard_rows) * tp, k, n * tp)
        wq = quantize(w.chunk(tp)[rank].contiguous(), E4M3, rowwise=mode == "row")
        ws_, b = fp8_w_scale(wq, mode), bias[rank * n:(rank + 1) * n]
        calls = []
        for j, rows in enumerate(shard_rows):
            shards = [quantize(s, E4M3, rowwise=mode == "row") for s in x[:rows * tp].chunk(tp)]
            shards = [ScaledTensor(s.data, s.scale * 2.0**j) for s in shards]
            out = ops.ag_gemm(shards[rank].data, wq.data, b, group=group, x_scale=shards[rank].scale, w_scale=ws_,
                              backend="fused")
            calls.append((shards, out))
        torch.cuda.synchronize()
        for j, (shards, out) in enumerate(calls):
            what = f"rank {rank} ag fp8 back to back, call {j} ({shard_rows[j]} rows) {mode} {direction}"
            decision = ops.decide("ag_gemm", shards[rank].data, wq.data, group=group, backend="fused")
            assert decision.path == "fused" and decision.plan.mode == direction, f"{what}: ran {decision}"
            check_fp8_all_gather(rank, out, None, shards, wq, b, ws_, what)
    torch.cuda.synchronize()


def test_ag_gemm_fp8_back_to_back_scales():
    run_distributed(_back_to_back_scales, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _rs_case(rank, tp, seed, m, k_local, n, mode, accum, transport):
    from flux_layers import ops
    from flux_layers.ops.fp8 import dequantize, quantize
    group = dist.group.WORLD
    x, w, bias = fp8_global_inputs(seed, m, k_local * tp, n)
    xq = quantize(x.chunk(tp, dim=1)[rank].contiguous(), E4M3, rowwise=mode == "row")
    wq = quantize(w.chunk(tp, dim=1)[rank].contiguous(), E4M3, rowwise=mode == "row")
    fast = accum == "fast"
    args = dict(group=group, x_scale=xq.scale, w_scale=fp8_w_scale(wq, mode), fast_accum=fast)
    out = ops.gemm_rs(xq.data, wq.data, bias, backend="fused", **args)
    again = ops.gemm_rs(xq.data, wq.data, bias, backend="fused", **args)
    what = f"rank {rank} rs fp8 {m}x{k_local}x{n} {mode} {accum} {transport}"
    decision = ops.decide("gemm_rs", xq.data, wq.data, group=group, backend="fused", fast_accum=fast)
    assert decision.path == "fused" and decision.transport == transport, f"{what}: ran {decision}"
    assert torch.equal(out, again), f"{what}: two runs differ bitwise"
    reference = ops.gemm_rs(xq.data, wq.data, bias, backend="reference", **args)
    partial = dequantize(xq) @ dequantize(wq).t()
    dist.all_reduce(partial, group=group)
    ref = partial.chunk(tp)[rank] + bias.float()
    check_fp8_output(out, ref, reference, what)


def _rs_cases():
    """(store, scale mode, accumulation, (M at TP = 2, K per rank, N)): every combination, or where lean each store
    with each scale mode, the accumulation and shape varied across them."""
    shapes = ((1024, 512, 512), (1000, 272, 528))
    if not lean():
        return list(itertools.product(("epilogue", "copy_engine"), ("tensor", "row"), ("split", "fast"), shapes))
    return [(transport, mode, ("split", "fast")[t ^ m], shapes[m]) for t, transport in
            enumerate(("epilogue", "copy_engine")) for m, mode in enumerate(("tensor", "row"))]


def _rs_matrix(rank, tp, seed):
    poison_outputs()
    for i, (transport, mode, accum, (m, k_local, n)) in enumerate(_rs_cases()):
        apply_settings(RS_TRANSPORT=transport)
        # each rank's GEMM [M, N] (the output rows it reduces: M / tp) of the TP = 2 size where the ranks share a GPU
        _rs_case(rank, tp, seed + i, rows_per_rank(m // 2, tp) * tp, k_local, n, mode, accum, transport)
    torch.cuda.synchronize()


def test_gemm_rs_fp8_transports_scales():
    run_distributed(_rs_matrix, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")


def _graphs_and_bad_inputs(rank, tp, seed):
    from flux_layers import ops
    from flux_layers.ops.fp8 import quantize
    from flux_layers.runtime import workspace
    poison_outputs()
    workspace.enable_cuda_graphs()  # before the warm-up that makes the workspaces (and their twins)
    group = dist.group.WORLD
    x, w, bias = fp8_global_inputs(seed, rows_per_rank(512, tp) * tp, 512, 512 * tp)
    xq = quantize(x.chunk(tp)[rank].contiguous())
    wq = quantize(w.chunk(tp)[rank].contiguous())
    xk = quantize(x[:, :512].contiguous())  # the reduce-scatter's x [M, K/tp]
    wk = quantize(w[:512, :512].contiguous())
    eager_ag = ops.ag_gemm(xq.data, wq.data, None, group=group, x_scale=xq.scale, w_scale=wq.scale, backend="fused")
    eager_rs = ops.gemm_rs(xk.data, wk.data, None, group=group, x_scale=xk.scale, w_scale=wk.scale, backend="fused")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ag = ops.ag_gemm(xq.data, wq.data, None, group=group, x_scale=xq.scale, w_scale=wq.scale, backend="fused")
        rs = ops.gemm_rs(xk.data, wk.data, None, group=group, x_scale=xk.scale, w_scale=wk.scale, backend="fused")
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ag, eager_ag), f"rank {rank}: the replayed FP8 all-gather differs from the eager call"
        assert torch.equal(rs, eager_rs), f"rank {rank}: the replayed FP8 reduce-scatter differs from the eager call"
    workspace.check_graph_replays()
    # Bad FP8 calls are refused before anything is enqueued; the next call is right.
    for call, match in (
            (lambda: ops.ag_gemm(xq.data, wq.data, None, group=group, x_scale=xq.scale, backend="fused"),
             "x_scale and w_scale"),
            (lambda: ops.ag_gemm(xq.data, wq.data, None, group=group, x_scale=torch.ones(3, 1, device="cuda"),
                                 w_scale=wq.scale, backend="fused"), "row-wise"),
            (lambda: ops.gemm_rs(xk.data, wk.data, None, group=group, x_scale=xk.scale, w_scale=wk.scale.double(),
                                 backend="fused"), "float32"),
            (lambda: ops.gemm_rs(xk.data, wk.data, torch.zeros(512, device="cuda"), group=group, x_scale=xk.scale,
                                 w_scale=wk.scale, backend="fused"), "bias")):
        with pytest.raises(ValueError, match=match):
            call()
    again_ag = ops.ag_gemm(xq.data, wq.data, None, group=group, x_scale=xq.scale, w_scale=wq.scale, backend="fused")
    again_rs = ops.gemm_rs(xk.data, wk.data, None, group=group, x_scale=xk.scale, w_scale=wk.scale, backend="fused")
    assert torch.equal(again_ag, eager_ag) and torch.equal(again_rs, eager_rs), f"rank {rank}: a later call differs"
    torch.cuda.synchronize()


def test_fp8_cuda_graphs_and_bad_inputs():
    run_distributed(_graphs_and_bad_inputs, TP, int(torch.randint(0, 2**30, ()).item()), backend="nccl")
