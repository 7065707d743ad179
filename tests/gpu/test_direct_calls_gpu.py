"""The fused ops' direct calls (csrc/bindings/fastcall.cpp) on GPUs: taken for plain tensors (the module exists and
answers with tensors, not NotImplemented), bitwise equal to the registered op's call on the same inputs, and within the
oracle's bound of fp32; a call the direct path declines (an input requiring grad under grad mode) still gives the same
result through the registered op."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, tp_under_test
from tests.gpu.gpu_support import (
    assert_close_rel,
    at_tp2_when_lean,
    global_inputs,
    needs_gpus,
    poison_outputs,
    references,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP),
              at_tp2_when_lean("a direct call runs the registered op's kernels and plan")]


def _direct_equals_registered(rank, tp, seed, layout):
    from flux_layers import _library
    from flux_layers.ops import _dispatch, _opcalls
    poison_outputs()
    direct = _library.direct_calls()
    assert direct is not None, _library.direct_calls_unavailable_reason()
    group = dist.group.WORLD
    m, k, n = 264 * tp, 1024, 768  # 264 rows per rank: not a multiple of the tile
    x, w, b = global_inputs(seed, m, k, n, torch.bfloat16, layout)
    x_shard_m = x.chunk(tp)[rank].contiguous()
    w_shard_n = w.chunk(tp, dim=0 if layout == "nt" else 1)[rank].contiguous()
    b_shard_n = b.chunk(tp)[rank].contiguous()
    x_shard_k = x.chunk(tp, dim=1)[rank].contiguous()
    w_shard_k = w.chunk(tp, dim=1 if layout == "nt" else 0)[rank].contiguous()

    ag = _dispatch.decided("ag_gemm", x_shard_m, w_shard_n, group, layout, "fused")  # made and bound, not run
    rs = _dispatch.decided("gemm_rs", x_shard_k, w_shard_k, group, layout, "fused")
    ag_plan, rs_plan = ag.workspace.plan_index(ag.plan), rs.workspace.plan_index(rs.plan)
    nn = layout == "nn"
    y_direct, gathered_direct = direct.ag_gemm(ag.workspace.handle, ag_plan, nn, True, x_shard_m, w_shard_n, b_shard_n,
                                               True)
    z_direct = direct.gemm_rs(rs.workspace.handle, rs_plan, nn, x_shard_k, w_shard_k, b)
    y_op, gathered_op = torch.ops.flux_layers.ag_gemm.default(x_shard_m, w_shard_n, b_shard_n, ag.workspace.handle,
                                                              ag_plan, nn, True, True)
    z_op = torch.ops.flux_layers.gemm_rs.default(x_shard_k, w_shard_k, b, rs.workspace.handle, rs_plan, nn)
    w_grad = torch.nn.Parameter(w_shard_n.clone())  # requires grad: declined by the direct path, the op runs it
    bound = _opcalls.ag_gemm(ag.workspace, ag_plan, nn)
    assert bound.direct(x_shard_m, w_grad, b_shard_n, True) is NotImplemented
    y_declined, _ = bound(x_shard_m, w_grad, b_shard_n, True)
    torch.cuda.synchronize()

    ref_y, cublas_y = references(x, w_shard_n, b_shard_n, layout)
    ref_z, cublas_z = references(x, w, b, layout)
    assert_close_rel(y_direct, ref_y, cublas_y, f"rank {rank} direct ag_gemm {layout}")
    assert_close_rel(z_direct, ref_z.chunk(tp)[rank], cublas_z.chunk(tp)[rank], f"rank {rank} direct gemm_rs {layout}")
    assert torch.equal(gathered_direct, x), f"rank {rank} direct ag_gemm {layout}: gathered input"
    for what, a, c in (("ag_gemm", y_direct, y_op), ("ag_gemm gathered", gathered_direct, gathered_op),
                       ("gemm_rs", z_direct, z_op), ("ag_gemm declined", y_direct, y_declined)):
        assert torch.equal(a, c), f"rank {rank} {what} {layout}: the direct call differs bitwise from the op's"


@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_direct_calls_are_bitwise_the_registered_ops(layout):
    run_distributed(_direct_equals_registered, TP, int(torch.randint(0, 2**30, ()).item()), layout, backend="nccl")
