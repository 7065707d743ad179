"""flux_layers.layers._megatron_compat against the installed megatron-core (CI runs this with 0.16.1 and with
0.19.2): the release flags it decides by agree with the features that release has, and each difference gives what
that release expects."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from flux_layers.layers import _megatron_compat


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_release_flags_match_the_installed_features():
    from megatron.core import ModelParallelConfig, package_info
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.transformer_config import TransformerConfig
    assert _megatron_compat.MEGATRON_CORE == tuple(package_info.VERSION[:3])
    assert _megatron_compat.OLDEST_SUPPORTED <= _megatron_compat.MEGATRON_CORE
    assert _megatron_compat.EXPERTS_BUILDER == (not hasattr(experts, "GroupedMLP"))
    assert _megatron_compat.EXPERTS_BUILDER == ("moe_use_legacy_grouped_gemm" not in _fields(TransformerConfig))
    assert _megatron_compat.CUDA_GRAPH_MODULES == ("cuda_graph_modules" in _fields(TransformerConfig))
    assert _megatron_compat.GENERALIZED_TP == ("gtp_weight_remat_size" in _fields(ModelParallelConfig))


def test_grouped_gemm_experts_per_release():
    from flux_layers.layers.spec import get_gpt_layer_flux_spec
    if _megatron_compat.EXPERTS_BUILDER:  # 0.17 on: grouped-GEMM experts are Transformer Engine's only
        with pytest.raises(ValueError, match=r"moe_grouped_gemm=True: megatron-core \S+ builds grouped-GEMM experts "
                                             r"only from Transformer Engine"):
            get_gpt_layer_flux_spec(num_experts=2, moe_grouped_gemm=True)
        with pytest.raises(ValueError, match=r"moe_use_legacy_grouped_gemm=True: megatron-core \S+ has no legacy "
                                             r"grouped GEMM \(removed in 0.17\)"):
            get_gpt_layer_flux_spec(num_experts=2, moe_use_legacy_grouped_gemm=True)
    else:
        from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
        assert get_gpt_layer_flux_spec(num_experts=2, moe_grouped_gemm=True).submodules.mlp.submodules.experts \
            .module is GroupedMLP
        experts = get_gpt_layer_flux_spec(num_experts=2, moe_use_legacy_grouped_gemm=True).submodules.mlp \
            .submodules.experts
        assert experts.module is SequentialMLP


def test_whole_layer_cuda_graphs_config():
    """The keywords take the whole layer (an empty list of captured parts) without a deprecation warning."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = TransformerConfig(**base, cuda_graph_impl="local", **_megatron_compat.whole_layer_cuda_graphs())
    captured = config.cuda_graph_modules if _megatron_compat.CUDA_GRAPH_MODULES else config.cuda_graph_scope
    assert captured == []
    about_graphs = [str(w.message) for w in caught if "cuda_graph" in str(w.message) or "scope" in str(w.message)]
    assert not about_graphs, about_graphs
