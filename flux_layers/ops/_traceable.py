"""The public operators as single opaque graph nodes for torch.compile.

Dynamo cannot trace the operators' Python dispatch (tuning-table files, the workspace registry and its lock,
loading the op library, host-side epochs), so under torch.compile ``ops.gemm`` / ``ag_gemm`` / ``gemm_rs``
each become one custom op here. Its implementation is the same eager call, dispatch included; its fake
implementation only gives the output shapes. Eager calls never come through here.

The process group travels by name (``ProcessGroup.group_name``) and is resolved when the op runs.
"""
from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group


def _n_of(weight: torch.Tensor, weight_layout: str) -> int:
    return weight.shape[1] if weight_layout == "nn" else weight.shape[0]


@torch.library.custom_op("flux::op_gemm", mutates_args=())
def op_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str,
            backend: str | None) -> torch.Tensor:
    from flux_layers import ops
    return ops.gemm(x, weight, bias, weight_layout=weight_layout, backend=backend)


@op_gemm.register_fake
def _(x, weight, bias, weight_layout, backend):
    return x.new_empty((x.shape[0], _n_of(weight, weight_layout)))


@torch.library.custom_op("flux::op_ag_gemm", mutates_args=())
def op_ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str,
               weight_layout: str, return_gathered: bool, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, gathered); gathered is [0, K] unless ``return_gathered`` (an op's outputs have a fixed arity)."""
    from flux_layers import ops
    group = _resolve_process_group(group_name)
    if return_gathered:
        return ops.ag_gemm(x_shard_m, weight, bias, group=group, weight_layout=weight_layout, return_gathered=True,
                           backend=backend)
    out = ops.ag_gemm(x_shard_m, weight, bias, group=group, weight_layout=weight_layout, backend=backend)
    return out, x_shard_m.new_empty((0, x_shard_m.shape[1]))


@op_ag_gemm.register_fake
def _(x_shard_m, weight, bias, group_name, weight_layout, return_gathered, backend):
    m = x_shard_m.shape[0] * _resolve_process_group(group_name).size()
    k = x_shard_m.shape[1]
    return (x_shard_m.new_empty((m, _n_of(weight, weight_layout))),
            x_shard_m.new_empty((m if return_gathered else 0, k)))


@torch.library.custom_op("flux::op_gemm_rs", mutates_args=())
def op_gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str,
               weight_layout: str, backend: str | None) -> torch.Tensor:
    from flux_layers import ops
    return ops.gemm_rs(x, weight, bias, group=_resolve_process_group(group_name), weight_layout=weight_layout,
                       backend=backend)


@op_gemm_rs.register_fake
def _(x, weight, bias, group_name, weight_layout, backend):
    tp = _resolve_process_group(group_name).size()
    return x.new_empty((x.shape[0] // tp, _n_of(weight, weight_layout)))
