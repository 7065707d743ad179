"""Shared pieces of the GPU tests.

Tests skip only when the GPUs they need are absent. Where the GPUs are present, a missing or broken op
library makes them fail (never pass vacuously).
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools import oracle


def needs_gpus(n: int, shared: bool = True):
    """Skip unless ``n`` GPUs are visible (or one, where FLUX_LAYERS_TEST_SHARED_GPU=1 runs the ranks on it and the
    test can run that way: ``shared``; NCCL refuses two ranks on one GPU, so tests of the NCCL transport cannot)."""
    from flux_layers.devtools.launch import shared_gpu
    have = torch.cuda.device_count()
    enough = have >= n or (shared and shared_gpu() and have >= 1)
    return pytest.mark.skipif(not enough, reason=f"needs {n} CUDA GPUs, {have} visible")


def lean() -> bool:
    """Whether the tests run their lean matrices: ranks sharing one GPU at TP > 2, where every call time-slices TP
    processes. A lean matrix keeps every transfer variant (direction, order, store, chunking) and spreads the other
    axes (dtype, weight layout, shape, tile) over them; tests that do not depend on the group size run at TP = 2."""
    from flux_layers.devtools.launch import shared_gpu, tp_under_test
    return shared_gpu() and tp_under_test() > 2


def layers_tp() -> int:
    """The group size of the layers' GPU tests: the TP under test where the ranks share one GPU or FLUX_LAYERS_TEST_TP
    asks for one, else 2 (a machine of more GPUs runs the layers at TP = 2 unless asked)."""
    from flux_layers import _env
    from flux_layers.devtools.launch import shared_gpu, tp_under_test
    return tp_under_test() if shared_gpu() or _env.get_int("TEST_TP") else 2


def at_tp2_when_lean(reason: str):
    """Skip a test in lean runs (:func:`lean`): what it checks does not depend on the group size (``reason``), and
    the TP = 2 run checks it."""
    return pytest.mark.skipif(lean(), reason=f"runs at TP = 2 where ranks share one GPU: {reason}")


def lean_params(values, kept, reason: str, unpack: bool = False) -> list:
    """pytest parameters of ``values`` (``unpack``: each a tuple of several arguments); in lean runs those not in
    ``kept`` skip (``reason``: why the kept ones stand for them)."""
    def param(v, *marks):
        return pytest.param(*(v if unpack else (v,)), marks=marks)
    return [param(v) if v in kept else param(v, at_tp2_when_lean(reason)) for v in values]


# Ranks sharing one GPU time-slice it: a persistent grid over more output tiles than this can hold the GPU spinning
# on a peer that cannot run until the timeout (../shared/environment.md: <= 128 tiles of 128 x 256 per rank ran).
SHARED_TILE_BUDGET = 128


def check_shared_budget(m: int, n: int, what: str) -> None:
    """Where the ranks share one GPU, a rank's GEMM [m, n] must stay within SHARED_TILE_BUDGET tiles of 128 x 256
    (a test whose shape breaks it is wrong, not slow)."""
    from flux_layers.devtools.launch import shared_gpu
    tiles = -(-m // 128) * -(-n // 256)
    assert not shared_gpu() or tiles <= SHARED_TILE_BUDGET, \
        f"{what}: [{m}, {n}] is {tiles} tiles of 128 x 256 per rank, over {SHARED_TILE_BUDGET} on a shared GPU"


def rows_per_rank(rows_at_tp2: int, tp: int) -> int:
    """Rows per rank of a shape written for TP = 2: as written with a GPU per rank; where the ranks share one GPU,
    scaled by 2 / tp, so that each rank's GEMM (M = rows x tp) keeps its TP = 2 size and the budget."""
    from flux_layers.devtools.launch import shared_gpu
    return rows_at_tp2 * 2 // tp if shared_gpu() and tp > 2 else rows_at_tp2


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return oracle.rel_error(out, ref)


def references(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str):
    """(fp32 reference, cuBLAS's output in x's dtype) of x @ op(weight) + bias: what :func:`assert_close_rel`
    compares an output with."""
    return oracle.matmul_fp32(x, weight, bias, layout), oracle.matmul_cublas(x, weight, bias, layout)


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, cublas: torch.Tensor, what: str,
                     baseline: str = "cuBLAS's") -> None:
    """``out`` has every element written and a relative error against the fp32 ``ref`` within 1.5x of cuBLAS's
    (``cublas``: the same product by torch.matmul in out's dtype, or what stands for it, named by ``baseline``;
    flux_layers/devtools/oracle.py). A failure says which rows: an intermittent one is seen once."""
    assert out.shape == ref.shape == cublas.shape, \
        f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)} (cuBLAS {tuple(cublas.shape)})"
    nan = torch.isnan(out).sum().item()
    assert nan == 0, f"{what}: {nan} elements were not written (still NaN): {_nan_rows(out)}"
    ok, err, limit = oracle.verdict(out, ref, cublas)
    assert ok, (f"{what}: relative error {err:.3e} > {limit:.3e} ({oracle.RATIO}x {baseline} error or the floor); "
                f"by 128-row block: {_block_errors(out, ref)}")


def _nan_rows(out: torch.Tensor) -> str:
    """The rows holding NaN, as ranges with their NaN count each."""
    flat = out.reshape(-1, out.shape[-1])
    per_row = torch.isnan(flat).sum(1)
    rows = per_row.nonzero().flatten().tolist()
    ranges: list[list[int]] = []
    for r in rows:
        if ranges and ranges[-1][1] == r - 1:
            ranges[-1][1] = r
        else:
            ranges.append([r, r])
    shown = [f"rows {a}-{b} ({int(per_row[a:b + 1].sum())})" if a != b else f"row {a} ({int(per_row[a])})"
             for a, b in ranges[:8]]
    return ", ".join(shown) + (f" and {len(ranges) - 8} more ranges" if len(ranges) > 8 else "")


def _block_errors(out: torch.Tensor, ref: torch.Tensor) -> str:
    flat_out, flat_ref = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    return ", ".join(f"{r0}: {oracle.rel_error(flat_out[r0:r0 + 128], flat_ref[r0:r0 + 128]):.2e}"
                     for r0 in range(0, flat_out.shape[0], 128))


def apply_settings(**values: str) -> None:
    """Set FLUX_LAYERS_<name> = value for each keyword and make the next calls read them (ops.refresh_settings)."""
    from flux_layers import ops
    for name, value in values.items():
        os.environ["FLUX_LAYERS_" + name] = value
    ops.refresh_settings()


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


def stream_k_active(rows_per_shard: int, n: int, k: int, shards: int, tile: int, sm_count: int,
                    reduce_scatter: bool = False, max_fill_pct: int | None = None, tile_k: int = 64) -> bool:
    """Whether the persistent GEMM splits its last wave along K for this problem with `sm_count` SMs (the
    Python mirror of the kernel's plan, checked against the C++ one by the CPU tests). ReduceScatter splits
    only when the split items all lie in its last shard (its own rows). ``tile_k``: the K tile (128 bytes: 64
    16-bit elements, 128 FP8 ones)."""
    from flux_layers.runtime import schedules
    if tile not in schedules.SPLIT_TILE_CONFIGS:
        return False
    tile_m, tile_n = schedules.TILE_CONFIGS[tile]
    s = schedules.TileSchedule(rows_per_shard=rows_per_shard, n=n, num_shards=shards,
                               shard_order=tuple(range(shards)), tile_m=tile_m, tile_n=tile_n)
    sk = schedules.StreamK(s.total_work, sm_count // schedules.CLUSTER_M, -(-k // tile_k),
                           max_fill_pct=max_fill_pct or schedules.DEFAULT_STREAM_K_FILL)
    return sk.active and (not reduce_scatter or sk.split_work <= s.work_per_shard)


def split_sm_count(rows_per_shard: int, n: int, k: int, shards: int, tile: int = 1,
                   reduce_scatter: bool = False) -> int:
    """The smallest SM count (a limit on the persistent grid) under which the problem's last wave is split."""
    for sms in range(16, 133, 4):
        if stream_k_active(rows_per_shard, n, k, shards, tile, sms, reduce_scatter):
            return sms
    raise AssertionError(f"no SM count splits the last wave of {rows_per_shard}x{n}x{k} x {shards} shards")


def ag_gemm_checked(rank: int, tp: int, seed: int, m: int, k: int, n: int, dtype: torch.dtype, layout: str, *,
                    what: str, with_bias: bool = True, late_rank: int | None = None, **op_kwargs) -> None:
    """One fused AllGather+GEMM call on this rank's shards of fresh global inputs (``global_inputs``), its output
    checked against the references and its gathered input bitwise against the global x. ``op_kwargs`` go to
    fused_ag_gemm.ag_gemm (ws, tile, transport, chunk_rows, ...); ``late_rank`` sleeps 10 ms on the host first."""
    from flux_layers.ops import fused_ag_gemm
    check_shared_budget(m, n // tp, what)
    x, w, b = global_inputs(seed, m, k, n, dtype, layout)
    x_shard_m = x.chunk(tp)[rank]
    w_shard_n = w.chunk(tp, dim=0 if layout == "nt" else 1)[rank].contiguous()
    b_shard_n = b.chunk(tp)[rank].contiguous() if with_bias else None
    if late_rank == rank:
        time.sleep(0.010)
    out, gathered = fused_ag_gemm.ag_gemm(x_shard_m, w_shard_n, b_shard_n, group=dist.group.WORLD,
                                          weight_layout=layout, return_gathered=True, **op_kwargs)
    tag = f"rank {rank} {what} M={m} K={k} N={n} {dtype} {layout}"
    assert_close_rel(out, *references(x, w_shard_n, b_shard_n, layout), tag)
    assert torch.equal(gathered, x), f"{tag}: gathered input differs from the global x"


def gemm_rs_checked(rank: int, tp: int, seed: int, m: int, k: int, n: int, dtype: torch.dtype, layout: str, *,
                    what: str, with_bias: bool = True, late_rank: int | None = None, node_size: int = 0,
                    **op_kwargs) -> torch.Tensor:
    """One fused GEMM+ReduceScatter call on this rank's K shards of fresh global inputs, checked against the
    references; returns its output. ``op_kwargs`` go to fused_gemm_rs.gemm_rs (ws, tile, transport, ...).
    ``node_size``: the call runs the two-level plan in nodes of that many ranks, whose own roundings
    (oracle.two_level_reduce_scatter) set the bound instead of cuBLAS's single rounding."""
    from flux_layers.ops import fused_gemm_rs
    check_shared_budget(m, n, what)
    x, w, b = global_inputs(seed, m, k, n, dtype, layout)
    bias = b if with_bias else None
    x_shard_k = x.chunk(tp, dim=1)[rank].contiguous()
    w_shard_k = w.chunk(tp, dim=1 if layout == "nt" else 0)[rank].contiguous()
    if late_rank == rank:
        time.sleep(0.010)
    out = fused_gemm_rs.gemm_rs(x_shard_k, w_shard_k, bias, group=dist.group.WORLD, weight_layout=layout,
                                **op_kwargs)
    full, cublas = references(x, w, bias, layout)
    tag = f"rank {rank} {what} M={m} K={k} N={n} {dtype} {layout}"
    try:
        if node_size:
            baseline = oracle.two_level_reduce_scatter(x, w, bias, layout, tp, node_size, rank)
            assert_close_rel(out, full.chunk(tp)[rank], baseline, tag, "the two-level plan's rounding's")
        else:
            assert_close_rel(out, full.chunk(tp)[rank], cublas.chunk(tp)[rank], tag)
    except AssertionError as failed:  # which partials the output holds, block by block (an intermittent fault)
        fit = oracle.describe_fit(out, oracle.rank_partials(x, w, layout, tp, rank), bias)
        raise AssertionError(f"{failed}\npartials fitted by source rank: {fit}") from None
    return out


# ---------------------------------------------------------------- FP8 operands

def fp8_global_inputs(seed: int, rows: int, k: int, n: int):
    """The unsharded x [rows, K] and weight [N, K] in fp32 (rows and columns of different magnitudes, so that
    row-wise scales differ) and a bfloat16 bias [N]; identical on every rank. Cast them with ops.fp8.quantize."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, device="cuda") * torch.rand(rows, 1, generator=gen, device="cuda").add(0.1)
    w = torch.randn(n, k, generator=gen, device="cuda") * torch.rand(n, 1, generator=gen, device="cuda").add(0.1)
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    return x, w, bias


def fp8_w_scale(q, mode: str) -> torch.Tensor:
    """A quantized weight's scale as the ops take it: [1, N] row-wise (one per output column), else its one scale."""
    return q.scale.reshape(1, -1) if mode == "row" else q.scale


def check_fp8_output(out: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor, what: str,
                     ratio: float = 1.25) -> None:
    """``out`` has every element written and a relative error against ``ref`` (fp32 of the dequantized operands)
    within ``ratio`` of ``baseline``'s (the reference backend's output on the same operands)."""
    nan = torch.isnan(out).sum().item()
    assert nan == 0, f"{what}: {nan} elements not written"
    err, base = oracle.rel_error(out, ref), oracle.rel_error(baseline, ref)
    assert err <= ratio * max(base, 2.0**-10), f"{what}: rel error {err:.3e} vs the reference path's {base:.3e}"


def check_fp8_all_gather(rank: int, out: torch.Tensor, gathered, shards, wq, bias: torch.Tensor, w_scale: torch.Tensor,
                         what: str, fast_accum: bool = False) -> None:
    """An FP8 ops.ag_gemm call's results: ``out`` against an fp32 matmul of the dequantized operands beside the
    reference backend's output (:func:`check_fp8_output`), and its gathered input (a ScaledTensor) exactly the
    shards' rows and scales. ``shards``: every rank's quantized shard; ``wq``, ``bias``, ``w_scale``: this rank's."""
    from flux_layers import ops
    from flux_layers.ops.fp8 import dequantize
    mine = shards[rank]
    reference = ops.ag_gemm(mine.data, wq.data, bias, group=dist.group.WORLD, x_scale=mine.scale, w_scale=w_scale,
                            fast_accum=fast_accum, backend="reference")
    ref = torch.cat([dequantize(s) for s in shards]) @ dequantize(wq).t() + bias.float()
    check_fp8_output(out, ref, reference, what)
    if gathered is None:
        return
    assert torch.equal(gathered.data.view(torch.uint8), torch.cat([s.data for s in shards]).view(torch.uint8)), \
        f"{what}: gathered FP8 rows differ"
    scales = torch.cat([s.scale.reshape(-1) for s in shards])
    assert torch.equal(gathered.scale.reshape(-1), scales), f"{what}: gathered scales differ"
