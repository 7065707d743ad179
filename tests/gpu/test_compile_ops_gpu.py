"""The fused operators under torch.compile(fullgraph=True) on 2 GPUs: each call is one opaque node that runs the
same kernels and plans as the eager call, so its outputs are bitwise equal to the eager call's on the same inputs
(and within the oracle's bound of fp32)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, tp_under_test
from tests.gpu.gpu_support import (
    assert_close_rel,
    at_tp2_when_lean,
    needs_gpus,
    poison_outputs,
    random_matrix,
    references,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP),
              at_tp2_when_lean("a compiled call runs the eager call's kernels and plan")]


def _compiled_equals_eager(rank, tp, seed, layout):
    from flux_layers import ops
    poison_outputs()
    ops.refresh_settings()
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, k, n = 264 * tp, 1024, 768  # 264 rows per rank: not a multiple of the tile
    x = random_matrix(m, k, torch.bfloat16, gen)
    w = random_matrix(n, k, torch.bfloat16, gen) if layout == "nt" else random_matrix(k, n, torch.bfloat16, gen)
    x_shard_m = x.chunk(tp)[rank]
    w_shard_n = w.chunk(tp, dim=0 if layout == "nt" else 1)[rank].contiguous()
    x_shard_k = x.chunk(tp, dim=1)[rank].contiguous()
    w_shard_k = w.chunk(tp, dim=1 if layout == "nt" else 0)[rank].contiguous()
    assert ops.plan("ag_gemm", x_shard_m, w_shard_n, group=group, weight_layout=layout,
                    backend="fused").path == "fused"
    assert ops.plan("gemm_rs", x_shard_k, w_shard_k, group=group, weight_layout=layout,
                    backend="fused").path == "fused"

    def step(x_shard_m, w_shard_n, x_shard_k, w_shard_k):
        y = ops.ag_gemm(x_shard_m, w_shard_n, group=group, weight_layout=layout, backend="fused")
        z = ops.gemm_rs(x_shard_k, w_shard_k, group=group, weight_layout=layout, backend="fused")
        return y, z

    args = (x_shard_m, w_shard_n, x_shard_k, w_shard_k)
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True)(*args)
    torch.cuda.synchronize()
    (ref_y, cublas_y), (ref_z, cublas_z) = references(x, w_shard_n, None, layout), references(x, w, None, layout)
    assert_close_rel(compiled[0], ref_y, cublas_y, f"rank {rank} compiled ag_gemm {layout}")
    assert_close_rel(compiled[1], ref_z.chunk(tp)[rank], cublas_z.chunk(tp)[rank],
                     f"rank {rank} compiled gemm_rs {layout}")
    for what, a, b in (("ag_gemm", compiled[0], eager[0]), ("gemm_rs", compiled[1], eager[1])):
        assert torch.equal(a, b), f"rank {rank} {what} {layout}: the compiled call differs bitwise from the eager one"


@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_compiled_fused_ops_are_bitwise_eager(layout):
    run_distributed(_compiled_equals_eager, TP, int(torch.randint(0, 2**30, ()).item()), layout, backend="nccl")
