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
