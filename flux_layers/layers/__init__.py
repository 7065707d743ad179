"""Megatron-compatible tensor-parallel modules on the fused operators.

| name | what |
|---|---|
| :class:`ColumnParallelLinear`, :class:`RowParallelLinear` | drop-ins for megatron-core's, fused AG/RS under SP |
| :class:`LayerNormColumnParallelLinear` | norm + column linear with the signature of TE's ``LayerNormLinear`` wrapper |
| :class:`RMSNorm`, :class:`LayerNorm`, :class:`Norm` | norms that run on a sequence shard (``Norm`` picks by config) |

Autograd functions (one per communication pattern) are in :mod:`flux_layers.layers.autograd`.
"""
from flux_layers.config import OverlapConfig
from flux_layers.layers.linear import ColumnParallelLinear, RowParallelLinear
from flux_layers.layers.norm import LayerNorm, LayerNormColumnParallelLinear, Norm, RMSNorm

__all__ = [
    "OverlapConfig",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "LayerNormColumnParallelLinear",
    "RMSNorm",
    "LayerNorm",
    "Norm",
]
