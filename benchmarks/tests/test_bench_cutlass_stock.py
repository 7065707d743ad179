"""benchmarks/bench_cutlass_stock.py on CPU: its timing helper writes each variant's median time and TFLOP/s."""
from __future__ import annotations

import pytest

from benchmarks import bench_cutlass_stock


def test_time_into_writes_each_variants_median_and_rate(monkeypatch):
    samples = {"cublas": [4.0, 1.0, 1.5], "flux": [9.0, 4.0, 5.0]}  # medians 1.5 and 5, means not
    seen = {}

    def fake_time_interleaved(variants, reps, rounds):
        seen.update(variants=list(variants), reps=reps, rounds=rounds)
        return {name: samples[name] for name in variants}

    monkeypatch.setattr(bench_cutlass_stock, "time_interleaved", fake_time_interleaved)
    row = {"m": 1000}
    names = bench_cutlass_stock.time_into(row, {"cublas": None, "flux": None}, 1000, 2000, 3000, reps=7, rounds=2)
    assert names == ["cublas", "flux"]
    assert seen == {"variants": ["cublas", "flux"], "reps": 7, "rounds": 2}
    assert row["cublas_ms"] == 1.5 and row["flux_ms"] == 5.0
    flop = 2.0 * 1000 * 2000 * 3000
    assert row["cublas_tflops"] == pytest.approx(flop / 1.5 / 1e9)
    assert row["flux_tflops"] == pytest.approx(flop / 5.0 / 1e9)
    assert row["m"] == 1000
