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

The two-level reduce-scatter (the hybrid transport, csrc/include/flux/workspace_layout.h RsTwoLevel) rounds more
often: a node's partial summed at its collector is rounded once more before it crosses to the owner. With nodes of
``ns`` ranks, ``tp / ns`` nodes and partials of equal variance its expected error is sqrt(1 + ((ns - 1) +
(tp / ns - 1) * (2 ns - 1)) / tp) times cuBLAS's: sqrt(2) at 2 x 2 ranks, but 1.5 at 2 x 4 and 4 x 2, where a bound of
1.5x cuBLAS's error fails half the correct calls. Its checks therefore take as the baseline
:func:`two_level_reduce_scatter`, that plan's own roundings applied to exact partials, instead of cuBLAS's product.
That is still below the reference path's error: a ring reduce-scatter that rounds each running sum to bf16 (as
NCCL's does with bf16 data) of bf16 partials came to 2.4x cuBLAS's at 8 ranks in the same CPU emulation (2.6x
with a bias added in one more rounding).

:func:`errors` computes the error on the device without synchronizing, so that a stress run checks a batch of
calls with one transfer. :func:`describe_fit` tells, for a reduce-scatter output that failed, which ranks' partials
it holds (a least-squares fit per block of rows), so that a fault seen once says what went wrong.
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


def two_level_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str, tp: int,
                             node_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of x @ op(weight) + bias (x [M, K] and weight unsharded) rounded as the two-level
    reduce-scatter rounds them: each rank's partial (its K / tp columns of x) exact; a partial of a node peer rounded
    to x's dtype; another node's partial summed at its collector (the collector's own partial exact, its node
    peers' rounded) and rounded again; the owner's fp32 sum of its own partial, its node's and the other nodes'
    partials, and the bias rounded once. The baseline of the two-level plan's checks (module docstring)."""
    if node_size < 1 or tp % node_size or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of {tp} in nodes of {node_size}")
    partial = rank_partials(x, weight, layout, tp, rank)
    dtype = x.dtype

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).float()

    node, local = divmod(rank, node_size)
    acc = partial[rank].clone()
    for o in range(tp // node_size):
        if o == node:
            for q in range(o * node_size, (o + 1) * node_size):
                if q != rank:
                    acc += rounded(partial[q])
        else:
            collector = o * node_size + local
            node_sum = partial[collector].clone()
            for q in range(o * node_size, (o + 1) * node_size):
                if q != collector:
                    node_sum += rounded(partial[q])
            acc += rounded(node_sum)
    if bias is not None:
        acc += bias.float()
    return acc.to(dtype)


def rank_partials(x: torch.Tensor, weight: torch.Tensor, layout: str, tp: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s rows of every rank's partial product (rank q's: x's q-th K / tp columns times op(weight)'s
    matching rows), exact in fp32: the terms a reduce-scatter of x @ op(weight) sums for that rank."""
    rows = x.chunk(tp)[rank].float()
    w = weight.float().t() if layout == "nt" else weight.float()
    return [xq @ wq for xq, wq in zip(rows.chunk(tp, dim=1), w.chunk(tp, dim=0))]


def fit_partials(out: torch.Tensor, partials: list[torch.Tensor], rows: int = 128):
    """Which ``partials`` ``out`` holds: per block of ``rows`` rows, (first row, NaN count, the least-squares
    coefficients of the partials, the relative residual). NaN elements count as 0. A correct reduce-scatter output
    is every partial with coefficient 1 and a residual of its rounding; a partial that never arrived shows near 0, a
    stale one (another call's) near 0 with a large residual."""
    fits = []
    for r0 in range(0, out.shape[0], rows):
        y = out[r0:r0 + rows].double().reshape(-1)
        a = torch.stack([p[r0:r0 + rows].double().reshape(-1) for p in partials], 1)
        nan = torch.isnan(y)
        y = torch.where(nan, torch.zeros_like(y), y)
        coef = torch.linalg.lstsq(a, y.unsqueeze(1)).solution[:, 0]
        residual = (a @ coef - y).norm() / y.norm().clamp_min(1e-30)
        fits.append((r0, int(nan.sum()), coef, float(residual)))
    return fits


def describe_fit(out: torch.Tensor, partials: list[torch.Tensor], bias: torch.Tensor | None = None,
                 rows: int = 128) -> str:
    """For a failed reduce-scatter check: per block of ``rows`` rows of ``out`` (less ``bias``), the partials
    (by source rank) whose coefficient is off 1 and the residual (:func:`fit_partials`), e.g. "rows 0-127: rank 6
    0.00, residual 9.1e-01"."""
    y = out.float() - (bias.float() if bias is not None else 0)
    parts = []
    for r0, nan, coef, residual in fit_partials(y, partials, rows):
        off = ", ".join(f"rank {q} {float(c):.2f}" for q, c in enumerate(coef) if abs(float(c) - 1) > 0.02)
        end = min(r0 + rows, out.shape[0]) - 1
        parts.append(f"rows {r0}-{end}: {off or 'every partial 1.00'}, residual {residual:.1e}"
                     + (f", {nan} NaN" if nan else ""))
    return "; ".join(parts)


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
    ``cublas`` is cuBLAS's output for the same inputs in ``out``'s dtype (or the baseline that stands for it, e.g.
    :func:`two_level_reduce_scatter`)."""
    err, limit = rel_error(out, ref), bound(rel_error(cublas, ref), out.dtype)
    return err <= limit, err, limit  # NaN compares False
