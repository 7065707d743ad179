"""Reference backend vs an unsharded fp64 computation, 2 and 4 gloo processes, fresh random inputs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flux_layers import ops
from flux_layers.devtools.launch import run_distributed


def _inputs(seed: int, m: int, k: int, n: int, layout: str):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) if layout == "nt" else \
        torch.randn(k, n, generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    return x, w, b


def _check_ag_gemm(rank, tp, seed, m, k, n, layout):
    x, w, b = _inputs(seed, m, k, n, layout)
    full = x @ (w.t() if layout == "nt" else w) + b
    rows = m // tp
    x_shard_m = x[rank * rows:(rank + 1) * rows]
    w_shard_n = w.chunk(tp, dim=0 if layout == "nt" else 1)[rank].contiguous()
    b_shard_n = b.chunk(tp)[rank]
    out, gathered = ops.ag_gemm(x_shard_m, w_shard_n, b_shard_n, group=dist.group.WORLD,
                                weight_layout=layout, return_gathered=True, backend="reference")
    torch.testing.assert_close(gathered, x, rtol=0, atol=0)
    torch.testing.assert_close(out, full.chunk(tp, dim=1)[rank], rtol=1e-12, atol=1e-12)


def _check_gemm_rs(rank, tp, seed, m, k, n, layout):
    x, w, b = _inputs(seed, m, k, n, layout)
    full = x @ (w.t() if layout == "nt" else w) + b
    x_shard_k = x.chunk(tp, dim=1)[rank].contiguous()
    w_shard_k = w.chunk(tp, dim=1 if layout == "nt" else 0)[rank].contiguous()
    out = ops.gemm_rs(x_shard_k, w_shard_k, b, group=dist.group.WORLD, weight_layout=layout, backend="reference")
    torch.testing.assert_close(out, full.chunk(tp, dim=0)[rank], rtol=1e-12, atol=1e-12)


def _check_bad_inputs(rank, tp):
    x = torch.randn(6, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="disagree on K"):
        ops.ag_gemm(x, torch.randn(4, 9, dtype=torch.float64), group=dist.group.WORLD, backend="reference")
    with pytest.raises(ValueError, match="dtype"):
        ops.gemm_rs(x, torch.randn(4, 8, dtype=torch.float32), group=dist.group.WORLD, backend="reference")
    with pytest.raises(ValueError, match="not divisible"):
        ops.gemm_rs(torch.randn(5, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64),
                    group=dist.group.WORLD, backend="reference")
    with pytest.raises(ValueError, match="weight_layout"):
        ops.ag_gemm(x, torch.randn(4, 8, dtype=torch.float64), group=dist.group.WORLD, weight_layout="tn",
                    backend="reference")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_ag_gemm_reference(tp, layout):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_distributed(_check_ag_gemm, tp, seed, 8 * tp + 4 * tp, 24, 12 * tp, layout)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_gemm_rs_reference(tp, layout):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_distributed(_check_gemm_rs, tp, seed, 6 * tp, 8 * tp, 20, layout)


def test_bad_inputs_raise_clear_errors():
    run_distributed(_check_bad_inputs, 2)


def _compiled_ops(rank, tp, seed):
    """torch.compile(fullgraph=True) over the public ops: each call is one opaque node (no graph break) and
    gives what the eager call gives."""
    x, w, b = _inputs(seed, 64, 48, 32, "nt")
    group = dist.group.WORLD
    x_shard_m = x[rank * 32:(rank + 1) * 32]
    w_shard_n = w.chunk(tp, dim=0)[rank].contiguous()
    x_shard_k = x.chunk(tp, dim=1)[rank].contiguous()
    w_shard_k = w.chunk(tp, dim=1)[rank].contiguous()

    def step(x_shard_m, w_shard_n, x_shard_k, w_shard_k, b):
        y, gathered = ops.ag_gemm(x_shard_m, w_shard_n, None, group=group, return_gathered=True,
                                  backend="reference")
        z = ops.gemm_rs(x_shard_k, w_shard_k, b, group=group, backend="reference")
        return y, gathered, z, ops.gemm(gathered, w_shard_n, None, backend="reference")

    eager = step(x_shard_m, w_shard_n, x_shard_k, w_shard_k, b)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x_shard_m, w_shard_n, x_shard_k,
                                                                        w_shard_k, b)
    for a, c in zip(eager, compiled):
        torch.testing.assert_close(c, a, rtol=0, atol=0)


def test_ops_compile_to_opaque_nodes():
    run_distributed(_compiled_ops, 2, int(torch.randint(0, 2**30, ()).item()))


class _NcclCall:
    """torch.distributed as an NCCL group of ``tp`` ranks presents it to the reference backend, with the tensor
    reduce-scatter captured: its arguments bound to the real function's signature (defaults applied), so the
    reduction it asks for is read, not assumed. The collective itself writes a marker into the output, so the
    caller's use of that output shows."""

    def __init__(self, monkeypatch, tp: int):
        import inspect
        self.group, self.calls = object(), []
        signature = inspect.signature(dist.reduce_scatter_tensor)

        def reduce_scatter_tensor(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.calls.append(dict(bound.arguments))
            bound.arguments["output"].fill_(7.0)
        monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter_tensor)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: tp)


def test_reference_reduce_scatter_over_nccl_asks_for_a_sum(monkeypatch):
    """The NCCL branch of the reference backend (never taken by gloo, so not by the other CPU tests): the op, the
    tensors and the group passed to reduce_scatter_tensor; what it writes is what the call returns (+ bias once)."""
    from flux_layers.layers import autograd
    tp = 4
    nccl = _NcclCall(monkeypatch, tp)
    x, w, b = _inputs(3, 8, 6, 5, "nt")
    ops.refresh_settings()
    out = ops.gemm_rs(x, w, b, group=nccl.group, backend="reference")
    (call,) = nccl.calls
    assert call["op"] == dist.ReduceOp.SUM, f"reduce_scatter_tensor asked for {call['op']}, not a sum"
    assert call["group"] is nccl.group and call["async_op"] is False
    torch.testing.assert_close(call["input"], x @ w.t(), rtol=0, atol=0)  # the whole partial product, [M, N]
    assert call["output"].shape == (8 // tp, 5) and call["input"].is_contiguous()
    torch.testing.assert_close(out, torch.full((8 // tp, 5), 7.0, dtype=torch.float64) + b, rtol=0, atol=0)
    # The column dgrad's reduce-scatter under the wgrad GEMM (layers/autograd.py), started asynchronously.
    dgrad = torch.randn(8, 3, dtype=torch.float64)
    block, _work = autograd._reduce_scatter_rows_start(dgrad, nccl.group)
    second = nccl.calls[1]
    assert second["op"] == dist.ReduceOp.SUM, f"the dgrad's reduce-scatter asked for {second['op']}, not a sum"
    assert second["async_op"] is True and second["group"] is nccl.group
    assert second["output"] is block and block.shape == (8 // tp, 3) and torch.equal(second["input"], dgrad)
    ops.refresh_settings()
