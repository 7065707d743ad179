"""Argument validation shared by every backend, so bad input fails the same way everywhere."""
from __future__ import annotations

import torch

from flux_layers.ops.fp8 import FP8_DTYPES

WEIGHT_LAYOUTS = ("nt", "nn")
FUSED_DTYPES = (torch.bfloat16, torch.float16)


def check_layout(weight_layout: str) -> None:
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be 'nt' (x @ W^T, W [N, K]) or 'nn' (x @ W, W [K, N]); "
                         f"got {weight_layout!r}")


def weight_in_out(weight: torch.Tensor, weight_layout: str) -> tuple[int, int]:
    """(K, N) of a weight in the given layout."""
    return _weight_in_out(tuple(weight.shape), weight_layout)


def _weight_in_out(w_shape: tuple, weight_layout: str) -> tuple[int, int]:
    check_layout(weight_layout)
    if len(w_shape) != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w_shape)}")
    n, k = w_shape if weight_layout == "nt" else (w_shape[1], w_shape[0])
    return k, n


def output_shape(op: str, x_shape, weight_shape, weight_layout: str, tp: int = 1) -> tuple[int, int]:
    """The output shape of ``op`` ('gemm', 'ag_gemm', 'gemm_rs') for x [rows, K] and a weight in the given layout,
    on a group of ``tp`` ranks: the one rule the fake implementations and the launchers share."""
    n = weight_shape[1] if weight_layout == "nn" else weight_shape[0]
    rows = x_shape[0] * tp if op == "ag_gemm" else x_shape[0] // tp if op == "gemm_rs" else x_shape[0]
    return rows, n


def check_matmul_args(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      weight_layout: str) -> tuple[int, int, int]:
    """Validate x [M, K] against weight (layout) and bias [N]; returns (M, K, N)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name}: x and weight must be tensors")
    m, k, n = check_matmul_shapes(name, x.shape, weight.shape, weight_layout)
    fp8 = x.dtype in FP8_DTYPES and weight.dtype in FP8_DTYPES  # a pair of formats (flux_layers/ops/fp8.py)
    if x.dtype != weight.dtype and not fp8:
        raise ValueError(f"{name}: x dtype {x.dtype} != weight dtype {weight.dtype}; x and weight must have the "
                         "same dtype (or both be FP8)")
    if x.device != weight.device:
        raise ValueError(f"{name}: x is on {x.device} but weight on {weight.device}; x and weight must be on the "
                         "same device")
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"{name}: bias must have shape ({n},), got {tuple(bias.shape)}")
        out_dtype = torch.bfloat16 if fp8 else x.dtype
        if bias.dtype != out_dtype or bias.device != x.device:
            raise ValueError(f"{name}: bias is {bias.dtype} on {bias.device}; expected {out_dtype} on {x.device} "
                             "(the dtype and device of x; bfloat16 for FP8 operands)")
    return m, k, n


def check_matmul_shapes(name: str, x_shape, w_shape, weight_layout: str) -> tuple[int, int, int]:
    """:func:`check_matmul_args`' checks of the shapes alone (x [M, K], the weight in its layout); (M, K, N)."""
    if len(x_shape) != 2:
        raise ValueError(f"{name}: x must be 2-D [M, K], got shape {tuple(x_shape)}")
    k_w, n = _weight_in_out(tuple(w_shape), weight_layout)
    m, k = x_shape
    if k != k_w:
        raise ValueError(f"{name}: x {tuple(x_shape)} and weight {tuple(w_shape)} (layout "
                         f"{weight_layout!r}) disagree on K: {k} vs {k_w}")
    return m, k, n


def check_fused_dims(name: str, k: int, n: int) -> None:
    """Sizes the fused kernels need (TMA rows of 16 bytes): K and N multiples of 8, K positive."""
    if k <= 0 or k % 8 != 0:
        raise ValueError(f"{name}: K = {k} (x's columns) must be a positive multiple of 8 for the fused kernels")
    if n % 8 != 0:
        raise ValueError(f"{name}: N = {n} (the weight's output features) must be a multiple of 8 for the fused "
                         "kernels")


def check_fused_tensor(name: str, what: str, t: torch.Tensor) -> None:
    """Constraints of the CUDA kernels: CUDA, bf16/fp16/FP8, rows contiguous, 16-byte aligned."""
    if t.device.type != "cuda":
        raise ValueError(f"{name}: {what} must be a CUDA tensor for the fused path, got device {t.device}")
    if t.dtype not in FUSED_DTYPES + FP8_DTYPES:
        raise ValueError(f"{name}: {what} dtype {t.dtype} is not supported by the fused kernels "
                         f"(bfloat16, float16, float8_e4m3fn or float8_e5m2)")
    if t.dim() == 2 and t.stride(1) != 1:
        raise ValueError(f"{name}: {what} must have unit stride along its last dimension, got strides {t.stride()}")
    if t.dim() == 2 and (t.stride(0) * t.element_size()) % 16 != 0 and t.shape[0] > 1:
        raise ValueError(f"{name}: {what} row stride {t.stride(0)} elements is not a multiple of 16 bytes")
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"{name}: {what} data pointer is not 16-byte aligned")
    if t.shape[-1] * t.element_size() % 16 != 0:
        raise ValueError(f"{name}: {what} last dimension {t.shape[-1]} is not a multiple of "
                         f"{16 // t.element_size()} elements (16 bytes), which TMA requires")
