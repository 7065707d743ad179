"""Reference backend: torch.distributed collectives + matmul.

Same signatures as the fused operators. Runs on CPU (gloo) and GPU (nccl); it is the numerical oracle in the
tests and the fallback (the "sequential" path: NCCL, then GEMM) wherever the fused path does not apply.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers.ops._checks import check_matmul_args


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str) -> torch.Tensor:
    """x @ W^T ('nt', W [N, K]) or x @ W ('nn', W [K, N]), plus bias [N]."""
    out = x @ (weight.t() if weight_layout == "nt" else weight)
    if bias is not None:
        out = out + bias
    return out


def all_gather_rows(x_shard_m: torch.Tensor, group) -> torch.Tensor:
    """[M/tp, ...] on every rank -> [M, ...], rank order."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return x_shard_m
    x_shard_m = x_shard_m.contiguous()
    out = x_shard_m.new_empty((tp * x_shard_m.shape[0],) + tuple(x_shard_m.shape[1:]))
    dist.all_gather_into_tensor(out, x_shard_m, group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks of [M, ...], rank r keeps rows [r*M/tp, (r+1)*M/tp)."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return x
    if x.shape[0] % tp != 0:
        raise ValueError(f"reduce_scatter_rows: {x.shape[0]} rows are not divisible by the group size {tp}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // tp,) + tuple(x.shape[1:]))
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter on tensors: all-reduce, keep this rank's block.
        full = x.clone()
        dist.all_reduce(full, group=group)
        out.copy_(full.chunk(tp)[dist.get_rank(group)])
    else:
        dist.reduce_scatter_tensor(out, x, group=group)
    return out


def ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", return_gathered: bool = False):
    """out [M, N] = all_gather(x_shard_m [M/tp, K]) @ op(weight) + bias; optionally also the gathered x."""
    check_matmul_args("ag_gemm", x_shard_m, weight, bias, weight_layout)
    gathered = all_gather_rows(x_shard_m, group)
    out = linear(gathered, weight, bias, weight_layout)
    return (out, gathered) if return_gathered else out


def gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt") -> torch.Tensor:
    """out [M/tp, N] = reduce_scatter(x [M, K/tp] @ op(weight)) + bias (bias added once, after the sum)."""
    m, _, _ = check_matmul_args("gemm_rs", x, weight, bias, weight_layout)
    tp = dist.get_world_size(group)
    if m % tp != 0:
        raise ValueError(f"gemm_rs: M={m} rows are not divisible by the group size {tp}")
    out = reduce_scatter_rows(linear(x, weight, None, weight_layout), group)
    if bias is not None:
        out = out + bias
    return out
