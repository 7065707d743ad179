"""FP8 linears (megatron-core's fp8 settings) on 2 gloo processes with the reference backend, against an fp64
reference of the same quantized math: the same casts (``ops.fp8.quantize`` per rank-held tensor, per-shard scales
under SP, the common-scale re-cast for wgrad), then exact matmuls of the dequantized operands.

Every case checks the output and every gradient (dX, dW or ``main_grad``, dbias) and that the layer really ran FP8
(``layer.fp8_state.last``: the operand dtypes each GEMM ran with). With FP8 silently off the errors would be those
of the quantization itself (several percent), far above the tolerance here (one bfloat16 rounding of the FP8 GEMMs'
outputs and partial sums).
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flux_layers.devtools.launch import run_distributed
from flux_layers.ops.fp8 import ScaledTensor, dequantize, quantize, transpose_blocks_to_common_scale
from tests.cpu.test_layers import megatron_on_cpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REL = 2.0**-7   # relative (Frobenius) error allowed: bf16 rounding of the FP8 GEMMs' outputs and partials


@dataclass(frozen=True)
class Case:
    kind: str                   # 'column' | 'row' | 'norm' (LayerNormColumnParallelLinear)
    sp: bool
    fmt: str = "hybrid"
    wgrad: bool = True          # fp8_wgrad
    bias: bool = True
    ga: bool = False            # gradient_accumulation_fusion into main_grad
    frozen: bool = False
    wgrad_input: str = "keep"   # column SP
    input_is_parallel: bool = True  # row
    tp1: bool = False           # a group of one rank (TP = 1)
    seq: int = 16               # s; tokens M = s * BATCH
    dtype: torch.dtype = torch.float32
    k: int = 0                  # features (0: SIZES)
    n: int = 0

    @property
    def sizes(self) -> tuple[int, int]:
        return (self.k, self.n) if self.k else SIZES[self.kind]


BATCH = 2
SIZES = {"column": (32, 64), "norm": (32, 64), "row": (64, 48)}   # (K, N): per-rank features multiples of 16


def _cases():
    for kind, sp, fmt, wgrad in itertools.product(("column", "row"), (True, False), ("hybrid", "e4m3"),
                                                  (True, False)):
        yield Case(kind, sp, fmt, wgrad)
    yield Case("column", True, ga=True)
    yield Case("column", True, ga=True, wgrad=False)
    yield Case("row", True, ga=True)
    yield Case("row", False, ga=True, wgrad=False)
    yield Case("column", True, wgrad_input="regather")
    yield Case("column", True, bias=False, frozen=True)
    yield Case("row", True, frozen=True)
    yield Case("row", False, input_is_parallel=False)
    yield Case("column", False, tp1=True)
    yield Case("row", False, tp1=True, ga=True)
    yield Case("column", True, seq=6)      # 12 tokens: not a multiple of 16, wgrad falls back to 16 bits
    yield Case("row", True, seq=6)
    yield Case("column", True, dtype=torch.bfloat16)  # bf16 bias: added in the FP8 GEMM's epilogue
    yield Case("row", True, dtype=torch.bfloat16, fmt="e4m3")
    yield Case("norm", True)
    yield Case("norm", False, fmt="e4m3", wgrad=False)


def fp8_config(tp: int, sp: bool, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=max(4, tp), tensor_model_parallel_size=tp,
                sequence_parallel=sp, use_cpu_initialization=True, params_dtype=torch.float32, fp8="hybrid",
                fp8_recipe="tensorwise", normalization="RMSNorm", gradient_accumulation_fusion=False)
    base.update(kw)
    return TransformerConfig(**base)


def _deq(t: torch.Tensor, dtype) -> torch.Tensor:
    """fp64 values of ``t`` cast to FP8 with one tensor-wise current scale (what the layers' casts give)."""
    return dequantize(quantize(t.float(), dtype)).double()


def _deq_blocks(blocks, dtype) -> torch.Tensor:
    """Per-shard casts, concatenated along the rows: what an all-gather of per-shard-scaled FP8 rows holds."""
    return torch.cat([_deq(b, dtype) for b in blocks])


def _deq_common_t(blocks, dtype) -> torch.Tensor:
    """The wgrad operand of gathered per-shard-scaled rows: transposed and re-cast to one common scale, [K, M]."""
    qs = [quantize(b.float(), dtype) for b in blocks]
    gathered = ScaledTensor(torch.cat([q.data for q in qs]), torch.cat([q.scale.reshape(1) for q in qs]))
    common = transpose_blocks_to_common_scale(gathered)
    return common.data.double() * common.scale.double()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(out, ref, what, rel=REL):
    assert out is not None, f"{what}: missing"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = _rel(out, ref)
    assert err < rel, f"{what}: relative error {err:.3e} >= {rel:.1e}"


def _inputs(case: Case, tp: int, seed: int):
    """Global x [s, b, K] (the two halves of the sequence at different magnitudes, so per-shard scales differ),
    w [N, K], b [N], dy [s, b, N] (likewise), identical on every rank."""
    k, n = case.sizes
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.seq, BATCH, k, generator=g, dtype=torch.float64)
    x[case.seq // 2:] *= 6.0
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.1
    b = torch.randn(n, generator=g, dtype=torch.float64)
    dy = torch.randn(case.seq, BATCH, n, generator=g, dtype=torch.float64)
    dy[: case.seq // 2] *= 0.01
    main_grad0 = torch.randn(n, k, generator=g, dtype=torch.float64)
    # What the layer holds: the values in its dtype (a bf16 input is rounded before its FP8 cast).
    x, w, b, dy = (t.to(case.dtype).double() for t in (x, w, b, dy))
    return x, w, b, dy, main_grad0


def _reference(case: Case, x, w, b, dy, rank: int, tp: int):
    """This rank's expected (y, dx, dw, db) in fp64 from the same casts as the layer's (module docstring)."""
    fwd, grad = E4M3, (E5M2 if case.fmt == "hybrid" else E4M3)
    m = x.shape[0] * x.shape[1]
    x2, dy2 = x.reshape(m, -1), dy.reshape(m, -1)
    fp8_wgrad = case.wgrad and m % 16 == 0
    b = b if case.bias else torch.zeros_like(b)
    if case.kind in ("column", "norm"):
        w_r, b_r = w.chunk(tp)[rank], b.chunk(tp)[rank]
        w_hat = _deq(w_r, fwd)
        x_in = x2
        if case.kind == "norm":   # the norm (gamma = 1) runs before the linear: dX goes through its backward
            x_in = x2.clone().requires_grad_()
            x2 = F.rms_norm(x_in, (x2.shape[-1],), eps=1e-5).to(case.dtype).double()   # the norm's output dtype
        x_blocks = x2.chunk(tp) if case.sp else [x2]
        x_hat = _deq_blocks(x_blocks, fwd)                         # AG(x8), per-shard scales
        y = x_hat @ w_hat.t() + b_r
        dy_r = dy2.chunk(tp, dim=1)[rank]                          # [M, N/tp]
        dx = sum(_deq(d, grad) @ _deq(ww, fwd) for d, ww in zip(dy2.chunk(tp, dim=1), w.chunk(tp)))
        if case.kind == "norm":
            dx = torch.autograd.grad(x2, x_in, dx)[0]
            x2, x_hat = x2.detach(), x_hat.detach()
            y = y.detach()
        if case.sp:
            dx = dx.chunk(tp)[rank]
        dw = _deq(dy_r, grad).t() @ _deq_common_t(x_blocks, fwd).t() if fp8_wgrad else dy_r.t() @ x_hat
        return y, dx, dw, dy_r.sum(0)
    # row: x and w split along K; y summed over ranks (reduce-scattered under SP)
    k_tp = x2.shape[1] // tp
    x_r = x2[:, rank * k_tp:(rank + 1) * k_tp]
    y = sum(_deq(x2[:, r * k_tp:(r + 1) * k_tp], fwd) @ _deq(w[:, r * k_tp:(r + 1) * k_tp], fwd).t()
            for r in range(tp)) + b
    dy_blocks = dy2.chunk(tp) if case.sp else [dy2]
    dy_hat = _deq_blocks(dy_blocks, grad)                         # AG(dY8), per-shard scales
    w_hat = _deq(w[:, rank * k_tp:(rank + 1) * k_tp], fwd)
    dx = dy_hat @ w_hat
    x_hat = _deq(x_r, fwd)
    # 16-bit wgrad: under SP from the dgrad's AG(dY8), dequantized (no second all-gather); else from dY itself.
    dw = _deq_common_t(dy_blocks, grad) @ x_hat if fp8_wgrad else (dy_hat if case.sp else dy2).t() @ x_hat
    if case.sp:
        y = y.chunk(tp)[rank]
    return y, dx, dw, dy2.sum(0)


def _build(case: Case, tp: int, group, config_kw=None, backend: str = "reference"):
    from flux_layers.layers import (
        ColumnParallelLinear,
        LayerNormColumnParallelLinear,
        OverlapConfig,
        RowParallelLinear,
    )
    k, n = case.sizes
    config = fp8_config(tp, case.sp and not case.tp1, fp8=case.fmt, fp8_wgrad=case.wgrad, params_dtype=case.dtype,
                        gradient_accumulation_fusion=case.ga, **(config_kw or {}))
    kw = dict(config=config, init_method=torch.nn.init.zeros_, bias=case.bias, skip_bias_add=False, tp_group=group,
              overlap=OverlapConfig(backend=backend, wgrad_input=case.wgrad_input))
    if case.kind == "column":
        return ColumnParallelLinear(k, n, gather_output=False, **kw)
    if case.kind == "norm":
        return LayerNormColumnParallelLinear(k, n, gather_output=False, is_expert=False, **kw)
    return RowParallelLinear(k, n, input_is_parallel=case.input_is_parallel, **kw)


def _run_case(case: Case, rank: int, world: int, group, seed: int, device: str = "cpu",
              backend: str = "reference") -> dict:
    """Run one case, check it against the fp64 reference; returns what it computed (output and gradients)."""
    tp = 1 if case.tp1 else world
    rank_in = 0 if case.tp1 else rank
    where = f"rank {rank} {backend} {case}"
    x, w, b, dy, main_grad0 = _inputs(case, tp, seed)
    y_ref, dx_ref, dw_ref, db_ref = _reference(case, x, w, b, dy, rank_in, tp)
    layer = _build(case, tp, group, backend=backend).to(device)
    sp = case.sp and tp > 1
    column = case.kind != "row"
    if column:
        w_local, b_local = w.chunk(tp)[rank_in], b.chunk(tp)[rank_in]
        x_local = x.chunk(tp)[rank_in] if sp else x
        dy_local = dy.chunk(tp, dim=2)[rank_in]
    else:
        k_tp = w.shape[1] // tp
        w_local, b_local = w[:, rank_in * k_tp:(rank_in + 1) * k_tp], b
        x_local = x[..., rank_in * k_tp:(rank_in + 1) * k_tp] if case.input_is_parallel else x
        dy_local = dy.chunk(tp)[rank_in] if sp else dy
    with torch.no_grad():
        layer.weight.copy_(w_local)
        if case.bias:
            layer.bias.copy_(b_local)
    if case.frozen:
        layer.weight.requires_grad_(False)
    if case.ga:
        mg = main_grad0.chunk(tp)[rank_in] if column else main_grad0[:, rank_in * k_tp:(rank_in + 1) * k_tp]
        layer.weight.main_grad = mg.float().to(device)
        layer.weight.grad_added_to_main_grad = False
    xl = x_local.to(device, case.dtype).requires_grad_()
    out, out_bias = layer(xl)
    assert out_bias is None and out.dtype == case.dtype, where
    out.backward(dy_local.to(device, case.dtype))
    rel = REL if case.dtype == torch.float32 else 2.0**-6   # bf16 activations: one more rounding of each result
    if case.kind == "row" and sp:
        dist.all_reduce(layer.bias.grad, group=group)  # finalize_model_grads' SP all-reduce of the bias
    _check(out.detach().reshape(-1, out.shape[-1]).cpu(), y_ref, where + " output", rel)
    dx = xl.grad.cpu()
    dx_ref_shaped = dx_ref.reshape(dx.shape) if dx.numel() == dx_ref.numel() else None
    if case.kind == "row" and not case.input_is_parallel:
        dx_ref_shaped = torch.cat([_reference(case, x, w, b, dy, r, tp)[1] for r in range(tp)], dim=1).reshape(
            dx.shape)
    _check(dx, dx_ref_shaped, where + " dgrad", rel)
    if case.bias:
        _check(layer.bias.grad.cpu(), db_ref, where + " dbias", 1e-5 if case.dtype == torch.float32 else 2.0**-7)
    if case.frozen:
        assert layer.weight.grad is None, where
    elif case.ga:
        assert layer.weight.grad_added_to_main_grad is True, where
        _check((layer.weight.main_grad - mg.float().to(device)).cpu(), dw_ref, where + " main_grad", rel)
    else:
        _check(layer.weight.grad.cpu(), dw_ref, where + " wgrad", rel)
    # It ran FP8: every GEMM wrote the dtypes it ran with.
    grad_name = "float8_e5m2" if case.fmt == "hybrid" else "float8_e4m3fn"
    last = layer.fp8_state.last
    assert last["fprop"] == "float8_e4m3fn x float8_e4m3fn", (where, last)
    assert last["dgrad"] == f"{grad_name} x float8_e4m3fn", (where, last)
    m = x.shape[0] * x.shape[1]
    if case.frozen:
        assert "wgrad" not in last, (where, last)
    elif case.wgrad and m % 16 == 0:
        assert last["wgrad"] == f"{grad_name} x float8_e4m3fn", (where, last)
        assert layer.last_paths["wgrad"].reason.startswith("FP8"), (where, layer.last_paths)
    else:
        act = str(case.dtype).replace("torch.", "")
        assert last["wgrad"] == f"{act} x {act}", (where, last)
        assert layer.last_paths["wgrad"].path == "local", (where, layer.last_paths)
    assert all(layer.last_paths[p].reason.startswith("FP8") for p in ("fprop", "dgrad")), (where, layer.last_paths)
    wgrad = None if case.frozen else (layer.weight.main_grad if case.ga else layer.weight.grad)
    return {"output": out.detach(), "dgrad": xl.grad, "wgrad": wgrad,
            "dbias": layer.bias.grad if case.bias else None, "paths": dict(layer.last_paths)}


def _numerics_worker(rank, world, seed):
    group = megatron_on_cpu(world)
    solo = [dist.new_group([r]) for r in range(world)]   # TP = 1 groups (every rank makes every group)
    for i, case in enumerate(_cases()):
        _run_case(case, rank, world, solo[rank] if case.tp1 else group, seed + i)


def test_fp8_layers_match_the_quantized_reference():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_distributed(_numerics_worker, 2, seed)


def _numerics_worker_tp4(rank, world, seed):
    group = megatron_on_cpu(world)
    for i, case in enumerate((Case("column", True, seq=32), Case("row", True, seq=32, fmt="e4m3"),
                              Case("norm", True, seq=32, dtype=torch.bfloat16))):
        _run_case(case, rank, world, group, seed + i)


def test_fp8_sequence_parallel_layers_at_tp4():
    """The sequence-parallel linears over four ranks (per-shard scales of four shards, the reduce-scatter's four
    partials): what the GPU tests run at TP = 4 and 8 with ranks sharing one GPU, here on the reference backend."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_distributed(_numerics_worker_tp4, 4, seed)


# ---- weight cache, first/last layers, recipe errors, checkpoints --------------------------------------------------

def _step(layer, x, dy, micro_batches: int, first_microbatch_signal: bool = False):
    for i in range(micro_batches):
        if first_microbatch_signal and i == 0:
            layer.is_first_microbatch = True   # what megatron's MegatronModule.set_is_first_microbatch does
        out, _ = layer(x.clone().requires_grad_())
        out.backward(dy)


def _check_weight_cache(rank, tp, group):
    case = Case("column", True)
    layer = _build(case, tp, group)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(8, BATCH, 32)
    dy = torch.randn(16, BATCH, 32)
    cache = layer.fp8_state.weight_cache
    _step(layer, x, dy, 3)
    assert cache.casts == 1, "one cast for the three micro-batches of a step"
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    opt.step()                                    # in place: bumps the version counter
    _step(layer, x, dy, 3)
    assert cache.casts == 2, "the optimizer step is seen"
    q_before = cache.get(layer.weight, E4M3, 0, refresh=False, with_transpose=True).q
    with torch.no_grad():
        layer.weight.data.mul_(2.0)               # through .data: no version bump ...
    _step(layer, x, dy, 2)
    assert cache.casts == 2
    _step(layer, x, dy, 2, first_microbatch_signal=True)   # ... megatron's first-micro-batch signal catches it
    assert cache.casts == 3
    q_after = cache.get(layer.weight, E4M3, 0, refresh=False, with_transpose=True).q
    torch.testing.assert_close(dequantize(q_after), 2 * dequantize(q_before), rtol=0, atol=0)
    with torch.no_grad():
        layer.weight.copy_(layer.weight * 0.5)
    out, _ = layer(x)
    assert cache.casts == 4
    # The output uses the current weight (against the unquantized product: FP8 error only).
    ref = F.linear(reference_all_gather(x.reshape(-1, 32), group), layer.weight.detach(), layer.bias.detach())
    assert _rel(out.detach().reshape(-1, 32), ref.double()) < 0.1

    frozen = _build(case, tp, group)
    frozen.weight.requires_grad_(False)
    for _ in range(3):
        _step(frozen, x, dy, 2)
    assert frozen.fp8_state.weight_cache.casts == 1, "a frozen weight is cast once"


def reference_all_gather(x_shard_m, group):
    from flux_layers.ops import reference
    return reference.all_gather_rows(x_shard_m, group)


def _check_first_last_layers(rank, tp, group):
    from flux_layers.layers.fp8_recipe import is_bf16_layer
    cfg = dict(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    case = Case("row", True)
    x = torch.randn(16, BATCH, 32)
    layer = _build(case, tp, group, cfg)
    with pytest.raises(RuntimeError, match="assign_layer_numbers"):
        layer(x)
    for number, bf16 in ((1, True), (2, False), (3, False), (4, True)):
        layer.set_layer_number(number)
        out, _ = layer(x)
        assert bool(layer.fp8_state.last) != bf16, (number, layer.fp8_state.last)
        assert (layer.last_paths["fprop"].reason.startswith("FP8")) != bf16, (number, layer.last_paths)
    # Same rule as megatron-core's (0-based layer_no).
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    config = layer.config
    for start, end in ((0, 0), (1, 2), (2, 1)):
        config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16 = start, end
        for number in range(1, 5):
            assert is_bf16_layer(config, number) == is_first_last_bf16_layer(config, number - 1)


def _check_recipe_errors(rank, tp, group):
    from flux_layers.layers import ColumnParallelLinear, RowParallelLinear
    for recipe in ("delayed", "mxfp8", "blockwise"):
        with pytest.raises(ValueError, match=rf"config.fp8_recipe='{recipe}' is not supported .*'tensorwise'"):
            _build(Case("column", True), tp, group, {"fp8_recipe": recipe})
    config = fp8_config(tp, True)
    config.fp8_recipe = "custom"
    with pytest.raises(ValueError, match="fp8_recipe='custom' is not supported"):
        RowParallelLinear(64, 48, config=config, init_method=torch.nn.init.zeros_, bias=False,
                          input_is_parallel=True, skip_bias_add=False, tp_group=group)
    config = fp8_config(tp, True)
    config.fp8 = "e5m2"
    with pytest.raises(ValueError, match=r"config.fp8='e5m2' is not supported; expected None or one of"):
        ColumnParallelLinear(32, 64, config=config, init_method=torch.nn.init.zeros_, tp_group=group)
    config = fp8_config(tp, True)
    config.fp8_param = True
    with pytest.raises(ValueError, match="fp8_param=True"):
        ColumnParallelLinear(32, 64, config=config, init_method=torch.nn.init.zeros_, tp_group=group)
    # Features an FP8 GEMM cannot take: a clear error naming them.
    layer = ColumnParallelLinear(32, 40, config=fp8_config(tp, True), init_method=torch.nn.init.zeros_,
                                 tp_group=group)
    with pytest.raises(ValueError, match="multiples of 16; got input_size=32, output_size_per_partition=20"):
        layer(torch.randn(8, BATCH, 32))
    # Expert linears stay 16-bit, and say so.
    with pytest.warns(UserWarning, match="not built for expert linears"):
        expert = ColumnParallelLinear(32, 64, config=fp8_config(tp, False), init_method=torch.nn.init.zeros_,
                                      is_expert=True, tp_group=group)
    assert expert.fp8_state is None


def _check_checkpoints(rank, tp, group):
    """FP8 layers save and load the bf16 layers' state dict: same keys, dtypes and shapes, no FP8 tensors; a
    16-bit state loads into an FP8 layer (its cache is refreshed) and back."""
    from flux_layers.layers import RowParallelLinear
    fp8_layer = _build(Case("row", True), tp, group)
    plain = RowParallelLinear(64, 48, config=fp8_config(tp, True, fp8=None), init_method=torch.nn.init.zeros_,
                              bias=True, input_is_parallel=True, skip_bias_add=False, tp_group=group)
    assert plain.fp8_state is None
    x = torch.randn(16, BATCH, 32)
    fp8_layer(x)
    a, b = fp8_layer.state_dict(), plain.state_dict()
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype == torch.float32 and a[key].shape == b[key].shape, key
    with torch.no_grad():
        plain.weight.normal_()
        plain.bias.normal_()
    casts = fp8_layer.fp8_state.weight_cache.casts
    fp8_layer.load_state_dict(plain.state_dict())
    out, _ = fp8_layer(x)
    assert fp8_layer.fp8_state.weight_cache.casts == casts + 1
    assert torch.equal(fp8_layer.weight, plain.weight)
    ref, _ = plain(x)
    assert 0 < _rel(out.detach(), ref.detach().double()) < 0.1   # FP8 of the loaded weights, not the old ones
    plain.load_state_dict(fp8_layer.state_dict())
    assert torch.equal(fp8_layer.weight, plain.weight)


def _check_baseline_warning_and_layer_numbers(rank, tp, group):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as mrandom

    from flux_layers.layers.fp8_recipe import assign_layer_numbers
    from flux_layers.layers.spec import get_gpt_decoder_block_spec
    from tests.cpu.test_spec import _NoDropoutRNGTracker
    mrandom._CUDA_RNG_STATE_TRACKER = _NoDropoutRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    config = fp8_config(tp, True, ffn_hidden_size=128, add_bias_linear=False, gated_linear_unit=True,
                        activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
                        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                        apply_rope_fusion=False, first_last_layers_bf16=True)
    with pytest.warns(UserWarning, match="does nothing with megatron-core's own linears"):
        get_gpt_decoder_block_spec(config, baseline=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        block = get_gpt_decoder_block_spec(config)   # the flux spec: no warning
    model = GPTModel(config, block, vocab_size=64, max_sequence_length=32, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    assert assign_layer_numbers(model) == 4 * 4   # qkv, proj, fc1, fc2 of every layer
    numbers = {name: m.fp8_state.layer_number for name, m in model.named_modules()
               if getattr(m, "fp8_state", None) is not None}
    assert numbers["decoder.layers.2.mlp.linear_fc2"] == 3
    assert numbers["decoder.layers.0.self_attention.linear_qkv"] == 1
    tokens = torch.randint(0, 64, (BATCH, 32))
    position_ids = torch.arange(32).expand(BATCH, -1)
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    fp8_ran = {name for name, m in model.named_modules() if getattr(m, "fp8_state", None) is not None
               and m.fp8_state.last}
    assert fp8_ran == {f"decoder.layers.{i}.{n}" for i in (1, 2) for n in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}, fp8_ran


def _behaviour_worker(rank, world):
    group = megatron_on_cpu(world)
    _check_weight_cache(rank, world, group)
    _check_first_last_layers(rank, world, group)
    _check_recipe_errors(rank, world, group)
    _check_checkpoints(rank, world, group)
    _check_baseline_warning_and_layer_numbers(rank, world, group)


def test_fp8_weight_cache_layer_numbers_errors_and_checkpoints():
    run_distributed(_behaviour_worker, 2)


def test_no_transformer_engine_import():
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    for path in list((root / "flux_layers").rglob("*.py")) + list((root / "examples").rglob("*.py")):
        text = path.read_text()
        assert "import transformer_engine" not in text and "from transformer_engine" not in text, path
