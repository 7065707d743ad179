"""megatron-core ``ModuleSpec``s for a GPT layer built from flux_layers, and the matching baseline.

| submodule | flux spec | baseline spec |
|---|---|---|
| input_layernorm | ``IdentityOp`` (the norm is inside linear_qkv) | :class:`Norm` |
| self_attention.linear_qkv | :class:`LayerNormColumnParallelLinear` | megatron-core ``ColumnParallelLinear`` |
| self_attention.core_attention | :class:`SDPAttention` | :class:`SDPAttention` |
| self_attention.linear_proj | :class:`RowParallelLinear` | megatron-core ``RowParallelLinear`` |
| pre_mlp_layernorm | ``IdentityOp`` (inside linear_fc1; :class:`Norm` for MoE) | :class:`Norm` |
| mlp.linear_fc1 | :class:`LayerNormColumnParallelLinear` | megatron-core ``ColumnParallelLinear`` |
| mlp.linear_fc2 | :class:`RowParallelLinear` | megatron-core ``RowParallelLinear`` |
| final layernorm (block) | :class:`Norm` | :class:`Norm` |

Both use the same sequence-parallel norm and the same SDPA attention, so a comparison between them differs only
in the linear layers. The baseline maps ``input_layernorm.`` / ``pre_mlp_layernorm.`` to the fused layers'
``layer_norm_`` keys in its sharded state dict (as megatron-core's local spec does), so distributed checkpoints
of the two specs interchange.

Under sequence parallelism pass a block spec (:func:`get_gpt_decoder_block_spec`) to ``GPTModel``: given only a
layer spec, megatron-core picks its own final norm, and its torch fallback refuses sequence parallelism.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel import ColumnParallelLinear as MegatronColumnParallelLinear
from megatron.core.tensor_parallel import RowParallelLinear as MegatronRowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from flux_layers.config import OverlapConfig
from flux_layers.layers import _megatron_compat
from flux_layers.layers.attention import SDPAttention
from flux_layers.layers.fp8_recipe import warn_if_fp8_is_ignored
from flux_layers.layers.linear import ColumnParallelLinear, RowParallelLinear
from flux_layers.layers.norm import LayerNormColumnParallelLinear, Norm

_BASELINE_NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def _with_overlap(cls, overlap: Optional[OverlapConfig]):
    return cls if overlap is None else ModuleSpec(module=cls, params={"overlap": overlap})


class FluxSpecProvider(LocalSpecProvider):
    """megatron-core ``BackendSpecProvider`` for flux_layers' modules (MoE experts and shared experts
    included); ``overlap`` pins an :class:`OverlapConfig` on every linear instead of reading the config's."""

    def __init__(self, overlap: Optional[OverlapConfig] = None):
        self.overlap = overlap

    def column_parallel_linear(self):
        return _with_overlap(ColumnParallelLinear, self.overlap)

    def row_parallel_linear(self):
        return _with_overlap(RowParallelLinear, self.overlap)

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return _with_overlap(LayerNormColumnParallelLinear, self.overlap)

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return Norm

    def core_attention(self):
        return SDPAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool = False):
        # megatron-core 0.16 passes both flags, 0.17 on only the first (see _megatron_compat.experts).
        return _megatron_compat.experts(moe_use_grouped_gemm, linear_fc1=self.column_parallel_linear(),
                                        linear_fc2=self.row_parallel_linear(), activation_func=self.activation_func())


class BaselineSpecProvider(LocalSpecProvider):
    """megatron-core's own parallel linears with the same norm and attention as :class:`FluxSpecProvider`."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return Norm

    def core_attention(self):
        return SDPAttention


def _qk_norm(qk_layernorm: bool, qk_l2_norm: bool):
    if qk_l2_norm:
        return L2Norm
    return Norm if qk_layernorm else IdentityOp


def _gpt_layer_spec(backend, *, linear_qkv, linear_proj, input_layernorm, pre_mlp_layernorm, num_experts,
                    moe_grouped_gemm, qk_layernorm, moe_use_legacy_grouped_gemm, qk_l2_norm,
                    sharded_state_dict_keys_map=None) -> ModuleSpec:
    """The GPT ``TransformerLayer`` both specs share; they differ only in the pieces passed in."""
    mlp = get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                          **_megatron_compat.mlp_spec_kwargs(moe_use_legacy_grouped_gemm))
    qk_norm = _qk_norm(qk_layernorm, qk_l2_norm)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_layernorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear_qkv,
                    core_attention=backend.core_attention(),
                    linear_proj=linear_proj,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_layernorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=sharded_state_dict_keys_map or {},
        ),
    )


def get_gpt_layer_flux_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                            qk_layernorm: bool = False, moe_use_legacy_grouped_gemm: bool = False,
                            qk_l2_norm: bool = False, overlap: Optional[OverlapConfig] = None) -> ModuleSpec:
    """GPT ``TransformerLayer`` spec with flux_layers' linears (arguments as megatron-core's
    ``get_gpt_layer_with_transformer_engine_spec``; ``overlap`` as in :class:`FluxSpecProvider`)."""
    backend = FluxSpecProvider(overlap)
    return _gpt_layer_spec(
        backend, linear_qkv=backend.column_parallel_layer_norm_linear(), linear_proj=backend.row_parallel_linear(),
        input_layernorm=IdentityOp, pre_mlp_layernorm=Norm if num_experts else IdentityOp,
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
        moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm, qk_l2_norm=qk_l2_norm)


def get_gpt_layer_baseline_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                                qk_layernorm: bool = False, moe_use_legacy_grouped_gemm: bool = False,
                                qk_l2_norm: bool = False) -> ModuleSpec:
    """The same GPT layer with megatron-core's ``ColumnParallelLinear``/``RowParallelLinear`` and separate
    :class:`Norm` modules."""
    return _gpt_layer_spec(
        BaselineSpecProvider(), linear_qkv=MegatronColumnParallelLinear, linear_proj=MegatronRowParallelLinear,
        input_layernorm=Norm, pre_mlp_layernorm=Norm,
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
        moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm, qk_l2_norm=qk_l2_norm,
        sharded_state_dict_keys_map=dict(_BASELINE_NORM_KEYS) if not num_experts else None)


def get_gpt_decoder_block_spec(config, *, baseline: bool = False, overlap: Optional[OverlapConfig] = None,
                               qk_l2_norm: bool = False, vp_stage: Optional[int] = None,
                               pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """Block spec for ``GPTModel(transformer_layer_spec=...)``: this pipeline stage's layers (dense or MoE per
    ``config.moe_layer_freq``, as megatron-core's ``get_gpt_decoder_block_spec``) and :class:`Norm` as the final
    norm. ``baseline=True`` builds :func:`get_gpt_layer_baseline_spec` layers."""
    if baseline and overlap is not None:
        raise ValueError("get_gpt_decoder_block_spec: overlap= applies to the flux layers only; got baseline=True")

    legacy_grouped_gemm = _megatron_compat.legacy_grouped_gemm(config)

    def layer_spec(num_experts):
        if baseline:
            return get_gpt_layer_baseline_spec(num_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                               legacy_grouped_gemm, qk_l2_norm)
        return get_gpt_layer_flux_spec(num_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                       legacy_grouped_gemm, qk_l2_norm, overlap)

    dense, moe = layer_spec(None), layer_spec(config.num_moe_experts)
    if config.num_moe_experts is None:
        pattern = [0] * config.num_layers
    elif isinstance(config.moe_layer_freq, int):
        pattern = [1 if i % config.moe_layer_freq == 0 else 0 for i in range(config.num_layers)]
    else:
        pattern = list(config.moe_layer_freq)
        if len(pattern) != config.num_layers:
            raise ValueError(f"config.moe_layer_freq has {len(pattern)} entries but config.num_layers is "
                             f"{config.num_layers}")
    specs = [moe if p else dense for p in pattern]
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError("get_gpt_decoder_block_spec: config.pipeline_model_parallel_layout is not supported; "
                         "build the layer list with megatron-core's helpers")
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if baseline:
        warn_if_fp8_is_ignored(config)  # megatron-core's own linears do nothing with config.fp8 (no TE)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + num_layers], layer_norm=Norm)
