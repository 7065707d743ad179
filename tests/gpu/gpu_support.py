"""Shared pieces of the GPU tests.

Tests skip only when the GPUs they need are absent. Where the GPUs are present, a missing or broken op
library makes them fail (never pass vacuously).
"""
from __future__ import annotations

import os

import pytest
import torch

from flux_layers.devtools import oracle


def needs_gpus(n: int, shared: bool = True):
    """Skip unless ``n`` GPUs are visible (or one, where FLUX_LAYERS_TEST_SHARED_GPU=1 runs the ranks on it and the
    test can run that way: ``shared``; NCCL refuses two ranks on one GPU, so tests of the NCCL transport cannot)."""
    from flux_layers.devtools.launch import shared_gpu
    have = torch.cuda.device_count()
    enough = have >= n or (shared and shared_gpu() and have >= 1)
    return pytest.mark.skipif(not enough, reason=f"needs {n} CUDA GPUs, {have} visible")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return oracle.rel_error(out, ref)


def references(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str):
    """(fp32 reference, cuBLAS's output in x's dtype) of x @ op(weight) + bias: what :func:`assert_close_rel`
    compares an output with."""
    return oracle.matmul_fp32(x, weight, bias, layout), oracle.matmul_cublas(x, weight, bias, layout)


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, cublas: torch.Tensor, what: str) -> None:
    """``out`` has every element written and a relative error against the fp32 ``ref`` within 1.5x of cuBLAS's
    (``cublas``: the same product by torch.matmul in out's dtype; flux_layers/devtools/oracle.py)."""
    assert out.shape == ref.shape == cublas.shape, \
        f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)} (cuBLAS {tuple(cublas.shape)})"
    nan = torch.isnan(out).sum().item()
    assert nan == 0, f"{what}: {nan} elements were not written (still NaN)"
    ok, err, limit = oracle.verdict(out, ref, cublas)
    assert ok, f"{what}: relative error {err:.3e} > {limit:.3e} ({oracle.RATIO}x cuBLAS's error or the floor)"


def poison_outputs() -> None:
    """Fused ops fill their outputs with NaN before launching, so an unwritten element fails the check."""
    os.environ["FLUX_LAYERS_POISON_OUTPUTS"] = "1"


def random_matrix(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def global_inputs(seed: int, m: int, k: int, n: int, dtype: torch.dtype, layout: str):
    """The unsharded x [M, K], weight ([N, K] for 'nt', [K, N] for 'nn') and bias [N]; identical on every rank."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = random_matrix(m, k, dtype, gen)
    w = random_matrix(n, k, dtype, gen) if layout == "nt" else random_matrix(k, n, dtype, gen)
    b = random_matrix(1, n, dtype, gen)[0]
    return x, w, b


def stream_k_active(rows_per_group: int, n: int, k: int, groups: int, tile: int, sm_count: int,
                    reduce_scatter: bool = False, max_fill_pct: int | None = None) -> bool:
    """Whether the persistent GEMM splits its last wave along K for this problem with `sm_count` SMs (the
    Python mirror of the kernel's plan, checked against the C++ one by the CPU tests). ReduceScatter splits
    only when the split items all lie in its last group (its own rows)."""
    from flux_layers.runtime import schedules
    if tile not in schedules.SPLIT_TILE_CONFIGS:
        return False
    tile_m, tile_n = schedules.TILE_CONFIGS[tile]
    s = schedules.TileSchedule(rows_per_group=rows_per_group, n=n, num_groups=groups,
                               group_order=tuple(range(groups)), tile_m=tile_m, tile_n=tile_n)
    sk = schedules.StreamK(s.total_work, sm_count // schedules.CLUSTER_M, -(-k // 64),
                           max_fill_pct=max_fill_pct or schedules.DEFAULT_STREAM_K_FILL)
    return sk.active and (not reduce_scatter or sk.split_work <= s.work_per_group)


def split_sm_count(rows_per_group: int, n: int, k: int, groups: int, tile: int = 1,
                   reduce_scatter: bool = False) -> int:
    """The smallest SM count (a limit on the persistent grid) under which the problem's last wave is split."""
    for sms in range(16, 133, 4):
        if stream_k_active(rows_per_group, n, k, groups, tile, sms, reduce_scatter):
            return sms
    raise AssertionError(f"no SM count splits the last wave of {rows_per_group}x{n}x{k} x {groups} groups")
