"""The op library's persistent sm90 GEMM (no communication).

| weight_layout | x | weight | out |
|---|---|---|---|
| 'nt' | [M, K] | [N, K] | x @ weight^T + bias  [M, N] |
| 'nn' | [M, K] | [K, N] | x @ weight + bias    [M, N] |

It is the base the fused operators extend (same mainloop, tile scheduler and epilogue); exposed for tests
and the GEMM benchmark against cuBLAS. FP8 operands (flux_layers/ops/fp8.py: 'nt' only, ``x_scale`` and
``w_scale``, bfloat16 out) run CUTLASS's FP8 mainloop with the scales applied in the epilogue; split accumulation
takes 128 x 128 tiles, ``fast_accum`` the 128 x 256 tile by default.
"""
from __future__ import annotations

import torch

from flux_layers import _env, _library
from flux_layers.ops._checks import check_fused_tensor, check_matmul_args, output_shape
from flux_layers.ops.fp8 import OUT_DTYPE, check_fp8_args
from flux_layers.runtime import tuning


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_layout: str = "nt",
         x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None, fast_accum: bool = False,
         tile: int | None = None, sm_count: int = 0, swizzle: int | None = None,
         stream_k: bool | int | None = None) -> torch.Tensor:
    """x @ op(weight) + bias on the persistent kernel. ``tile``: configuration id and ``swizzle``: tiles along M
    visited together (None: tuning table or the measured default); ``sm_count``: limit the persistent grid
    (0: all SMs); ``stream_k``: split a last, partial wave of tiles along K (None:
    FLUX_LAYERS_STREAM_K; an int: the fill limit, see tuning.stream_k_fill)."""
    _library.require()
    m, k, n = check_matmul_args("gemm", x, weight, bias, weight_layout)
    fp8 = check_fp8_args("gemm", x, weight, bias, x_scale, w_scale, weight_layout, n) is not None
    check_fused_tensor("gemm", "x", x)
    check_fused_tensor("gemm", "weight", weight)
    kc = tuning.resolve_kernel("gemm", dtype=x.dtype, tp=1, mkn=(m, k, n), tile=tile, swizzle=swizzle,
                               stream_k=stream_k, sm_count=sm_count, fast_accum=fast_accum if fp8 else None,
                               w_dtype=weight.dtype if fp8 else None)
    return run(x, weight, bias, weight_layout == "nn", kc, _env.get("POISON_OUTPUTS") == "1", x_scale, w_scale,
               fast_accum)


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_nn: bool,
        kc: tuning.KernelChoice, poison: bool = False, x_scale: torch.Tensor | None = None,
        w_scale: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """One launch with a resolved kernel configuration (the op checks the tensors)."""
    out_dtype = OUT_DTYPE if x_scale is not None else x.dtype
    out = x.new_empty(output_shape("gemm", x.shape, weight.shape, "nn" if weight_nn else "nt"), dtype=out_dtype)
    if poison:
        out.fill_(float("nan"))
    torch.ops.flux_layers.gemm(x, weight, bias, x_scale, w_scale, out, weight_nn, kc.tile, kc.sm_count, kc.swizzle,
                               kc.stream_k_fill, fast_accum)
    return out
