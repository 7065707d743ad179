"""The stress run of flux_layers/devtools/stress.py on CPU (reference backend, gloo): every rank draws the same calls,
each output is checked against its problem's reference in batches, and a wrong output is counted as a mismatch."""
from __future__ import annotations

import torch

from flux_layers.devtools import stress
from flux_layers.devtools.launch import run_distributed

CFG = stress.StressConfig(calls=120, batch=16, rows=(2, 5, 8), k=32, n=16, input_sets=2, late_every=0, seed=3,
                          dtype=torch.float32, device="cpu")


def _clean(rank, tp):
    import torch.distributed as dist
    record = stress.run(rank, tp, dist.group.WORLD, CFG)
    assert record["calls"] == record["eager_calls"] == 120 and record["mismatches"] == 0, record
    assert record["problems"] == 12 and 0 < record["worst_error_over_bound"] <= 1, record


def test_clean_run_has_no_mismatch():
    run_distributed(_clean, 2)


def _corrupted(rank, tp):
    import torch.distributed as dist
    real = stress._call
    calls = [0]

    def call(op, layout, group, backend):
        fn = real(op, layout, group, backend)

        def wrong_every_tenth(x, w, b):
            out = fn(x, w, b)
            calls[0] += 1
            return out * 1.01 if calls[0] % 10 == 0 else out
        return wrong_every_tenth
    stress._call = call
    record = stress.run(rank, tp, dist.group.WORLD, CFG)
    warm_up = record["problems"]  # the warm-up calls are not checked
    assert record["mismatches"] == sum(1 for i in range(warm_up + 1, warm_up + 121) if i % 10 == 0), record
    assert record["first_mismatches"] and record["first_mismatches"][0]["rel_error"] > 1e-3


def test_wrong_outputs_are_counted():
    run_distributed(_corrupted, 2)
