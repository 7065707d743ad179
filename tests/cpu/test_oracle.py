"""The GPU tests' oracle (flux_layers/devtools/oracle.py), on CPU: the bound follows cuBLAS's own error (here the
same product rounded to bfloat16 once), an output rounded twice passes, one with four times the error fails, an
unwritten (NaN) element fails."""
from __future__ import annotations

import pytest
import torch

from flux_layers.devtools import oracle


def _problem(seed=0, m=64, k=512, n=48):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, b


def test_bound_follows_the_low_precision_product():
    x, w, b = _problem()
    ref = oracle.matmul_fp32(x, w, b, "nt")
    once = ref.to(torch.bfloat16)  # what an fp32-accumulating GEMM that rounds once produces
    ok, err, limit = oracle.verdict(once, ref, once)
    assert ok and 0 < err <= limit == oracle.bound(err, torch.bfloat16)
    partials = [oracle.matmul_fp32(x[:, i::2], w[:, i::2], None, "nt").to(torch.bfloat16) for i in range(2)]
    reduce_scattered = (partials[0].float() + partials[1].float() + b.float()).to(torch.bfloat16)
    assert oracle.verdict(reduce_scattered, ref, once)[0], "partials in bf16 summed in fp32 must pass"
    noisy = (ref + 4 * (once.float() - ref)).to(torch.bfloat16)
    assert not oracle.verdict(noisy, ref, once)[0]
    unwritten = once.clone()
    unwritten[3, 5] = float("nan")
    assert not oracle.verdict(unwritten, ref, once)[0]


def test_layouts_and_errors_on_device_agree():
    x, w, b = _problem(1)
    torch.testing.assert_close(oracle.matmul_fp32(x, w, b, "nt"), oracle.matmul_fp32(x, w.t().contiguous(), b, "nn"))
    torch.testing.assert_close(oracle.matmul_cublas(x, w, None, "nt").float(),
                               oracle.matmul_cublas(x, w.t().contiguous(), None, "nn").float())
    ref = oracle.matmul_fp32(x, w, None, "nt")
    out = ref.to(torch.bfloat16)
    on_device = oracle.errors(out, ref)
    assert on_device.dtype == torch.float64 and on_device.item() == oracle.rel_error(out, ref)


def test_floor_keeps_exact_products_checkable():
    x = torch.ones(8, 16, dtype=torch.bfloat16)
    w = torch.ones(8, 16, dtype=torch.bfloat16)
    ref = oracle.matmul_fp32(x, w, None, "nt")
    exact = oracle.matmul_cublas(x, w, None, "nt")
    assert oracle.rel_error(exact, ref) == 0
    assert oracle.verdict(exact, ref, exact) == (True, 0.0, oracle.RATIO * oracle.FLOOR[torch.bfloat16])


def _expected_ratio(tp: int, node_size: int) -> float:
    return (1 + ((node_size - 1) + (tp // node_size - 1) * (2 * node_size - 1)) / tp) ** 0.5


def test_two_level_baseline_rounds_as_the_plan_and_keeps_the_check_tight():
    x, w, b = _problem(2, m=512, k=2048, n=256)
    tp = 8
    ref = oracle.matmul_fp32(x, w, b, "nt")
    once = ref.to(torch.bfloat16)
    # the reference path's ring: bf16 partials, each running sum rounded to bf16 as NCCL's reduce-scatter does
    ring = oracle.matmul_fp32(x.chunk(tp, dim=1)[0], w.chunk(tp, dim=1)[0], None, "nt").to(torch.bfloat16)
    for q in range(1, tp):
        partial = oracle.matmul_fp32(x.chunk(tp, dim=1)[q], w.chunk(tp, dim=1)[q], None, "nt").to(torch.bfloat16)
        ring = (ring.float() + partial.float()).to(torch.bfloat16)
    ring = (ring.float() + b.float()).to(torch.bfloat16)
    ring_ratio = oracle.rel_error(ring, ref) / oracle.rel_error(once, ref)
    assert ring_ratio > 2.0, ring_ratio
    for node_size in (2, 4):
        rows = [oracle.two_level_reduce_scatter(x, w, b, "nt", tp, node_size, r) for r in range(tp)]
        assert all(r.dtype == torch.bfloat16 and r.shape == (512 // tp, 256) for r in rows)
        two_level = torch.cat(rows)
        ratio = oracle.rel_error(two_level, ref) / oracle.rel_error(once, ref)
        # the plan's extra roundings: 1.5x one rounding at 8 ranks in nodes of 2 or 4 (the module docstring)
        assert abs(ratio - _expected_ratio(tp, node_size)) < 0.1, (node_size, ratio)
        assert ratio < ring_ratio
        assert oracle.verdict(two_level, ref, two_level)[0]
        # a node partial that never arrived, or one of another block, fails against that baseline
        # (the next node's partial of rank 5's rows: its ranks' K columns)
        rank, block = 5, slice(5 * 64, 6 * 64)
        other = (rank // node_size + 1) % (tp // node_size)
        cols = slice(other * node_size * 2048 // tp, (other + 1) * node_size * 2048 // tp)
        lost = oracle.matmul_fp32(x[block][:, cols], w[:, cols], None, "nt")
        missing = (rows[rank].float() - lost).to(torch.bfloat16)
        assert not oracle.verdict(missing, ref[block], rows[rank])[0]
    nan = rows[0].clone()
    nan[0, 0] = float("nan")
    assert not oracle.verdict(nan, ref[:64], rows[0])[0]
    with pytest.raises(ValueError, match="nodes of 3"):
        oracle.two_level_reduce_scatter(x, w, b, "nt", tp, 3, 0)
    torch.testing.assert_close(oracle.two_level_reduce_scatter(x, w, b, "nt", tp, 4, 1),
                               oracle.two_level_reduce_scatter(x, w.t().contiguous(), b, "nn", tp, 4, 1))


def test_partials_fit_names_a_missing_or_stale_partial():
    x, w, b = _problem(3, m=256, k=512, n=64)
    tp, rank = 4, 1
    partials = oracle.rank_partials(x, w, "nt", tp, rank)
    assert len(partials) == tp and all(p.shape == (64, 64) for p in partials)
    exact = oracle.matmul_fp32(x, w, b, "nt").chunk(tp)[rank]
    torch.testing.assert_close(sum(partials) + b.float(), exact)
    said = oracle.describe_fit(exact.to(torch.bfloat16), partials, b, rows=32)
    blocks = said.split("; ")
    assert [blk.split(":")[0] for blk in blocks] == ["rows 0-31", "rows 32-63"], said
    assert all("every partial 1.00" in blk and float(blk.split("residual ")[1]) < 1e-2 for blk in blocks), said
    lost = (exact - partials[2]).to(torch.bfloat16)  # rank 2's partial never arrived
    lost[40, :3] = float("nan")
    said = oracle.describe_fit(lost, partials, b, rows=32)
    assert said.startswith("rows 0-31: rank 2 0.00, residual") and "rows 32-63: rank 2 " in said, said
    assert said.endswith(", 3 NaN"), said
    stale = exact.clone()
    stale[:32] = exact[:32] - partials[3][:32] + torch.randn(32, 64, generator=torch.Generator().manual_seed(4)) * 5
    said = oracle.describe_fit(stale, partials, b, rows=32)
    first, second = said.split("; ")
    assert "rank 3 " in first and float(first.split("residual ")[1]) > 0.1, said
    assert second.startswith("rows 32-63: every partial 1.00"), said
