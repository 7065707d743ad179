"""benchmarks/bench_layer.py on CPU: the variants' calls are decided before their timed steps, never inside them,
and each variant records what the library resolved for its calls, not the setting it asked for."""
from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import bench_layer, harness
from flux_layers import ops
from flux_layers.ops import _dispatch
from flux_layers.ops.backend import Choice
from tools.make_dispatch_table import rs_transport_times

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _GemmBlock(torch.nn.Module):
    """Stands in for a transformer block: two ops.gemm calls (each decided by the library like a layer's GEMMs)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(2 * hidden, hidden))
        self.w2 = torch.nn.Parameter(torch.randn(hidden, 2 * hidden))

    def forward(self, x, attention_mask=None):
        h = ops.gemm(x.reshape(-1, x.shape[-1]), self.w1)
        return ops.gemm(h, self.w2).view(x.shape)


class _CpuEvent:
    """torch.cuda.Event on CPU: time_samples_ms records each repetition's start, then its end, so record() calls
    alternate between opening and closing the timed window."""
    timed = False

    def __init__(self, **_):
        pass

    def record(self):
        _CpuEvent.timed = not _CpuEvent.timed

    def elapsed_time(self, _end):
        return 1.0


@pytest.fixture
def decisions_in_timed_steps(monkeypatch):
    """(decisions made while a timed repetition runs, decisions made outside), counted at the dispatcher's choose and
    at every refresh of the kept decisions; the harness's own time_samples_ms runs on CPU stand-ins for CUDA."""
    monkeypatch.setattr(torch.cuda, "Event", _CpuEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    inside, outside = [], []
    real_choose, real_refresh = _dispatch.choose, _dispatch.refresh

    def note(what):
        (inside if _CpuEvent.timed else outside).append(what)

    def choose(op, **kw):
        note(("choose", op, kw["mkn"]))
        return real_choose(op, **kw)

    def refresh():
        note(("refresh",))
        real_refresh()
    monkeypatch.setattr(_dispatch, "choose", choose)
    monkeypatch.setattr(_dispatch, "refresh", refresh)
    ops.refresh_settings()
    yield inside, outside
    _CpuEvent.timed = False
    ops.refresh_settings()


def test_timed_steps_make_no_decision(decisions_in_timed_steps):
    inside, outside = decisions_in_timed_steps
    variants = dict(bench_layer.VARIANTS)
    variants[bench_layer.CEILING[0]] = bench_layer.CEILING[1]
    blocks = {name: _GemmBlock(8) for name in variants}
    inp = torch.randn(4, 1, 8, requires_grad=True)
    steps, settings = bench_layer.variant_steps(blocks, variants, inp, torch.randn(4, 1, 8))
    rounds, reps = 2, 3
    harness.time_interleaved(steps, reps=reps, rounds=rounds, warmup=1, settings=settings)
    assert not _CpuEvent.timed
    assert inside == [], f"decisions inside the timed steps: {inside}"
    # Not vacuous: the warm-ups decided (the two GEMMs' shapes, at the latest after each settings change).
    assert {("choose", "gemm", (4, 8, 16)), ("choose", "gemm", (4, 16, 8))} <= set(outside)


def _measured_rs_transport(global_mkn) -> str:
    with open(os.path.join(ROOT, "benchmarks/results/gemm_rs_h200x2.json")) as f:
        row = next(r for r in json.load(f)["results"] if (r["m"], r["k"], r["n"]) == global_mkn)
    t = rs_transport_times(row["times_ms"])
    return "epilogue" if t["epilogue"] <= t["copy_engine"] else "copy_engine"


class _Linear(torch.nn.Module):
    def __init__(self, paths, gemms):
        super().__init__()
        self.last_paths, self.last_gemms, self.tp_group = paths, gemms, None


@pytest.mark.parametrize("setting", [None, "epilogue"])
def test_what_ran_records_the_resolved_transport_not_the_setting(monkeypatch, setting):
    from flux_layers.runtime import tuning
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "NVIDIA H200")
    monkeypatch.delenv("FLUX_LAYERS_TRANSPORT", raising=False)
    if setting is None:
        monkeypatch.delenv("FLUX_LAYERS_RS_TRANSPORT", raising=False)  # the default: 'auto'
    else:
        monkeypatch.setenv("FLUX_LAYERS_RS_TRANSPORT", setting)
    tuning._load_tables.cache_clear()
    global_mkn = (8192, 28672, 8192)  # a row-parallel fc2 at TP 2: one rank's GEMM is 8192 x 14336 x 8192
    block = torch.nn.Sequential(_Linear(
        {"fprop": Choice("fused", "auto"), "dgrad": Choice("reference", "switch"), "wgrad": Choice("local", "")},
        {"fprop": ("gemm_rs", (8192, 14336, 8192)), "dgrad": None}))
    ran = bench_layer.what_ran(block, tp=2)
    expected = setting or _measured_rs_transport(global_mkn)
    assert ran["0"]["fprop"]["transport"] == expected and expected != "auto"
    assert ran["0"]["fprop"]["config"] == tuning.kernel_name(tuning.resolve_kernel(
        "gemm_rs", dtype=torch.bfloat16, tp=2, mkn=(8192, 14336, 8192)))
    assert "transport" not in ran["0"]["dgrad"] and ran["0"]["dgrad"]["path"] == "reference"
    assert bench_layer.rs_transports(ran) == [expected]
    tuning._load_tables.cache_clear()
