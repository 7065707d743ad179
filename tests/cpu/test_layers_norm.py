"""Sequence-parallel norms and LayerNormColumnParallelLinear against unsharded fp64 math, 2 gloo processes.

Norm weights are replicated and each rank's gradient covers its own tokens; the tests all-reduce the gradients
of parameters tagged ``sequence_parallel`` (what megatron-core's ``finalize_model_grads`` does) before
comparing. LayerNormColumnParallelLinear is also compared with :class:`Norm` followed by megatron-core's own
``ColumnParallelLinear`` (the baseline spec's composition).
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed
from tests.cpu.test_layers import megatron_on_cpu

TOL = dict(rtol=1e-10, atol=1e-10)
EPS = 1e-5


def _config(tp, sp, normalization, zero_centered=False):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=tp,
                             sequence_parallel=sp, normalization=normalization, layernorm_epsilon=EPS,
                             layernorm_zero_centered_gamma=zero_centered, use_cpu_initialization=True,
                             params_dtype=torch.float64)


def _norm_fp64(x, normalization, gamma, beta):
    """Written out, independent of F.rms_norm / F.layer_norm."""
    if normalization == "RMSNorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * gamma
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + EPS) * gamma + beta


def _finalize_sp_grads(module, group):
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def _shard(t, dim, rank, tp):
    return t.chunk(tp, dim=dim)[rank].contiguous()


def _check_norms(rank, tp, group, g):
    from flux_layers.layers import LayerNorm, Norm, RMSNorm
    s, b, h = 2 * tp, 3, 8
    for normalization, sp, zero_centered in itertools.product(("RMSNorm", "LayerNorm"), (False, True), (False, True)):
        config = _config(tp, sp, normalization, zero_centered)
        norm = Norm(config, h, eps=EPS)
        assert type(norm) is (RMSNorm if normalization == "RMSNorm" else LayerNorm)
        assert all(p.sequence_parallel is sp for p in norm.parameters())
        x, dy = torch.randn(s, b, h, generator=g, dtype=torch.float64), torch.randn(s, b, h, generator=g,
                                                                                    dtype=torch.float64)
        gamma, beta = torch.randn(h, generator=g, dtype=torch.float64), torch.randn(h, generator=g,
                                                                                    dtype=torch.float64)
        with torch.no_grad():
            norm.weight.copy_(gamma - 1 if zero_centered else gamma)
            if normalization == "LayerNorm":
                norm.bias.copy_(beta)
        ref = [t.clone().requires_grad_() for t in (x, gamma, beta)]
        y_ref = _norm_fp64(*ref[:1], normalization, *ref[1:])
        y_ref.backward(dy)
        rows = (lambda t: _shard(t, 0, rank, tp)) if sp else (lambda t: t)
        xl = rows(x).clone().requires_grad_()
        y = norm(xl)
        y.backward(rows(dy))
        if sp:
            _finalize_sp_grads(norm, group)
        torch.testing.assert_close(y, rows(y_ref.detach()), **TOL)
        torch.testing.assert_close(xl.grad, rows(ref[0].grad), **TOL)
        torch.testing.assert_close(norm.weight.grad, ref[1].grad, **TOL)
        if normalization == "LayerNorm":
            torch.testing.assert_close(norm.bias.grad, ref[2].grad, **TOL)


def _check_layernorm_linear(rank, tp, group, g):
    from megatron.core import tensor_parallel as mtp

    from flux_layers.layers import LayerNormColumnParallelLinear, Norm, OverlapConfig
    s, b, h, n = 2 * tp, 3, 8, 4 * tp
    cases = itertools.product(("RMSNorm", "LayerNorm"), (False, True), ((False, False), (True, False), (True, True)),
                              ("keep", "regather"))
    for normalization, sp, (bias, skip), wgrad_input in cases:
        config = _config(tp, sp, normalization)
        kw = dict(config=config, init_method=torch.nn.init.zeros_, gather_output=False, bias=bias,
                  skip_bias_add=skip, is_expert=False, tp_group=group)
        fused = LayerNormColumnParallelLinear(h, n, **kw, overlap=OverlapConfig(backend="reference",
                                                                                wgrad_input=wgrad_input))
        names = {"weight", "bias", "layer_norm_weight", "layer_norm_bias"} & {k for k, _ in fused.named_parameters()}
        assert set(fused.state_dict()) == names | {"_extra_state"}
        assert fused.layer_norm_weight.sequence_parallel is sp
        assert (fused.layer_norm_bias is None) == (normalization == "RMSNorm")
        baseline_norm, baseline_linear = Norm(config, h, eps=EPS), mtp.ColumnParallelLinear(h, n, **kw)

        x, dy = torch.randn(s, b, h, generator=g, dtype=torch.float64), torch.randn(s, b, n, generator=g,
                                                                                    dtype=torch.float64)
        gamma, beta, w = (torch.randn(h, generator=g, dtype=torch.float64), torch.randn(h, generator=g,
                          dtype=torch.float64), torch.randn(n, h, generator=g, dtype=torch.float64))
        bvec = torch.randn(n, generator=g, dtype=torch.float64)
        with torch.no_grad():
            for lin, norm_w, norm_b in ((fused, fused.layer_norm_weight, fused.layer_norm_bias),
                                        (baseline_linear, baseline_norm.weight, getattr(baseline_norm, "bias", None))):
                lin.weight.copy_(_shard(w, 0, rank, tp))
                norm_w.copy_(gamma)
                if norm_b is not None:
                    norm_b.copy_(beta)
                if bias:
                    lin.bias.copy_(_shard(bvec, 0, rank, tp))
        ref = [t.clone().requires_grad_() for t in (x, gamma, beta, w, bvec)]
        y_ref = torch.nn.functional.linear(_norm_fp64(ref[0], normalization, ref[1], ref[2]), ref[3],
                                           ref[4] if bias and not skip else None)
        y_ref.backward(dy)

        rows = (lambda t: _shard(t, 0, rank, tp)) if sp else (lambda t: t)
        outs = []
        for run in ("fused", "baseline"):
            xl = rows(x).clone().requires_grad_()
            if run == "fused":
                y, y_bias = fused(xl)
            else:
                y, y_bias = baseline_linear(baseline_norm(xl))
            y.backward(_shard(dy, 2, rank, tp))
            outs.append((y, y_bias, xl.grad))
        if sp:
            _finalize_sp_grads(fused, group)
            _finalize_sp_grads(baseline_norm, group)

        (y, y_bias, dx), (y_base, _, dx_base) = outs
        where = f"{normalization} sp={sp} bias={bias} skip_bias_add={skip} wgrad_input={wgrad_input}"
        msg = lambda m: f"{where}: {m}"  # noqa: E731
        torch.testing.assert_close(y, _shard(y_ref.detach(), 2, rank, tp), **TOL, msg=msg)
        torch.testing.assert_close(dx, rows(ref[0].grad), **TOL, msg=msg)
        torch.testing.assert_close(fused.weight.grad, _shard(ref[3].grad, 0, rank, tp), **TOL, msg=msg)
        torch.testing.assert_close(fused.layer_norm_weight.grad, ref[1].grad, **TOL, msg=msg)
        if normalization == "LayerNorm":
            torch.testing.assert_close(fused.layer_norm_bias.grad, ref[2].grad, **TOL, msg=msg)
        assert (y_bias is fused.bias) if skip else y_bias is None
        if bias and not skip:
            torch.testing.assert_close(fused.bias.grad, _shard(ref[4].grad, 0, rank, tp), **TOL, msg=msg)
        # The same numbers as the baseline spec's separate norm + megatron-core linear.
        torch.testing.assert_close(y, y_base, rtol=1e-12, atol=1e-12, msg=msg)
        torch.testing.assert_close(dx, dx_base, rtol=1e-12, atol=1e-12, msg=msg)
        torch.testing.assert_close(fused.layer_norm_weight.grad, baseline_norm.weight.grad, rtol=1e-12, atol=1e-12,
                                   msg=msg)


def _check_sharded_state_dict(rank, tp, group):
    from megatron.core import parallel_state

    from flux_layers.layers import LayerNormColumnParallelLinear
    config = _config(tp, True, "LayerNorm")
    layer = LayerNormColumnParallelLinear(8, 4 * tp, config=config, init_method=torch.nn.init.zeros_,
                                          gather_output=False, bias=True, skip_bias_add=False, is_expert=False,
                                          tp_group=group)
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    sd = layer.sharded_state_dict(prefix="l.", metadata=metadata)
    assert set(sd) == {"l.weight", "l.bias", "l.layer_norm_weight", "l.layer_norm_bias", "l._extra_state"}
    assert sd["l.weight"].global_shape == (4 * tp, 8) and sd["l.weight"].global_offset == (4 * rank, 0)
    assert sd["l.bias"].global_shape == (4 * tp,)
    # Replicated over TP: the full shape, and only TP rank 0 is the main replica.
    assert sd["l.layer_norm_weight"].global_shape == (8,) and sd["l.layer_norm_weight"].global_offset == (0,)
    assert sd["l.layer_norm_weight"].replica_id[1] == rank


def _check_errors(tp):
    from flux_layers.layers import LayerNormColumnParallelLinear, Norm
    config = _config(tp, False, "RMSNorm")
    config.normalization = "L2Norm"
    with pytest.raises(ValueError, match=r"config.normalization='L2Norm' is not supported"):
        Norm(config, 8)
    with pytest.raises(ValueError, match=r"LayerNormColumnParallelLinear: config.normalization='L2Norm'"):
        LayerNormColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_, gather_output=False,
                                      bias=False, skip_bias_add=False, is_expert=False)


def _worker(rank, tp, seed):
    group = megatron_on_cpu(tp)
    g = torch.Generator().manual_seed(seed)
    _check_norms(rank, tp, group, g)
    _check_layernorm_linear(rank, tp, group, g)
    _check_sharded_state_dict(rank, tp, group)
    _check_errors(tp)


def test_sequence_parallel_norms_and_layernorm_linear():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_distributed(_worker, 2, seed)
