"""Megatron-compatible tensor-parallel modules on the fused operators, and megatron-core specs built from them.

| name | what |
|---|---|
| :class:`ColumnParallelLinear`, :class:`RowParallelLinear` | drop-ins for megatron-core's, fused AG/RS under SP |
| :class:`LayerNormColumnParallelLinear` | norm + column linear with the signature of TE's ``LayerNormLinear`` wrapper |
| :class:`RMSNorm`, :class:`LayerNorm`, :class:`Norm` | norms that run on a sequence shard (``Norm`` picks by config) |
| :class:`SDPAttention` | core attention on torch SDPA with megatron-core's interface |
| :func:`get_gpt_layer_flux_spec`, :func:`get_gpt_layer_baseline_spec`, :func:`get_gpt_decoder_block_spec` | specs |

Autograd functions (one per communication pattern) are in :mod:`flux_layers.layers.autograd`. FP8 from megatron-core's
``fp8`` settings: the recipe in :mod:`flux_layers.layers.fp8_recipe` (``assign_layer_numbers`` for
``first_last_layers_bf16``), the FP8 autograd functions in :mod:`flux_layers.layers.fp8_autograd`, the cached FP8
weights in :mod:`flux_layers.layers.fp8_weights`.
"""
from flux_layers.config import OverlapConfig
from flux_layers.layers.attention import SDPAttention
from flux_layers.layers.linear import ColumnParallelLinear, RowParallelLinear
from flux_layers.layers.norm import LayerNorm, LayerNormColumnParallelLinear, Norm, RMSNorm
from flux_layers.layers.spec import (
    BaselineSpecProvider,
    FluxSpecProvider,
    get_gpt_decoder_block_spec,
    get_gpt_layer_baseline_spec,
    get_gpt_layer_flux_spec,
)

__all__ = [
    "OverlapConfig",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "LayerNormColumnParallelLinear",
    "RMSNorm",
    "LayerNorm",
    "Norm",
    "SDPAttention",
    "FluxSpecProvider",
    "BaselineSpecProvider",
    "get_gpt_layer_flux_spec",
    "get_gpt_layer_baseline_spec",
    "get_gpt_decoder_block_spec",
]
