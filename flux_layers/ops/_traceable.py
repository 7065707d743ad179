"""The public operators as single opaque graph nodes for torch.compile.

Dynamo cannot trace the operators' Python dispatch (tuning-table files, the workspace registry and its lock,
loading the op library, host-side epochs), so under torch.compile ``ops.gemm`` / ``ag_gemm`` / ``gemm_rs``
each become one custom op here. Its implementation is the same eager call (``ops.ag_gemm`` ..., run outside the
trace), decision included, which reaches the op library's implementation by its direct call
(flux_layers/ops/_opcalls.py), not by a second, nested op; its fake implementation only gives the output shapes.
Eager calls never come through here.

The process group travels by name (``ProcessGroup.group_name``) and is resolved when the op runs.
"""
from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from flux_layers.ops._checks import output_shape
from flux_layers.ops.fp8 import OUT_DTYPE


@torch.library.custom_op("flux::op_gemm", mutates_args=())
def op_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str,
            backend: str | None) -> torch.Tensor:
    from flux_layers import ops
    return ops.gemm(x, weight, bias, weight_layout=weight_layout, backend=backend)


@op_gemm.register_fake
def _(x, weight, bias, weight_layout, backend):
    return x.new_empty(output_shape("gemm", x.shape, weight.shape, weight_layout))


@torch.library.custom_op("flux::op_ag_gemm", mutates_args=())
def op_ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str,
               weight_layout: str, return_gathered: bool, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, gathered); gathered is [0, K] unless ``return_gathered`` (an op's outputs have a fixed arity)."""
    from flux_layers import ops
    group = _resolve_process_group(group_name)
    out = ops.ag_gemm(x_shard_m, weight, bias, group=group, weight_layout=weight_layout,
                      return_gathered=return_gathered, backend=backend)
    return out if return_gathered else (out, x_shard_m.new_empty((0, x_shard_m.shape[1])))


@op_ag_gemm.register_fake
def _(x_shard_m, weight, bias, group_name, weight_layout, return_gathered, backend):
    m, n = output_shape("ag_gemm", x_shard_m.shape, weight.shape, weight_layout,
                        _resolve_process_group(group_name).size())
    return x_shard_m.new_empty((m, n)), x_shard_m.new_empty((m if return_gathered else 0, x_shard_m.shape[1]))


@torch.library.custom_op("flux::op_gemm_rs", mutates_args=())
def op_gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str,
               weight_layout: str, backend: str | None) -> torch.Tensor:
    from flux_layers import ops
    return ops.gemm_rs(x, weight, bias, group=_resolve_process_group(group_name), weight_layout=weight_layout,
                       backend=backend)


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
    from flux_layers import ops
    return ops.gemm(x, weight, bias, weight_layout=weight_layout, x_scale=x_scale, w_scale=w_scale,
                    fast_accum=fast_accum, backend=backend)


@op_gemm_fp8.register_fake
def _(x, weight, bias, x_scale, w_scale, weight_layout, fast_accum, backend):
    return x.new_empty(output_shape("gemm", x.shape, weight.shape, weight_layout), dtype=OUT_DTYPE)


@torch.library.custom_op("flux::op_ag_gemm_fp8", mutates_args=())
def op_ag_gemm_fp8(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   x_scale: torch.Tensor | None, w_scale: torch.Tensor | None, group_name: str, weight_layout: str,
                   return_gathered: bool, fast_accum: bool,
                   backend: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, gathered FP8 rows, their scales); the last two empty unless ``return_gathered``."""
    from flux_layers import ops
    out = ops.ag_gemm(x_shard_m, weight, bias, group=_group(group_name), weight_layout=weight_layout,
                      return_gathered=return_gathered, x_scale=x_scale, w_scale=w_scale, fast_accum=fast_accum,
                      backend=backend)
    if return_gathered:
        return out[0], out[1].data, out[1].scale
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
    from flux_layers import ops
    return ops.gemm_rs(x, weight, bias, group=_group(group_name), weight_layout=weight_layout, x_scale=x_scale,
                       w_scale=w_scale, fast_accum=fast_accum, backend=backend)


@op_gemm_rs_fp8.register_fake
def _(x, weight, bias, x_scale, w_scale, group_name, weight_layout, fast_accum, backend):
    group = _group(group_name)
    tp = group.size() if group is not None else 1
    return x.new_empty(output_shape("gemm_rs", x.shape, weight.shape, weight_layout, tp), dtype=OUT_DTYPE)
