"""Reference backend: torch.distributed collectives + matmul.

Same signatures as the fused operators. Runs on CPU (gloo) and GPU (nccl); it is the numerical oracle in the
tests and the fallback (the "sequential" path: NCCL, then GEMM) wherever the fused path does not apply.

FP8 operands (flux_layers/ops/fp8.py): the collectives move the FP8 bytes and their scales (an all-gather sends half
the bytes of bf16), the GEMMs are ``torch._scaled_mm`` where it takes the scales (tensor-wise on either device,
row-wise on CUDA), else an fp32 matmul of the dequantized operands (CPU row-wise), rounded to bfloat16 once. An
all-gather's per-shard scales become row-wise scales of the gathered rows. The reduce-scatter of FP8 operands moves
bfloat16 partials, as the fused op does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers.ops._checks import check_matmul_args
from flux_layers.ops.fp8 import OUT_DTYPE, ScaledTensor, check_fp8_args, row_scales


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str) -> torch.Tensor:
    """x @ W^T ('nt', W [N, K]) or x @ W ('nn', W [K, N]), plus bias [N]."""
    out = x @ (weight.t() if weight_layout == "nt" else weight)
    if bias is not None:
        out = out + bias
    return out


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_layout: str = "nt",
         x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
         fast_accum: bool = False) -> torch.Tensor:
    """ops.gemm on this backend: :func:`linear`, or :func:`scaled_linear` for FP8 operands."""
    _, _, n = check_matmul_args("gemm", x, weight, bias, weight_layout)
    if check_fp8_args("gemm", x, weight, bias, x_scale, w_scale, weight_layout, n) is None:
        return linear(x, weight, bias, weight_layout)
    return scaled_linear(x, weight, bias, x_scale, w_scale, fast_accum)


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_scale: torch.Tensor,
                  w_scale: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """bfloat16 (x * x_scale) @ (W * w_scale)^T + bias for FP8 x [M, K], W [N, K] ('nt') and dequantization scales of
    one element or one per row of x / per output feature (module docstring)."""
    m, n = x.shape[0], weight.shape[0]
    tensorwise = x_scale.numel() == 1 and w_scale.numel() == 1
    if m > 0 and (tensorwise or x.is_cuda):
        if tensorwise:
            scale_a, scale_b = x_scale.reshape(1), w_scale.reshape(1)
        else:  # _scaled_mm's row-wise form takes [M, 1] and [1, N], both row-wise
            scale_a = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
            scale_b = w_scale.reshape(1, -1).expand(1, n).contiguous()
        return torch._scaled_mm(x, weight.t(), scale_a, scale_b, bias=bias, out_dtype=OUT_DTYPE,
                                use_fast_accum=fast_accum)
    out = (x.float() * x_scale.reshape(-1, 1)) @ (weight.float() * w_scale.reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(OUT_DTYPE)


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
            weight_layout: str = "nt", return_gathered: bool = False, x_scale: torch.Tensor | None = None,
            w_scale: torch.Tensor | None = None, fast_accum: bool = False):
    """out [M, N] = all_gather(x_shard_m [M/tp, K]) @ op(weight) + bias; optionally also the gathered x (FP8: a
    ScaledTensor whose scale is [tp], one per source rank's shard, or [M, 1] row-wise)."""
    _, _, n = check_matmul_args("ag_gemm", x_shard_m, weight, bias, weight_layout)
    modes = check_fp8_args("ag_gemm", x_shard_m, weight, bias, x_scale, w_scale, weight_layout, n)
    if modes is None:
        gathered = all_gather_rows(x_shard_m, group)
        out = linear(gathered, weight, bias, weight_layout)
        return (out, gathered) if return_gathered else out
    rows = x_shard_m.shape[0]
    data = all_gather_rows(x_shard_m.contiguous().view(torch.uint8), group).view(x_shard_m.dtype)
    if modes[0] == "tensor":  # one scale per shard: each source rank's scale applies to its rows
        gathered_scale = all_gather_rows(x_scale.reshape(1), group)
        row_scale = row_scales(gathered_scale, rows * gathered_scale.numel())
    else:
        gathered_scale = row_scale = all_gather_rows(x_scale, group)
    out = scaled_linear(data, weight, bias, row_scale, w_scale, fast_accum)
    return (out, ScaledTensor(data, gathered_scale)) if return_gathered else out


def gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
            fast_accum: bool = False) -> torch.Tensor:
    """out [M/tp, N] = reduce_scatter(x [M, K/tp] @ op(weight)) + bias (bias added once, after the sum)."""
    m, _, n = check_matmul_args("gemm_rs", x, weight, bias, weight_layout)
    modes = check_fp8_args("gemm_rs", x, weight, bias, x_scale, w_scale, weight_layout, n)
    tp = dist.get_world_size(group)
    if m % tp != 0:
        raise ValueError(f"gemm_rs: M={m} rows are not divisible by the group size {tp}")
    if modes is None:
        partial = linear(x, weight, None, weight_layout)
    else:
        partial = scaled_linear(x, weight, None, x_scale, w_scale, fast_accum)
    out = reduce_scatter_rows(partial, group)
    if bias is not None:
        out = out + bias
    return out
