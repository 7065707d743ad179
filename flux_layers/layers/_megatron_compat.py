"""Where the supported megatron-core releases (0.16.1 to 0.19.x) differ for flux_layers, and only there.

Each difference is decided by the installed release (``megatron.core.package_info.VERSION``) and names the
release that changed it (as read in the sources of 0.16.1, 0.17.1, 0.18.2 and 0.19.2). Differences that only
add an argument are taken where it arrives (the linears' ``name``, passed from 0.18 on; ``layer_norm``'s
``has_residual`` in the spec providers, from 0.17); everything else the layers, specs and examples use is the same
in all of them.
"""
from __future__ import annotations

import warnings
from functools import partial

from megatron.core import package_info
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP

MEGATRON_CORE = tuple(int(part) for part in package_info.VERSION[:3])
OLDEST_SUPPORTED, NEWEST_TESTED = (0, 16, 1), (0, 19)

if MEGATRON_CORE < OLDEST_SUPPORTED:
    raise ImportError(f"flux_layers.layers needs megatron-core 0.16.1 to 0.19.x; this is "
                      f"{package_info.__version__}")
if MEGATRON_CORE[:2] > NEWEST_TESTED:
    warnings.warn(f"flux_layers.layers is tested with megatron-core 0.16.1 to 0.19.x; megatron-core "
                  f"{package_info.__version__} may differ where flux_layers/layers/_megatron_compat.py decides",
                  RuntimeWarning, stacklevel=2)

# 0.17 removed the legacy GroupedMLP, TransformerConfig.moe_use_legacy_grouped_gemm and that argument of the spec
# helpers; a BackendSpecProvider's grouped_mlp_modules(grouped) returns an experts builder (a partial of the
# experts class with its submodules) instead of a (class, submodules) pair.
EXPERTS_BUILDER = MEGATRON_CORE >= (0, 17)
# 0.18 renamed TransformerConfig.cuda_graph_scope to cuda_graph_modules (the old name warns, then migrates).
CUDA_GRAPH_MODULES = MEGATRON_CORE >= (0, 18)
# 0.19: an expert parameter's gradient is reduced over the expert data-parallel group (its ``allreduce``
# attribute False) also where the experts' tensor-parallel size differs from the dense layers'; before, only under
# expert parallelism.
EXPERT_DP_WHERE_ETP_DIFFERS = MEGATRON_CORE >= (0, 19)
# 0.19 added generalized tensor parallelism: weights sharded beyond their TP shard, gathered again for each use.
GENERALIZED_TP = MEGATRON_CORE >= (0, 19)


def legacy_grouped_gemm(config) -> bool:
    """``config.moe_use_legacy_grouped_gemm``; False from 0.17, which removed the field with the legacy experts."""
    return False if EXPERTS_BUILDER else bool(config.moe_use_legacy_grouped_gemm)


def mlp_spec_kwargs(moe_use_legacy_grouped_gemm: bool) -> dict:
    """The keywords of ``get_mlp_module_spec_for_backend`` that differ: ``moe_use_legacy_grouped_gemm`` until
    0.16 (an error asking for it later, since 0.17 has no legacy grouped GEMM)."""
    if not EXPERTS_BUILDER:
        return {"moe_use_legacy_grouped_gemm": moe_use_legacy_grouped_gemm}
    if moe_use_legacy_grouped_gemm:
        raise ValueError(f"moe_use_legacy_grouped_gemm=True: megatron-core {package_info.__version__} has no legacy "
                         f"grouped GEMM (removed in 0.17)")
    return {}


def experts(moe_use_grouped_gemm: bool, *, linear_fc1, linear_fc2, activation_func):
    """What a ``BackendSpecProvider.grouped_mlp_modules`` returns for MoE experts built from the given linears
    (``SequentialMLP``): ``(class, submodules)`` until 0.16, an experts builder from 0.17. Grouped GEMM experts are
    megatron-core's own ``GroupedMLP`` until 0.16 (they do not use the given linears); from 0.17 only Transformer
    Engine's exist, so asking for them is an error."""
    submodules = MLPSubmodules(linear_fc1=linear_fc1, linear_fc2=linear_fc2, activation_func=activation_func)
    if not EXPERTS_BUILDER:
        if moe_use_grouped_gemm:
            from megatron.core.transformer.moe.experts import GroupedMLP
            return GroupedMLP, None
        return SequentialMLP, submodules
    if moe_use_grouped_gemm:
        raise ValueError(f"moe_grouped_gemm=True: megatron-core {package_info.__version__} builds grouped-GEMM "
                         f"experts only from Transformer Engine (its local GroupedMLP was removed in 0.17); set "
                         f"moe_grouped_gemm=False for experts of flux_layers' linears (SequentialMLP)")
    return partial(SequentialMLP, submodules=submodules)


def whole_layer_cuda_graphs() -> dict:
    """``TransformerConfig`` keywords that capture each whole transformer layer as one CUDA graph (with
    ``cuda_graph_impl='local'``): an empty ``cuda_graph_scope``, renamed ``cuda_graph_modules`` in 0.18."""
    return {"cuda_graph_modules": []} if CUDA_GRAPH_MODULES else {"cuda_graph_scope": []}


def grads_reduced_over_expert_dp(config, is_expert: bool) -> bool:
    """Whether megatron-core reduces a parameter's gradient over the expert data-parallel group (the parameter's
    ``allreduce`` attribute is then False), as its own parallel linears decide."""
    if not is_expert:
        return False
    if config.expert_model_parallel_size > 1:
        return True
    return EXPERT_DP_WHERE_ETP_DIFFERS and config.expert_tensor_parallel_size != config.tensor_model_parallel_size


def weight_shards_beyond_tp(config, is_expert: bool) -> int:
    """How many ways megatron-core's generalized tensor parallelism (0.19) shards each weight beyond its TP shard
    (1: not at all; always 1 before 0.19, which has no such sharding)."""
    if not GENERALIZED_TP:
        return 1
    return config.expert_gtp_weight_remat_size if is_expert else config.gtp_weight_remat_size
