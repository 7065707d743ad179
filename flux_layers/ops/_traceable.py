"""The public operators as single opaque graph nodes for torch.compile.

Dynamo cannot trace the operators' Python dispatch (tuning-table files, the workspace registry and its lock,
loading the op library, host-side epochs), so under torch.compile ``ops.gemm`` / ``ag_gemm`` / ``gemm_rs``
each become one custom op here. Its implementation is the same eager call, dispatch included, which reaches the op
library's implementation by its direct call (flux_layers/ops/_opcalls.py), not by a second, nested op; its fake
implementation only gives the output shapes. Eager calls never come through here.

The process group travels by name (``ProcessGroup.group_name``) and is resolved when the op runs.
"""
from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from flux_layers.ops import _dispatch
from flux_layers.ops._checks import output_shape
from flux_layers.ops.fp8 import OUT_DTYPE


@torch.library.custom_op("flux::op_gemm", mutates_args=())
def op_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str,
            backend: str | None) -> torch.Tensor:
    return _dispatch.gemm_call(x, weight, weight_layout, backend)(x, weight, bias)


@op_gemm.register_fake
def _(x, weight, bias, weight_layout, backend):
    return x.new_empty(output_shape("gemm", x.shape, weight.shape, weight_layout))


@torch.library.custom_op("flux::op_ag_gemm", mutates_args=())
def op_ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str,
               weight_layout: str, return_gathered: bool, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, gathered); gathered is [0, K] unless ``return_gathered`` (an op's outputs have a fixed arity)."""
    group = _resolve_process_group(group_name)
    call = _dispatch.ag_gemm_call(x_shard_m, weight, group, weight_layout, backend)
    if return_gathered:
        return call(x_shard_m, weight, bias, True)
    return call(x_shard_m, weight, bias, False), x_shard_m.new_empty((0, x_shard_m.shape[1]))


@op_ag_gemm.register_fake
def _(x_shard_m, weight, bias, group_name, weight_layout, return_gathered, backend):
    m, n = output_shape("ag_gemm", x_shard_m.shape, weight.shape, weight_layout,
                        _resolve_process_group(group_name).size())
    return x_shard_m.new_empty((m, n)), x_shard_m.new_empty((m if return_gathered else 0, x_shard_m.shape[1]))


@torch.library.custom_op("flux::op_gemm_rs", mutates_args=())
def op_gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str,
               weight_layout: str, backend: str | None) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    return _dispatch.gemm_rs_call(x, weight, group, weight_layout, backend)(x, weight, bias)


@op_gemm_rs.register_fake
def _(x, weight, bias, group_name, weight_layout, backend):
    return x.new_empty(output_shape("gemm_rs", x.shape, weight.shape, weight_layout,
                                    _resolve_process_group(group_name).size()))


# ---- FP8 operands: the scales are two more optional tensors; ag_gemm's gathered input comes back as its FP8 rows
# and their scales (two outputs, empty unless asked for).
def _group(group_name: str):
    return _resolve_process_group(group_name) if group_name else None


@torch.library.custom_op("flux::op_gemm_fp8", mutates_args=())
def op_gemm_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_scale: torch.Tensor | None,
                w_scale: torch.Tensor | None, weight_layout: str, fast_accum: bool,
                backend: str | None) -> torch.Tensor:
    return _dispatch.fp8_gemm_call(x, weight, weight_layout, fast_accum, backend)(x, weight, bias, x_scale, w_scale)


@op_gemm_fp8.register_fake
def _(x, weight, bias, x_scale, w_scale, weight_layout, fast_accum, backend):
    return x.new_empty(output_shape("gemm", x.shape, weight.shape, weight_layout), dtype=OUT_DTYPE)


@torch.library.custom_op("flux::op_ag_gemm_fp8", mutates_args=())
def op_ag_gemm_fp8(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   x_scale: torch.Tensor | None, w_scale: torch.Tensor | None, group_name: str, weight_layout: str,
                   return_gathered: bool, fast_accum: bool,
                   backend: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, gathered FP8 rows, their scales); the last two empty unless ``return_gathered``."""
    call = _dispatch.fp8_ag_gemm_call(x_shard_m, weight, _group(group_name), weight_layout, fast_accum, backend)
    if return_gathered:
        out, gathered = call(x_shard_m, weight, bias, x_scale, w_scale, True)
        return out, gathered.data, gathered.scale
    out = call(x_shard_m, weight, bias, x_scale, w_scale, False)
    return out, x_shard_m.new_empty((0, x_shard_m.shape[1])), x_scale.new_empty((0,))


@op_ag_gemm_fp8.register_fake
def _(x_shard_m, weight, bias, x_scale, w_scale, group_name, weight_layout, return_gathered, fast_accum, backend):
    group = _group(group_name)
    tp = group.size() if group is not None else 1
    m, n = output_shape("ag_gemm", x_shard_m.shape, weight.shape, weight_layout, tp)
    rows = m if return_gathered else 0
    scale_shape = ((tp,) if x_scale.numel() == 1 else (m, 1)) if return_gathered else (0,)
    return (x_shard_m.new_empty((m, n), dtype=OUT_DTYPE), x_shard_m.new_empty((rows, x_shard_m.shape[1])),
            x_scale.new_empty(scale_shape))


@torch.library.custom_op("flux::op_gemm_rs_fp8", mutates_args=())
def op_gemm_rs_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_scale: torch.Tensor | None,
                   w_scale: torch.Tensor | None, group_name: str, weight_layout: str, fast_accum: bool,
                   backend: str | None) -> torch.Tensor:
    call = _dispatch.fp8_gemm_rs_call(x, weight, _group(group_name), weight_layout, fast_accum, backend)
    return call(x, weight, bias, x_scale, w_scale)


@op_gemm_rs_fp8.register_fake
def _(x, weight, bias, x_scale, w_scale, group_name, weight_layout, fast_accum, backend):
    group = _group(group_name)
    tp = group.size() if group is not None else 1
    return x.new_empty(output_shape("gemm_rs", x.shape, weight.shape, weight_layout, tp), dtype=OUT_DTYPE)
