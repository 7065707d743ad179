"""FP8 autograd functions of the parallel linears, and the layers' FP8 forward (the recipe: :mod:`fp8_recipe`).

Every GEMM takes both operands K-major (FP8 needs the 'nt' layout): the weight's FP8 copy ``W8`` [out, in] for
fprop, its transpose ``W8^T`` [in, out] for dgrad (both cached once per optimizer step: :mod:`fp8_weights`), and
for wgrad both operands transposed so that the tokens M are the GEMM's K. Shapes on one rank, M the gathered
tokens; ``[tp]`` marks per-shard scales (one per source rank's block of rows):

| function | pass | GEMM (this rank) |
|---|---|---|
| :class:`Fp8AllGatherLinear` (column SP) | fprop | y [M, N/tp] = ``ag_gemm(x8_shard_m [M/tp, K], W8 [N/tp, K])`` |
| | dgrad | dx_shard_m [M/tp, K] = ``gemm_rs(dY8 [M, N/tp], W8^T [K, N/tp])`` |
| | wgrad | dW [N/tp, K] = ``gemm(dY8^T [N/tp, M], AG(x8)^T [K, M])`` |
| :class:`Fp8ReduceScatterLinear` (row SP) | fprop | y_shard_m [M/tp, N] = ``gemm_rs(x8_shard_k [M, K/tp], W8)`` |
| | dgrad | dx_shard_k [M, K/tp] = ``ag_gemm(dY8_shard_m [M/tp, N], W8^T [K/tp, N])``, returns AG(dY8) |
| | wgrad | dW [N, K/tp] = ``gemm(AG(dY8)^T [N, M], x8^T [K/tp, M])`` (W8 is [N, K/tp]) |
| :class:`Fp8LocalLinear` (no SP, TP = 1) | fprop | y [M, N] = ``gemm(x8 [M, K], W8 [N, K])`` (+ all-reduce of y, row) |
| | dgrad | dx [M, K] = ``gemm(dY8 [M, N], W8^T [K, N])`` (+ all-reduce of dx, column) |
| | wgrad | dW [N, K] = ``gemm(dY8^T [N, M], x8^T [K, M])`` |

Per-shard scales: under SP each rank casts what it holds with its own scale, x8_shard_m in the column fprop and
dY8_shard_m in the row dgrad, so the all-gathered FP8 rows AG(x8) / AG(dY8) [M, *] carry one scale per source
rank's block of M/tp rows ([tp]), which fprop and dgrad apply to output rows. In wgrad the tokens are the reduction
dimension, so a gathered operand is re-cast to one common scale first (``transpose_blocks_to_common_scale``;
docs/design.md, "FP8 linears", says why).

Formats: x8 and W8 e4m3; dY8 e5m2 under 'hybrid', e4m3 under 'e4m3'. Scales are tensor-wise, current (this step's
amax; no amax collective: each rank scales what it holds). Outputs come back in bfloat16 and are returned in the
activation dtype; a bias of another dtype is added after the GEMM.

Saved for backward: the FP8 input (the gathered FP8 rows with ``wgrad_input='keep'``, else the FP8 shard, gathered
again in backward underneath the dgrad GEMM), never a 16-bit copy of the gathered input, and the FP8 transposed
weight. With ``fp8_wgrad=False`` (or a token count M that is not a multiple of 16, which FP8 GEMMs cannot reduce
over) wgrad runs in the activation dtype from the dequantized saved input and dY: the layer's own dY for the
column and local layers, the dequantized AG(dY8) of the dgrad for the row layer (no second all-gather). Gradient
accumulation into ``main_grad`` works as in :mod:`autograd` (``weight_grad``).

Casts go through one function, :func:`fp8_of` ("the FP8 of this tensor"): a producer that computes the FP8 of its
output itself (a norm, an activation or a backward kernel with the cast fused in) attaches it with
:func:`provide_fp8`, and the layer takes it instead of casting again. Nothing reads tensor values on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from flux_layers import ops
from flux_layers.layers.autograd import _all_gather_rows_start, _all_reduce_start, _save_linear_ctx, weight_grad
from flux_layers.layers.fp8_recipe import Fp8Recipe
from flux_layers.layers.fp8_weights import Fp8Weight
from flux_layers.ops import reference
from flux_layers.ops.backend import Choice, choose
from flux_layers.ops.fp8 import (
    OUT_DTYPE,
    ScaledTensor,
    dequantize,
    quantize,
    quantize_with_transpose,
    transpose_blocks_to_common_scale,
)

_FP8_ATTR = "_flux_fp8"
FP8_GEMM_ALIGN = 16  # K and N of an FP8 GEMM (flux_layers/ops/fp8.py)


# ---- casts ------------------------------------------------------------------------------------------------------

def provide_fp8(t: torch.Tensor, q: ScaledTensor) -> torch.Tensor:
    """Attach to ``t`` its FP8 ``q`` (rows [prod(t.shape[:-1]), t.shape[-1]], one scale) that its producer computed,
    so that :func:`fp8_of` returns it instead of casting ``t`` again. Returns ``t``."""
    setattr(t, _FP8_ATTR, q)
    return t


def fp8_of(t: torch.Tensor, dtype: torch.dtype, margin: int, *,
           transpose: bool = False) -> tuple[ScaledTensor, Optional[ScaledTensor]]:
    """The FP8 of ``t`` as rows [M, K] (``t`` flattened to 2-D) with a tensor-wise current scale, and with
    ``transpose`` also its transpose [K, M] with the same scale (the K-major operand of a wgrad). What the
    producer attached (:func:`provide_fp8`) in this format, else ``ops.fp8.quantize`` now."""
    provided = getattr(t, _FP8_ATTR, None)
    if provided is not None and provided.data.dtype == dtype:
        return provided, (ScaledTensor(provided.data.t().contiguous(), provided.scale) if transpose else None)
    with torch.no_grad():
        rows = t.detach().reshape(-1, t.shape[-1])
        if transpose:
            return quantize_with_transpose(rows, dtype, margin=margin)
        return quantize(rows, dtype, margin=margin), None


def all_gather_fp8(q_shard_m: ScaledTensor, group, *, async_op: bool = False):
    """AG of FP8 rows [M/tp, K] with one scale each: (the gathered rows [M, K] with scales [tp], as ``ops.ag_gemm``
    returns them) or, with ``async_op``, a function that waits and returns them (the bytes travel while the caller
    runs a GEMM)."""
    scales = reference.all_gather_rows(q_shard_m.scale.reshape(1), group)
    data_u8, work = _all_gather_rows_start(q_shard_m.data.contiguous().view(torch.uint8), group)

    def finish() -> ScaledTensor:
        if work is not None:
            work.wait()
        return ScaledTensor(data_u8.view(q_shard_m.data.dtype), scales)
    if async_op:
        return finish
    return finish()


# ---- autograd ---------------------------------------------------------------------------------------------------

@dataclass
class Fp8Call:
    """What one layer call hands its autograd function: the recipe, the group, each GEMM's ``backend=`` and the
    record (``layer.fp8_state.last``) that each GEMM writes its operand dtypes into as it runs."""
    recipe: Fp8Recipe
    group: Optional[dist.ProcessGroup]
    grad_accum_fusion: bool
    fprop_backend: Optional[str] = None
    dgrad_backend: Optional[str] = None
    gemm_backend: Optional[str] = None   # the local GEMMs: fprop/dgrad without SP, and every FP8 wgrad
    record: dict = field(default_factory=dict)


def _dtypes(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{str(a.dtype).replace('torch.', '')} x {str(b.dtype).replace('torch.', '')}"


def _bias_parts(bias: Optional[torch.Tensor]):
    """(bias the FP8 GEMM adds in its epilogue: bfloat16 only, bias to add after it)."""
    if bias is None:
        return None, None
    return (bias, None) if bias.dtype == OUT_DTYPE else (None, bias)


def _finish(y: torch.Tensor, bias_after: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    y = y.to(dtype)
    return y + bias_after if bias_after is not None else y


def _fp8_wgrad_ok(call: Fp8Call, tokens: int) -> bool:
    """FP8 wgrad reduces over the tokens, so their count must suit an FP8 GEMM's K."""
    return call.recipe.wgrad and tokens % FP8_GEMM_ALIGN == 0


def _wgrad(ctx, weight: torch.Tensor, dy: torch.Tensor, dy_t8: Optional[ScaledTensor], x_rows8: ScaledTensor,
           dy_rows: Optional[torch.Tensor] = None):
    """dW [N, K] = dY^T [N, M] @ X [M, K] (or its accumulation into main_grad; autograd.weight_grad).

    FP8 (``dy_t8`` given, [N, M] with one scale): ``gemm(dy_t8, X8^T)`` with ``X8^T`` [K, M] re-cast to the largest of
    its blocks' scales (``transpose_blocks_to_common_scale``: the GEMM reduces over M, where it cannot apply a
    scale per block). Else in the activation dtype: ``dy_rows`` (default ``dy``) against the dequantized rows."""
    call = ctx.call
    if dy_t8 is not None:
        x_t8 = transpose_blocks_to_common_scale(x_rows8)
        dw = ops.gemm(dy_t8.data, x_t8.data, x_scale=dy_t8.scale, w_scale=x_t8.scale, weight_layout="nt",
                      backend=call.gemm_backend)
        call.record["wgrad"] = _dtypes(dy_t8.data, x_t8.data)
        return weight_grad(ctx, weight, dy, None, dw=dw.to(weight.dtype))
    dy_rows = dy if dy_rows is None else dy_rows
    x = dequantize(x_rows8).to(dy_rows.dtype)
    call.record["wgrad"] = _dtypes(dy_rows, x)
    return weight_grad(ctx, weight, dy_rows, x)


def _save(ctx, call: Fp8Call, x: torch.Tensor, weight: torch.Tensor, use_bias: bool) -> None:
    _save_linear_ctx(ctx, weight, use_bias, call.grad_accum_fusion, call.group)
    ctx.call = call
    ctx.act_dtype = x.dtype


def _save_operands(ctx, x8: ScaledTensor, w8: Fp8Weight, weight: torch.Tensor) -> None:
    """Save what the backward reads: the FP8 input ``x8`` for wgrad, the FP8 transposed weight for dgrad (each
    only where that gradient is needed) and the weight itself (its ``main_grad``)."""
    x8 = x8 if ctx.needs_input_grad[1] else ScaledTensor(None, None)
    w8_t = w8.t if ctx.needs_input_grad[0] else ScaledTensor(None, None)
    ctx.save_for_backward(x8.data, x8.scale, w8_t.data, w8_t.scale, weight)


def _saved(ctx) -> tuple[ScaledTensor, ScaledTensor, torch.Tensor]:
    """(x8, W8^T, weight) as :func:`_save_operands` saved them."""
    x8_data, x8_scale, w8_t_data, w8_t_scale, weight = ctx.saved_tensors
    return ScaledTensor(x8_data, x8_scale), ScaledTensor(w8_t_data, w8_t_scale), weight


class Fp8AllGatherLinear(torch.autograd.Function):
    """Column-parallel FP8 linear under sequence parallelism: y = AG(x8_shard_m) @ W8^T + b (module docstring)."""

    @staticmethod
    def forward(ctx, x_shard_m, w_shard_n, b_shard_n, x8_shard_m: ScaledTensor, w8: Fp8Weight, call: Fp8Call,
                keep_gathered: bool):
        _save(ctx, call, x_shard_m, w_shard_n, b_shard_n is not None)
        bias_in, bias_after = _bias_parts(b_shard_n)
        ctx.kept = keep_gathered and ctx.needs_input_grad[1]
        out = ops.ag_gemm(x8_shard_m.data, w8.q.data, bias_in, group=call.group, weight_layout="nt",
                          return_gathered=ctx.kept, x_scale=x8_shard_m.scale, w_scale=w8.q.scale,
                          backend=call.fprop_backend)
        call.record["fprop"] = _dtypes(x8_shard_m.data, w8.q.data)
        y, x8_saved = out if ctx.kept else (out, x8_shard_m)   # kept: AG(x8) [M, K], scales [tp]
        _save_operands(ctx, x8_saved, w8, w_shard_n)
        return _finish(y, bias_after, x_shard_m.dtype)

    @staticmethod
    def backward(ctx, dy):
        x8, w8_t, w_shard_n = _saved(ctx)
        call, recipe = ctx.call, ctx.call.recipe
        dy = dy.contiguous()   # [M, N/tp]: every token, this rank's output features
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and _fp8_wgrad_ok(call, dy.shape[0])
        dy8, dy8_t = (fp8_of(dy, recipe.grad_dtype, recipe.margin, transpose=fp8_wgrad)
                      if need_dgrad or fp8_wgrad else (None, None))
        x8_gathered, gathered = None, None
        if need_wgrad:
            if ctx.kept:
                x8_gathered = x8
            else:  # regather the FP8 shard, issued before the dgrad GEMM so that it runs underneath it
                gathered = all_gather_fp8(x8, call.group, async_op=True)
        dx_shard_m = None
        if need_dgrad:
            dx_shard_m = ops.gemm_rs(dy8.data, w8_t.data, group=call.group, weight_layout="nt", x_scale=dy8.scale,
                                     w_scale=w8_t.scale, backend=call.dgrad_backend).to(ctx.act_dtype)
            call.record["dgrad"] = _dtypes(dy8.data, w8_t.data)
        dw = None
        if need_wgrad:
            if gathered is not None:
                x8_gathered = gathered()
            dw = _wgrad(ctx, w_shard_n, dy, dy8_t, x8_gathered)
        db = dy.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return dx_shard_m, dw, db, None, None, None, None


class Fp8ReduceScatterLinear(torch.autograd.Function):
    """Row-parallel FP8 linear under sequence parallelism: y_shard_m = RS(x8_shard_k @ W8^T) + b (module docstring)."""

    @staticmethod
    def forward(ctx, x_shard_k, w_shard_k, b, x8_shard_k: ScaledTensor, w8: Fp8Weight, call: Fp8Call):
        _save(ctx, call, x_shard_k, w_shard_k, b is not None)
        bias_in, bias_after = _bias_parts(b)
        y_shard_m = ops.gemm_rs(x8_shard_k.data, w8.q.data, bias_in, group=call.group, weight_layout="nt",
                                x_scale=x8_shard_k.scale, w_scale=w8.q.scale, backend=call.fprop_backend)
        call.record["fprop"] = _dtypes(x8_shard_k.data, w8.q.data)
        _save_operands(ctx, x8_shard_k, w8, w_shard_k)
        return _finish(y_shard_m, bias_after, x_shard_k.dtype)

    @staticmethod
    def backward(ctx, dy_shard_m):
        x8, w8_t, w_shard_k = _saved(ctx)
        call, recipe = ctx.call, ctx.call.recipe
        dy_shard_m = dy_shard_m.contiguous()   # [M/tp, N]: this rank's tokens
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # This rank's dY shard with its own scale (no collective before the cast); AG(dY8) carries one per shard.
        dy8_shard_m, _ = fp8_of(dy_shard_m, recipe.grad_dtype, recipe.margin)
        dx_shard_k, dy8_gathered = None, None
        if need_dgrad:
            out = ops.ag_gemm(dy8_shard_m.data, w8_t.data, group=call.group, weight_layout="nt",
                              return_gathered=need_wgrad, x_scale=dy8_shard_m.scale, w_scale=w8_t.scale,
                              backend=call.dgrad_backend)
            dx_shard_k, dy8_gathered = out if need_wgrad else (out, None)
            dx_shard_k = dx_shard_k.to(ctx.act_dtype)
            call.record["dgrad"] = _dtypes(dy8_shard_m.data, w8_t.data)
        elif need_wgrad:
            dy8_gathered = all_gather_fp8(dy8_shard_m, call.group)
        dw = None
        if need_wgrad:
            if _fp8_wgrad_ok(call, dy8_gathered.data.shape[0]):
                dw = _wgrad(ctx, w_shard_k, dy_shard_m, transpose_blocks_to_common_scale(dy8_gathered), x8)
            else:
                dw = _wgrad(ctx, w_shard_k, dy_shard_m, None, x8,
                            dy_rows=dequantize(dy8_gathered).to(ctx.act_dtype))
        db = dy_shard_m.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return dx_shard_k, dw, db, None, None, None


class Fp8LocalLinear(torch.autograd.Function):
    """y = x8 @ W8^T + b with Megatron's non-sequence-parallel collectives around it (as :class:`LocalLinear`:
    ``allreduce_dgrad`` for the column layer at TP > 1, ``allreduce_output`` for the row layer, before the bias)."""

    @staticmethod
    def forward(ctx, x, w, b, x8: ScaledTensor, w8: Fp8Weight, call: Fp8Call, allreduce_dgrad: bool,
                allreduce_output: bool):
        _save(ctx, call, x, w, b is not None)
        ctx.allreduce_dgrad = allreduce_dgrad
        bias_in, bias_after = _bias_parts(b)
        if allreduce_output:  # the partial sums are reduced first, the bias added once after
            bias_in, bias_after = None, b
        y = ops.gemm(x8.data, w8.q.data, bias_in, weight_layout="nt", x_scale=x8.scale, w_scale=w8.q.scale,
                     backend=call.gemm_backend)
        call.record["fprop"] = _dtypes(x8.data, w8.q.data)
        y = y.to(x.dtype)
        if allreduce_output:
            dist.all_reduce(y, group=call.group)
        _save_operands(ctx, x8, w8, w)
        return _finish(y, bias_after, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x8, w8_t, w = _saved(ctx)
        call, recipe = ctx.call, ctx.call.recipe
        dy = dy.contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and _fp8_wgrad_ok(call, dy.shape[0])
        dy8, dy8_t = (fp8_of(dy, recipe.grad_dtype, recipe.margin, transpose=fp8_wgrad)
                      if need_dgrad or fp8_wgrad else (None, None))
        dx, reduce = None, None
        if need_dgrad:
            dx = ops.gemm(dy8.data, w8_t.data, weight_layout="nt", x_scale=dy8.scale, w_scale=w8_t.scale,
                          backend=call.gemm_backend).to(ctx.act_dtype)
            call.record["dgrad"] = _dtypes(dy8.data, w8_t.data)
            if ctx.allreduce_dgrad:  # runs underneath the wgrad GEMM
                reduce = _all_reduce_start(dx, call.group)
        dw = _wgrad(ctx, w, dy, dy8_t, x8) if need_wgrad else None
        db = dy.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        if reduce is not None:
            reduce.wait()
        return dx, dw, db, None, None, None, None, None


# ---- the layers' FP8 forward ------------------------------------------------------------------------------------

def _check_features(layer, k: int, n: int, k_name: str, n_name: str) -> None:
    if k % FP8_GEMM_ALIGN or n % FP8_GEMM_ALIGN:
        raise ValueError(f"{type(layer).__name__}: config.fp8={layer.fp8_state.recipe.format!r}: FP8 GEMMs need this "
                         f"rank's input and output features to be multiples of {FP8_GEMM_ALIGN}; got {k_name}={k}, "
                         f"{n_name}={n} (tensor-parallel size {layer.tp_size})")


def _weight_fp8(layer, weight: torch.Tensor, recipe: Fp8Recipe) -> Fp8Weight:
    """The weight's cached FP8 copy; megatron's first-micro-batch flag (set by its schedules) forces a recast."""
    refresh = bool(getattr(layer, "is_first_microbatch", False))
    layer.is_first_microbatch = False
    return layer.fp8_state.weight_cache.get(weight, recipe.fprop_dtype, recipe.margin, refresh=refresh,
                                            with_transpose=torch.is_grad_enabled())


def _new_call(layer, recipe: Fp8Recipe, fprop_kind: Optional[str], dgrad_kind: Optional[str]) -> Fp8Call:
    layer.fp8_state.last = {}
    overlap = layer.overlap
    return Fp8Call(recipe=recipe, group=layer.tp_group, grad_accum_fusion=layer.gradient_accumulation_fusion,
                   fprop_backend=overlap.backend_for(fprop_kind) if fprop_kind else None,
                   dgrad_backend=overlap.backend_for(dgrad_kind) if dgrad_kind else None,
                   gemm_backend=overlap.backend, record=layer.fp8_state.last)


def _path(layer, op: str, device, dtype, w_dtype, mkn, backend, what: str) -> Choice:
    """``last_paths`` entry of one FP8 GEMM (operands of ``dtype`` and ``w_dtype``, split accumulation, as the
    layers' calls ask): the path ops' dispatch takes for it (kept per shape) and what it is."""
    key = (op, device, dtype, w_dtype, mkn, backend)
    choices = layer.fp8_state.paths
    if key not in choices:
        group = layer.tp_group if op != "gemm" else None
        choices[key] = choose(op, device=device, dtype=dtype, mkn=mkn, group=group, backend=backend,
                              w_dtype=w_dtype)
    choice = choices[key]
    return Choice(choice.path, f"FP8 {what}: {choice.reason}")


def _record_paths(layer, call: Fp8Call, fprop_op: str, dgrad_op: str, m: int, k: int, n: int, device,
                  wgrad_what: str) -> None:
    """``layer.last_paths`` of an FP8 call: fprop [M, K] x [N, K], dgrad [M, N] x [K, N], wgrad [N, M] x [K, M]."""
    recipe = call.recipe
    fprop_backend = call.fprop_backend if fprop_op != "gemm" else call.gemm_backend
    dgrad_backend = call.dgrad_backend if dgrad_op != "gemm" else call.gemm_backend
    # The second operand is of the forward format in all three: the FP8 weight (fprop, dgrad), the FP8 input (wgrad).
    w8 = recipe.fprop_dtype
    wgrad = (_path(layer, "gemm", device, recipe.grad_dtype, w8, (n, m, k), call.gemm_backend, wgrad_what)
             if _fp8_wgrad_ok(call, m) else Choice("local", f"{wgrad_what} in the activation dtype"
                                                   + ("" if recipe.wgrad else " (fp8_wgrad=False)")
                                                   + ("" if m % FP8_GEMM_ALIGN == 0 else
                                                      f" ({m} tokens, not a multiple of {FP8_GEMM_ALIGN})")))
    layer.last_paths = {
        "fprop": _path(layer, fprop_op, device, recipe.fprop_dtype, w8, (m, k, n), fprop_backend,
                       f"{fprop_op} fprop"),
        "dgrad": _path(layer, dgrad_op, device, recipe.grad_dtype, w8, (m, n, k), dgrad_backend, f"{dgrad_op} dgrad"),
        "wgrad": wgrad,
    }


def column_parallel_forward(layer, input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            recipe: Fp8Recipe) -> torch.Tensor:
    """``ColumnParallelLinear``'s FP8 forward: input_ [s(/tp), b, K] -> [s, b, N/tp] (the output gather, if any,
    stays the layer's)."""
    k, n = layer.input_size, layer.output_size_per_partition
    _check_features(layer, k, n, "input_size", "output_size_per_partition")
    # Under SP this rank's sequence shard, cast with its own scale: no collective precedes the cast.
    x8, _ = fp8_of(input_, recipe.fprop_dtype, recipe.margin)
    w8 = _weight_fp8(layer, weight, recipe)
    x2d = input_.reshape(-1, input_.shape[-1])
    if layer.sequence_parallel:
        call = _new_call(layer, recipe, "ag_gemm", "gemm_rs_dgrad")
        keep = layer.overlap.wgrad_input == "keep" and weight.requires_grad and torch.is_grad_enabled()
        _record_paths(layer, call, "ag_gemm", "gemm_rs", x2d.shape[0] * layer.tp_size, k, n, x2d.device,
                      "dY^T @ AG(x)^T, AG(x) " + ("kept from fprop" if layer.overlap.wgrad_input == "keep"
                                                  else "gathered again"))
        y = Fp8AllGatherLinear.apply(x2d, weight, bias, x8, w8, call, keep)
        return y.view((input_.shape[0] * layer.tp_size,) + tuple(input_.shape[1:-1]) + (y.shape[-1],))
    call = _new_call(layer, recipe, None, None)
    _record_paths(layer, call, "gemm", "gemm", x2d.shape[0], k, n, x2d.device, "dY^T @ x^T")
    y = Fp8LocalLinear.apply(x2d, weight, bias, x8, w8, call, layer.allreduce_dgrad, False)
    return y.view(tuple(input_.shape[:-1]) + (y.shape[-1],))


def row_parallel_forward(layer, x: torch.Tensor, bias: Optional[torch.Tensor], recipe: Fp8Recipe) -> torch.Tensor:
    """``RowParallelLinear``'s FP8 forward: x [s, b, K/tp] (already scattered) -> [s(/tp), b, N]."""
    k, n = layer.input_size_per_partition, layer.output_size
    _check_features(layer, k, n, "input_size_per_partition", "output_size")
    if layer.sequence_parallel and layer.tp_size > 1 and x.shape[0] % layer.tp_size != 0:
        raise ValueError(f"RowParallelLinear: the sequence dimension of the input {tuple(x.shape)} "
                         f"({x.shape[0]}) is not divisible by the tensor-parallel size {layer.tp_size}")
    x8, _ = fp8_of(x, recipe.fprop_dtype, recipe.margin)
    w8 = _weight_fp8(layer, layer.weight, recipe)
    x2d = x.reshape(-1, x.shape[-1])
    if layer.sequence_parallel and layer.tp_size > 1:
        call = _new_call(layer, recipe, "gemm_rs", "ag_gemm")
        _record_paths(layer, call, "gemm_rs", "ag_gemm", x2d.shape[0], k, n, x2d.device,
                      "AG(dY)^T @ x^T, AG(dY) from dgrad")
        y_shard_m = Fp8ReduceScatterLinear.apply(x2d, layer.weight, bias, x8, w8, call)
        return y_shard_m.view((x.shape[0] // layer.tp_size,) + tuple(x.shape[1:-1]) + (n,))
    call = _new_call(layer, recipe, None, None)
    _record_paths(layer, call, "gemm", "gemm", x2d.shape[0], k, n, x2d.device, "dY^T @ x^T")
    y = Fp8LocalLinear.apply(x2d, layer.weight, bias, x8, w8, call, False, layer.tp_size > 1)
    return y.view(tuple(x.shape[:-1]) + (n,))
