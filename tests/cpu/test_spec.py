"""GPT specs: megatron-core's GPTModel builds from the flux and the baseline spec (TP 1 and TP 2 + SP on gloo),
the two models get the same weights from the same seed and compute the same loss and gradients, and their
sharded state dicts have the same keys. Also SDPAttention against megatron-core's DotProductAttention.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flux_layers.devtools.launch import run_distributed
from tests.cpu.test_layers import megatron_on_cpu

VOCAB, SEQ, BATCH = 64, 8, 2
# Baseline parameter name -> flux parameter name (the norms live inside the fused layers).
NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


class _NoDropoutRNGTracker:
    """Stands in for megatron's CUDA RNG tracker on CPU; every dropout here has p = 0."""

    def fork(self, name="model-parallel-rng"):
        return contextlib.nullcontext()

    def is_initialized(self):
        return True


def _transformer_config(tp, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=4, num_query_groups=2,
                tensor_model_parallel_size=tp, sequence_parallel=tp > 1, normalization="RMSNorm",
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
                hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64, use_cpu_initialization=True,
                bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                apply_rope_fusion=False, gradient_accumulation_fusion=False)
    base.update(kw)
    return TransformerConfig(**base)


def _build_gpt(config, baseline: bool, **spec_kw):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from flux_layers.layers.spec import get_gpt_decoder_block_spec
    torch.manual_seed(1234)
    block = get_gpt_decoder_block_spec(config, baseline=baseline, **spec_kw)
    return GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def _flux_name(baseline_name: str) -> str:
    for old, new in NORM_NAMES.items():
        if baseline_name.endswith(old):
            return baseline_name[: -len(old)] + new
    return baseline_name


def _check_module_types(flux, baseline):
    from megatron.core import tensor_parallel as mtp
    from megatron.core.transformer.identity_op import IdentityOp

    from flux_layers.layers import (
        ColumnParallelLinear,
        LayerNormColumnParallelLinear,
        RMSNorm,
        RowParallelLinear,
        SDPAttention,
    )
    fl, bl = flux.decoder.layers[0], baseline.decoder.layers[0]
    assert type(fl.input_layernorm) is IdentityOp and type(fl.pre_mlp_layernorm) is IdentityOp
    assert type(fl.self_attention.linear_qkv) is LayerNormColumnParallelLinear
    assert type(fl.mlp.linear_fc1) is LayerNormColumnParallelLinear
    assert type(fl.self_attention.linear_proj) is RowParallelLinear and type(fl.mlp.linear_fc2) is RowParallelLinear
    assert type(bl.input_layernorm) is RMSNorm and type(bl.pre_mlp_layernorm) is RMSNorm
    assert type(bl.self_attention.linear_qkv) is mtp.ColumnParallelLinear
    assert type(bl.self_attention.linear_proj) is mtp.RowParallelLinear
    for layer in (fl, bl):
        assert type(layer.self_attention.core_attention) is SDPAttention
        assert type(layer.self_attention.q_layernorm) is RMSNorm
    assert type(flux.decoder.final_layernorm) is RMSNorm and type(baseline.decoder.final_layernorm) is RMSNorm
    assert not issubclass(ColumnParallelLinear, mtp.ColumnParallelLinear)


def _finalize_grads(model, group, config):
    """The all-reduce of megatron-core's finalize_model_grads over TP (SP-tagged and q/k-norm parameters)."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or \
                (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
            dist.all_reduce(p.grad, group=group)


def _check_models_agree(rank, tp, group, seed, **config_kw):
    from flux_layers.layers import OverlapConfig
    config = _transformer_config(tp, **config_kw)
    overlap = OverlapConfig(backend="reference", wgrad_input="regather")
    flux, baseline = _build_gpt(config, baseline=False, overlap=overlap), _build_gpt(config, baseline=True)
    _check_module_types(flux, baseline)
    assert flux.decoder.layers[1].mlp.linear_fc2.overlap is overlap

    flux_params, base_params = dict(flux.named_parameters()), dict(baseline.named_parameters())
    assert {_flux_name(n) for n in base_params} == set(flux_params)
    for name, p in base_params.items():  # same seed -> same weights
        torch.testing.assert_close(flux_params[_flux_name(name)], p, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    losses = []
    for model in (flux, baseline):
        loss = model(tokens, position_ids, None, labels=labels)
        loss.sum().backward()
        _finalize_grads(model, group, config)
        losses.append(loss.detach())
    assert torch.isfinite(losses[0]).all()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-10, atol=1e-10)
    for name, p in base_params.items():
        fp = flux_params[_flux_name(name)]
        assert fp.grad is not None and getattr(fp, "sequence_parallel", None) == getattr(p, "sequence_parallel", None)
        torch.testing.assert_close(fp.grad, p.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")

    # Distributed checkpoints interchange: the same checkpoint keys (ShardedTensor.key, after the baseline's
    # key map), shapes and offsets.
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    by_key = [{t.key: t for t in model.sharded_state_dict().values()} for model in (flux, baseline)]
    assert set(by_key[0]) == set(by_key[1]), set(by_key[0]) ^ set(by_key[1])
    for key, t in by_key[1].items():
        f = by_key[0][key]
        assert type(f) is type(t), key
        if isinstance(t, ShardedTensor):
            assert (f.local_shape, f.global_shape, f.global_offset, f.axis_fragmentations, f.replica_id) == \
                (t.local_shape, t.global_shape, t.global_offset, t.axis_fragmentations, t.replica_id), key


def _check_moe_builds(tp):
    from flux_layers.layers import ColumnParallelLinear, Norm, RowParallelLinear  # noqa: F401
    from flux_layers.layers.norm import RMSNorm
    config = _transformer_config(tp, num_moe_experts=2, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                                 moe_shared_expert_intermediate_size=32, qk_layernorm=False)
    model = _build_gpt(config, baseline=False)
    layer = model.decoder.layers[0]
    assert type(layer.pre_mlp_layernorm) is RMSNorm
    expert_fc1 = layer.mlp.experts.local_experts[0].linear_fc1
    assert type(expert_fc1) is ColumnParallelLinear and expert_fc1.is_expert and expert_fc1.explicit_expert_comm
    assert type(layer.mlp.shared_experts.linear_fc2) is RowParallelLinear


def _check_sdpa_matches_megatron(rank, tp):
    """SDPAttention == megatron-core's DotProductAttention (causal, GQA, fp64)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from flux_layers.layers import SDPAttention
    config = _transformer_config(tp, num_attention_heads=4, num_query_groups=2, kv_channels=8)
    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours, theirs = SDPAttention(**kw), DotProductAttention(**kw)
    g = torch.Generator().manual_seed(7)
    np_, ng = 4 // tp, 2 // tp
    q = torch.randn(SEQ, BATCH, np_, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(SEQ, BATCH, ng, 8, generator=g, dtype=torch.float64) for _ in range(2))
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    expected = theirs(q, k, v, causal)
    got = ours(q, k, v, None)
    assert got.shape == (SEQ, BATCH, np_ * 8)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # A padding mask is applied (True = masked out), and differs from no mask.
    padding = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    padding[:, :, :, SEQ // 2:] = True
    masked = SDPAttention(**dict(kw, attn_mask_type=AttnMaskType.padding))
    expected = DotProductAttention(**dict(kw, attn_mask_type=AttnMaskType.padding))(q, k, v, padding)
    torch.testing.assert_close(masked(q, k, v, padding), expected, rtol=1e-10, atol=1e-10)


def _worker(rank, world, seed):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    group = megatron_on_cpu(world)
    mrandom._CUDA_RNG_STATE_TRACKER = _NoDropoutRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _check_models_agree(rank, world, group, seed)
    _check_sdpa_matches_megatron(rank, world)
    _check_moe_builds(world)
    # TP = 1 (data parallel over the same processes): no sequence parallelism, megatron semantics.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    _check_models_agree(rank, 1, parallel_state.get_tensor_model_parallel_group(), seed + 1)
    _check_sdpa_matches_megatron(rank, 1)


def test_gpt_specs_build_and_agree():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_distributed(_worker, 2, seed)


def test_spec_and_attention_errors():
    from megatron.core.transformer.enums import AttnMaskType

    from flux_layers.layers import OverlapConfig, SDPAttention
    from flux_layers.layers.spec import get_gpt_decoder_block_spec
    config = _transformer_config(1)
    with pytest.raises(ValueError, match=r"overlap= applies to the flux layers only; got baseline=True"):
        get_gpt_decoder_block_spec(config, baseline=True, overlap=OverlapConfig())
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
              pg_collection=SimpleNamespace(tp=None))
    with pytest.raises(ValueError, match=r"config.window_size=\(4, 0\)"):
        SDPAttention(_transformer_config(1, window_size=(4, 0)), **kw)
    with pytest.raises(ValueError, match=r"attn_mask_type=.*causal_bottom_right"):
        SDPAttention(config, **dict(kw, attn_mask_type=AttnMaskType.causal_bottom_right))
    attention = SDPAttention(config, **kw)
    q = torch.zeros(2, 1, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"attention_bias is not supported"):
        attention(q, q[:, :, :2], q[:, :, :2], None, attention_bias=torch.zeros(1))
