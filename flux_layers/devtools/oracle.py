"""The numerical oracle of the fused operators' GPU checks.

An output in bfloat16/float16 is right when its relative error against an fp32 reference (Frobenius norm of the
difference over the norm of the reference) is at most ``RATIO`` times cuBLAS's own error on the same inputs:
``torch.matmul`` (``addmm`` with a bias) in the same low precision, against the same reference. ``FLOOR`` keeps
the bound from collapsing where cuBLAS happens to be exact. A flat tolerance would pass an op that is several
times less accurate than the GEMM it replaces on large K, and fail none that loses accuracy on small K.

Why 1.5: the fused GEMMs accumulate in fp32 and round once, as cuBLAS does, except GEMM+ReduceScatter, whose peer
partials travel in the input dtype (as with NCCL's reduce-scatter of bf16 data) and are summed in fp32: one more
rounding of a partial of 1/tp of the output's variance per peer, so its expected error is at most sqrt(2) times
cuBLAS's (sqrt(1 + (tp - 1) / tp)).

:func:`errors` computes the error on the device without synchronizing, so that a stress run checks a batch of
calls with one transfer.
"""
from __future__ import annotations

import torch

RATIO = 1.5
FLOOR = {torch.bfloat16: 2.0**-10, torch.float16: 2.0**-13, torch.float32: 2.0**-22}


def matmul_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    """x @ op(weight) + bias in fp32: the reference."""
    w = weight.float().t() if layout == "nt" else weight.float()
    out = x.float() @ w
    return out if bias is None else out + bias.float()


def matmul_cublas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    """The same product by cuBLAS in the inputs' dtype (the bias added in its epilogue): what the bound is set by."""
    w = weight.t() if layout == "nt" else weight
    return x @ w if bias is None else torch.addmm(bias, x, w)


def errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error of ``out`` against ``ref`` as a 0-d float64 tensor on their device (no synchronization). An
    unwritten (NaN) element makes it NaN."""
    ref64 = ref.double()
    return (out.double() - ref64).norm() / ref64.norm()


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return errors(out, ref).item()


def bound(cublas_error: float, dtype: torch.dtype) -> float:
    """The largest relative error an output of ``dtype`` may have where cuBLAS's is ``cublas_error``."""
    return RATIO * max(cublas_error, FLOOR[dtype])


def verdict(out: torch.Tensor, ref: torch.Tensor, cublas: torch.Tensor) -> tuple[bool, float, float]:
    """(within the bound, the output's relative error, the bound) for ``out`` against the fp32 ``ref``, where
    ``cublas`` is cuBLAS's output for the same inputs in ``out``'s dtype."""
    err, limit = rel_error(out, ref), bound(rel_error(cublas, ref), out.dtype)
    return err <= limit, err, limit  # NaN compares False
