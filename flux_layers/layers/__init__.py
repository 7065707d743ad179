"""Megatron-compatible tensor-parallel modules on the fused operators.

| name | what |
|---|---|
| :class:`ColumnParallelLinear`, :class:`RowParallelLinear` | drop-ins for megatron-core's, fused AG/RS under SP |

Autograd functions (one per communication pattern) are in :mod:`flux_layers.layers.autograd`.
"""
from flux_layers.config import OverlapConfig
from flux_layers.layers.linear import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "OverlapConfig",
    "ColumnParallelLinear",
    "RowParallelLinear",
]
