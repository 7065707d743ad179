"""The fused operators captured in CUDA graphs on TP GPUs (one process each, NCCL), or TP ranks sharing one GPU
(FLUX_LAYERS_TEST_SHARED_GPU=1, FLUX_LAYERS_TEST_TP), against an fp32 reference.

A graph holds two calls of one operator (two sizes of M, so that the workspace serves both); it is replayed
back to back with fresh inputs copied into its static tensors in stream order, one rank starting some replays
~10 ms late, and with eager calls of the same operator (on the eager workspace) in between. Outputs are
poisoned with NaN inside the captured op, so every replay must write every element; each replay's outputs are
bitwise equal to an eager call's on the same inputs (same kernels, same plans). The AllGather cases enable
CUDA graphs before the warm-up (the twins come with the workspaces); the ReduceScatter cases add the twins after
it (prepare_cuda_graphs).
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, tp_under_test
from flux_layers.runtime.tuning import RS_TRANSPORTS
from tests.gpu.gpu_support import (
    assert_close_rel,
    lean_params,
    needs_gpus,
    poison_outputs,
    random_matrix,
    references,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP)]
REPLAYS = 6
ROWS = (512, 264)  # per-rank rows of the two captured calls (the second not a multiple of the tile)


def _replay_and_check(rank, tp, seed, make_inputs, call, reference, what, *, prepare_after_warmup=False):
    """Capture call() on static inputs, replay it REPLAYS times back to back and compare each replay's outputs with
    the references ((fp32, cuBLAS) per output) and, bitwise, with an eager call on the same inputs.
    prepare_after_warmup: the warm-up runs without CUDA graphs enabled, prepare_cuda_graphs() adds the twins."""
    from flux_layers.runtime import workspace
    gen = torch.Generator(device="cuda").manual_seed(seed)
    static = make_inputs(gen)
    for _ in range(2):  # warm-up: creates the workspaces (and their twins) outside the capture
        call(static)
    torch.cuda.synchronize()
    if prepare_after_warmup:
        assert all(ws.graph_twin is None for ws in workspace._cache.values())
        workspace.prepare_cuda_graphs()
    assert all(ws.graph_twin is not None for ws in workspace._cache.values()), "a workspace has no CUDA-graph twin"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call(static)
    trials, replayed = [], []
    for i in range(REPLAYS):
        inputs = make_inputs(gen)
        trials.append(inputs)
        if i == 2 and rank == 1:
            time.sleep(0.010)  # this rank's replay starts late; the other waits in the flags
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        replayed.append([o.clone() for o in static_out])
        if i == 3:
            eager = call(inputs)  # an eager call between replays (eager workspace)
            for j, (o, refs) in enumerate(zip(eager, reference(inputs))):
                assert_close_rel(o, *refs, f"rank {rank} {what} eager call between replays, output {j}")
    torch.cuda.synchronize()
    for i, (inputs, outs) in enumerate(zip(trials, replayed)):
        for j, (o, refs) in enumerate(zip(outs, reference(inputs))):
            assert_close_rel(o, *refs, f"rank {rank} {what} replay {i}, output {j}")
        eager = call(inputs)
        differing = [j for j, (o, e) in enumerate(zip(outs, eager)) if not torch.equal(o, e)]
        assert not differing, f"rank {rank} {what} replay {i}: outputs {differing} differ bitwise from an eager call"
    torch.cuda.synchronize()


def _ag(rank, tp, seed, mode, order):
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.runtime import workspace
    poison_outputs()
    os.environ["FLUX_LAYERS_AG_MODE"] = mode
    os.environ["FLUX_LAYERS_AG_ORDER"] = order
    workspace.enable_cuda_graphs()
    k, n = 1024, 768
    group = dist.group.WORLD

    def make_inputs(gen):  # the global x of each call (identical on every rank) and this rank's weight shard
        return ([random_matrix(r * tp, k, torch.bfloat16, gen) for r in ROWS]
                + [random_matrix(n, k, torch.bfloat16, gen)])

    def call(inputs):
        *xs, w = inputs
        return [fused_ag_gemm.ag_gemm(x.chunk(tp)[rank], w, group=group) for x in xs]

    def reference(inputs):
        *xs, w = inputs
        return [references(x, w, None, "nt") for x in xs]

    _replay_and_check(rank, tp, seed, make_inputs, call, reference, f"ag_gemm {mode} {order}")


@pytest.mark.parametrize("mode,order", lean_params(
    [("push", "mesh"), ("pull", "mesh"), ("push", "ring"), ("pull", "ring")], [("push", "mesh"), ("pull", "ring")],
    "push-mesh and pull-ring replay at every TP", unpack=True))
def test_ag_gemm_cuda_graph_replays(mode, order):
    run_distributed(_ag, TP, int(torch.randint(0, 2**30, ()).item()), mode, order, backend="nccl")


def _rs(rank, tp, seed, transport):
    from flux_layers.ops import fused_gemm_rs
    poison_outputs()
    k, n = 512 * tp, 1024
    group = dist.group.WORLD

    def make_inputs(gen):  # the global x of each call and the global weight (identical on every rank)
        return ([random_matrix(r * tp, k, torch.bfloat16, gen) for r in ROWS]
                + [random_matrix(n, k, torch.bfloat16, gen)])

    def call(inputs):
        *xs, w = inputs
        w_shard_k = w.chunk(tp, dim=1)[rank].contiguous()
        return [fused_gemm_rs.gemm_rs(x.chunk(tp, dim=1)[rank].contiguous(), w_shard_k, group=group,
                                      transport=transport) for x in xs]

    def reference(inputs):
        *xs, w = inputs
        return [tuple(r.chunk(tp)[rank] for r in references(x, w, None, "nt")) for x in xs]

    _replay_and_check(rank, tp, seed, make_inputs, call, reference, f"gemm_rs {transport}", prepare_after_warmup=True)


@pytest.mark.parametrize("transport", RS_TRANSPORTS)
def test_gemm_rs_cuda_graph_replays(transport):
    run_distributed(_rs, TP, int(torch.randint(0, 2**30, ()).item()), transport, backend="nccl")
