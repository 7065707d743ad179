"""The benchmark harness's interleaved rounds (timing itself needs a GPU; here the timer is replaced)."""
from benchmarks import harness


def test_time_interleaved_rotates_evenly_and_keeps_every_sample(monkeypatch):
    calls = []

    def fake_samples(fn, *, reps, warmup, group):
        calls.append(fn(0))
        return [float(len(calls))] * reps

    monkeypatch.setattr(harness, "time_samples_ms", fake_samples)
    variants = {name: (lambda i, name=name: name) for name in "abcdef"}
    rounds_seen = []
    samples = harness.time_interleaved(variants, reps=4, rounds=3, on_round=lambda r, s: rounds_seen.append(r))
    assert rounds_seen == [0, 1, 2]
    assert calls == list("abcdef") + list("cdefab") + list("efabcd")  # starts spread over the variants
    assert all(len(s) == 3 * 4 for s in samples.values())
    assert samples["c"][:4] == [3.0] * 4 and samples["c"][4:8] == [7.0] * 4  # each round's samples, in order


def test_time_loops_interleaved_rotates_like_the_rounds_and_keeps_one_sample_per_round(monkeypatch):
    order = []

    def fake_loop(fn, *, calls):
        order.append(fn(0))
        return float(len(order) * calls)

    monkeypatch.setattr(harness, "time_loop_ms", fake_loop)
    variants = {name: (lambda i, name=name: name) for name in "abc"}
    samples = harness.time_loops_interleaved(variants, calls=10, rounds=3)
    assert order == list("abc") + list("bca") + list("cab")
    assert samples == {"a": [10.0, 60.0, 80.0], "b": [20.0, 40.0, 90.0], "c": [30.0, 50.0, 70.0]}


def test_time_interleaved_notes_each_variants_window(monkeypatch):
    monkeypatch.setattr(harness, "time_samples_ms", lambda fn, *, reps, warmup, group: [1.0] * reps)
    windows = []
    harness.time_interleaved({"a": None, "b": None}, reps=2, rounds=2, windows=windows)
    assert [w[0] for w in windows] == ["a", "b", "b", "a"]
    assert all(start <= end for _, start, end in windows)
    assert all(windows[i][2] <= windows[i + 1][1] for i in range(len(windows) - 1))


def test_gpu_sampler_averages_inside_the_windows():
    """GpuSampler on a stand-in for nvidia-smi: lines parsed with their own timestamps, unreadable ones skipped,
    means per window and GPU."""
    import datetime
    import sys

    from flux_layers.devtools.gpu_monitor import GpuSampler
    base = datetime.datetime(2026, 1, 2, 3, 4, 5)

    def at(seconds):
        return (base + datetime.timedelta(seconds=seconds)).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]

    lines = [f"{at(0)}, 0, 1980, 650.5", f"{at(0)}, 1, 1755, 700.0", f"{at(0.1)}, 0, [N/A], 3", "garbage",
             f"{at(2)}, 0, 1000, 100"]
    script = "import time\n" + "".join(f"print({line!r}, flush=True)\n" for line in lines) + "time.sleep(30)\n"
    with GpuSampler(command=[sys.executable, "-c", script]) as sampler:
        import time
        deadline = time.time() + 20
        while len(sampler.samples) < 3 and time.time() < deadline:
            time.sleep(0.05)
    assert len(sampler.samples) == 3
    t0 = base.timestamp()
    summary = sampler.summary([("early", t0 - 1, t0 + 1), ("all", t0 - 1, t0 + 3)], gpu=0)
    assert summary["early"] == {"sm_clock_mhz": 1980.0, "power_w": 650.5, "samples": 1}
    assert summary["all"]["samples"] == 2 and summary["all"]["sm_clock_mhz"] == 1490.0
    assert sampler.summary([("late", t0 + 10, t0 + 20)], gpu=1)["late"]["sm_clock_mhz"] is None


def test_sweep_row_takes_the_default_variant_and_the_ceiling():
    from benchmarks.bench_sweep import DEFAULT_VARIANT, parse_shapes, sweep_row
    results = {name: {"step_ms": ms, "gpus": None, "paths": {}, "rs_transport": None}
               for name, ms in (("baseline", 100.0), (DEFAULT_VARIANT, 95.0), ("flux_rs_dgrad", 97.0),
                                ("baseline_no_comm", 90.0))}
    row = sweep_row("m", 4096, 11008, 32, 4096, 4, results, {"peak_mem_gib": 3.0})
    assert (row["baseline_ms"], row["flux_ms"], row["ceiling_ms"]) == (100.0, 95.0, 90.0)
    assert abs(row["speedup"] - 100 / 95) < 1e-12 and abs(row["ceiling_speedup"] - 100 / 90) < 1e-12
    assert abs(row["share_of_ceiling_gain"] - (100 / 95 - 1) / (100 / 90 - 1)) < 1e-12
    assert set(row["variants"]) == set(results) and row["variants"]["flux_rs_dgrad"]["speedup"] == 100 / 97
    assert len(parse_shapes("")) == 5 and parse_shapes("a:1:2:3:4:5") == [("a", 1, 2, 3, 4, 5)]


def test_positive_ints_parses_lists_and_rejects_anything_else():
    import argparse

    import pytest
    assert harness.positive_ints("8") == (8,) and harness.positive_ints("2,4,64") == (2, 4, 64)
    for bad in ("", "0", "8,", "8,-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
            harness.positive_ints(bad)
