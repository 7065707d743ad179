"""Autograd functions of the parallel linear layers: every collective paired with its backward dual.

All functions take 2-D activations [rows, features]; the modules flatten Megatron's [s, b, h] sequence-major, so
the sequence shard of a rank is one contiguous block of rows. ``tp`` is the size of ``group``; W is [out, in].

| function | fprop | dgrad | wgrad |
|---|---|---|---|
| :class:`AllGatherLinear` (column, SP) | y [M, N/tp] = AG(x_shard_m) @ w_shard_n^T: ``ops.ag_gemm`` 'nt' | dx_shard_m = RS(dy @ w_shard_n): ``ops.gemm_rs`` 'nn', or (reference path) the GEMM, then NCCL RS under the wgrad GEMM | dw [N/tp, K] = dy^T @ AG(x) |
| :class:`ReduceScatterLinear` (row, SP) | y_shard_m [M/tp, N] = RS(x_shard_k @ w_shard_k^T): ``ops.gemm_rs`` 'nt' | dx_shard_k = AG(dy_shard_m) @ w_shard_k: ``ops.ag_gemm`` 'nn' | dw [N, K/tp] = AG(dy)^T @ x_shard_k |
| :class:`LocalLinear` (no SP) | y = x @ w^T (+ all-reduce of y for row) | dx = dy @ w (+ all-reduce of dx for column) | dw = dy^T @ x |

Shapes: x_shard_m [M/tp, K], w_shard_n [N/tp, K], x_shard_k [M, K/tp], w_shard_k [N, K/tp].

Gradient-accumulation fusion follows megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` (0.16.1 to 0.19.x):
wgrad is added into ``weight.main_grad`` (read at fprop, restored at backward), and the returned weight gradient
is a dummy of the weight's shape with ``weight.grad_added_to_main_grad = True`` when the weight has that attribute,
else None. Biases get ordinary gradients; the row-parallel SP bias gradient is this rank's partial sum, which
Megatron's ``finalize_model_grads`` all-reduces because the bias carries ``sequence_parallel = True``.

Nothing here reads tensor values on the host (no ``.item()``, no syncs, no data-dependent branches): forward and
backward capture into one CUDA graph and trace into one torch.compile graph (tests/gpu/test_layers_gpu.py). The
fused ops trace as opaque nodes (flux_layers/ops/_traceable.py) and capture on their workspaces' CUDA-graph twins
once CUDA graphs are enabled (flux_layers/runtime/workspace.py); otherwise a capture takes the NCCL path. Under
torch.compile the backward collectives that otherwise run asynchronously under a GEMM are issued synchronously
(Dynamo does not trace ``async_op=True``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers import ops
from flux_layers.ops import reference


def _tp(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _all_gather_rows_start(x_shard_m: torch.Tensor, group):
    """Start AG(x_shard_m) over ``group``; returns (gathered, work to wait on or None).

    Under torch.compile the gather is synchronous: Dynamo does not trace ``async_op=True`` and the compiler
    schedules collectives itself.
    """
    if torch.compiler.is_compiling():
        return reference.all_gather_rows(x_shard_m, group), None
    x_shard_m = x_shard_m.contiguous()
    gathered = x_shard_m.new_empty((_tp(group) * x_shard_m.shape[0],) + tuple(x_shard_m.shape[1:]))
    return gathered, dist.all_gather_into_tensor(gathered, x_shard_m, group=group, async_op=True)


def _reduce_scatter_rows_start(t: torch.Tensor, group):
    """Start RS(t) over rows; returns (this rank's [rows/tp, ...] block, work to wait on or None)."""
    if torch.compiler.is_compiling() or dist.get_backend(group) == "gloo":  # gloo: no tensor reduce-scatter
        return reference.reduce_scatter_rows(t, group), None
    out = t.new_empty((t.shape[0] // _tp(group),) + tuple(t.shape[1:]))
    return out, dist.reduce_scatter_tensor(out, t.contiguous(), group=group, async_op=True)


def _all_reduce_start(t: torch.Tensor, group):
    """Start an in-place all-reduce of ``t``; returns the work to wait on (None under torch.compile: synchronous)."""
    if torch.compiler.is_compiling():
        dist.all_reduce(t, group=group)
        return None
    return dist.all_reduce(t, group=group, async_op=True)


def _main_grad_at_fprop(weight: torch.Tensor, grad_accum_fusion: bool):
    if grad_accum_fusion and hasattr(weight, "main_grad"):
        return weight.main_grad
    return None


def _accumulate_wgrad(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad [N, K] += dy^T [N, M] @ x [M, K], accumulating in main_grad's dtype."""
    if main_grad.dtype == dy.dtype:
        main_grad.addmm_(dy.t(), x)
    elif main_grad.is_cuda and main_grad.dtype == torch.float32 and dy.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(torch.matmul(dy.t(), x).to(main_grad.dtype))


def weight_grad(ctx, weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor | None = None):
    """dW = dy^T @ x, or accumulate it into ``weight.main_grad`` and return Megatron's dummy gradient. ``dw``: the
    product already computed (the FP8 wgrad GEMM, flux_layers/layers/fp8_autograd.py); ``x`` is then unused."""
    if not ctx.grad_accum_fusion:
        return torch.matmul(dy.t(), x) if dw is None else dw
    if hasattr(weight, "__fsdp_param__"):  # Megatron-FSDP hands out its main_grad buffer on demand
        weight.main_grad = weight.get_main_grad()
        if dw is None:
            torch.matmul(dy.t(), x, out=weight.main_grad)
        else:
            weight.main_grad.copy_(dw)
    else:
        weight.main_grad = ctx.main_grad
        if weight.main_grad is None:
            raise RuntimeError("gradient_accumulation_fusion is set but the weight had no `main_grad` at fprop; "
                               "wrap the model in megatron's DistributedDataParallel or set weight.main_grad")
        if dw is None:
            _accumulate_wgrad(weight.main_grad, dy, x)
        else:
            weight.main_grad.add_(dw)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # Megatron's contract: a dummy weight gradient keeps the backward hooks on the main thread.
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    grad = make(weight.main_grad.shape, dtype=dy.dtype, device=dy.device)
    weight.grad_added_to_main_grad = True
    return grad


def _save_linear_ctx(ctx, weight, use_bias: bool, grad_accum_fusion: bool, group) -> None:
    ctx.main_grad = _main_grad_at_fprop(weight, grad_accum_fusion)
    ctx.grad_accum_fusion = grad_accum_fusion
    ctx.use_bias = use_bias
    ctx.group = group


class AllGatherLinear(torch.autograd.Function):
    """Column-parallel linear under sequence parallelism: y = AG(x_shard_m) @ w_shard_n^T + b_shard_n."""

    @staticmethod
    def forward(ctx, x_shard_m, w_shard_n, b_shard_n, group, fprop_backend, dgrad_backend, keep_gathered,
                grad_accum_fusion):
        """``keep_gathered``: save AG(x) for wgrad (the caller passes False when no wgrad will run)."""
        _save_linear_ctx(ctx, w_shard_n, b_shard_n is not None, grad_accum_fusion, group)
        ctx.dgrad_backend = dgrad_backend
        need_wgrad = w_shard_n.requires_grad
        ctx.keep_gathered = keep_gathered and need_wgrad
        if ctx.keep_gathered:
            y, x_gathered = ops.ag_gemm(x_shard_m, w_shard_n, b_shard_n, group=group, weight_layout="nt",
                                        return_gathered=True, backend=fprop_backend)
            ctx.save_for_backward(x_gathered, w_shard_n)
        else:
            y = ops.ag_gemm(x_shard_m, w_shard_n, b_shard_n, group=group, weight_layout="nt",
                            backend=fprop_backend)
            ctx.save_for_backward(x_shard_m if need_wgrad else None, w_shard_n)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_saved, w_shard_n = ctx.saved_tensors
        dy = dy.contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_gathered, gather = None, None
        if need_wgrad:
            if ctx.keep_gathered:
                x_gathered = x_saved
            else:  # regather, issued before the dgrad GEMM so that it runs underneath it
                x_gathered, gather = _all_gather_rows_start(x_saved, ctx.group)
        dx_shard_m, scatter = None, None
        if need_dgrad:
            if ctx.dgrad_backend == "reference" and need_wgrad:
                # As megatron-core's column layer: the NCCL reduce-scatter runs underneath the wgrad GEMM.
                dx_shard_m, scatter = _reduce_scatter_rows_start(dy @ w_shard_n, ctx.group)
            else:
                dx_shard_m = ops.gemm_rs(dy, w_shard_n, group=ctx.group, weight_layout="nn",
                                         backend=ctx.dgrad_backend)
        dw = None
        if need_wgrad:
            if gather is not None:
                gather.wait()
            dw = weight_grad(ctx, w_shard_n, dy, x_gathered)
        if scatter is not None:
            scatter.wait()
        db = dy.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return dx_shard_m, dw, db, None, None, None, None, None


class ReduceScatterLinear(torch.autograd.Function):
    """Row-parallel linear under sequence parallelism: y_shard_m = RS(x_shard_k @ w_shard_k^T) + b."""

    @staticmethod
    def forward(ctx, x_shard_k, w_shard_k, b, group, fprop_backend, dgrad_backend, grad_accum_fusion):
        _save_linear_ctx(ctx, w_shard_k, b is not None, grad_accum_fusion, group)
        ctx.dgrad_backend = dgrad_backend
        ctx.save_for_backward(x_shard_k if w_shard_k.requires_grad else None, w_shard_k)
        return ops.gemm_rs(x_shard_k, w_shard_k, b, group=group, weight_layout="nt", backend=fprop_backend)

    @staticmethod
    def backward(ctx, dy_shard_m):
        x_shard_k, w_shard_k = ctx.saved_tensors
        dy_shard_m = dy_shard_m.contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx_shard_k, dy_gathered = None, None
        if need_dgrad:
            out = ops.ag_gemm(dy_shard_m, w_shard_k, group=ctx.group, weight_layout="nn",
                              return_gathered=need_wgrad, backend=ctx.dgrad_backend)
            dx_shard_k, dy_gathered = out if need_wgrad else (out, None)
        elif need_wgrad:
            dy_gathered = reference.all_gather_rows(dy_shard_m, ctx.group)
        dw = weight_grad(ctx, w_shard_k, dy_gathered, x_shard_k) if need_wgrad else None
        db = dy_shard_m.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return dx_shard_k, dw, db, None, None, None, None


class LocalLinear(torch.autograd.Function):
    """y = x @ w^T + b with Megatron's non-sequence-parallel collectives around it.

    ``allreduce_dgrad`` (column-parallel, TP > 1): all-reduce dx over ``group`` (the backward of Megatron's
    copy-to-tensor-parallel-region). ``allreduce_output`` (row-parallel, TP > 1): all-reduce y over ``group``
    before the bias is added (Megatron's reduce-from-tensor-parallel-region; its backward is the identity).
    """

    @staticmethod
    def forward(ctx, x, w, b, group, allreduce_dgrad, allreduce_output, grad_accum_fusion):
        _save_linear_ctx(ctx, w, b is not None, grad_accum_fusion, group)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.save_for_backward(x if w.requires_grad else None, w)
        y = torch.matmul(x, w.t())
        if allreduce_output:
            dist.all_reduce(y, group=group)
        if b is not None:
            y = y + b
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx, reduce = None, None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(w)
            if ctx.allreduce_dgrad:  # runs underneath the wgrad GEMM
                reduce = _all_reduce_start(dx, ctx.group)
        dw = weight_grad(ctx, w, dy, x) if ctx.needs_input_grad[1] else None
        db = dy.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        if reduce is not None:
            reduce.wait()
        return dx, dw, db, None, None, None, None


class GatherLastDim(torch.autograd.Function):
    """[..., N/tp] on every rank -> [..., N] in rank order (Megatron's gather-from-TP-region); backward keeps
    this rank's slice."""

    @staticmethod
    def forward(ctx, x_shard_n, group):
        ctx.group = group
        return gather_last_dim(x_shard_n, group)

    @staticmethod
    def backward(ctx, dy):
        return split_last_dim(dy, ctx.group), None


class ScatterLastDim(torch.autograd.Function):
    """[..., K] (the same on every rank) -> this rank's [..., K/tp] (Megatron's scatter-to-TP-region); backward
    gathers the slices."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, dy_shard_k):
        return gather_last_dim(dy_shard_k, ctx.group), None


def gather_last_dim(x_shard_n: torch.Tensor, group) -> torch.Tensor:
    tp = _tp(group)
    if tp == 1:
        return x_shard_n
    gathered = reference.all_gather_rows(x_shard_n.contiguous().unsqueeze(0), group)  # [tp, ..., N/tp]
    return torch.cat(gathered.unbind(0), dim=-1)


def split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    tp = _tp(group)
    if tp == 1:
        return x
    if x.shape[-1] % tp != 0:
        raise ValueError(f"cannot split the last dimension {x.shape[-1]} of {tuple(x.shape)} over {tp} ranks")
    return x.chunk(tp, dim=-1)[dist.get_rank(group)].contiguous()
