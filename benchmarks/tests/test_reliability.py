"""benchmarks/reliability.py without GPUs: its settings, the merge of the ranks' records, and that a failing or
overrunning scenario is recorded with its error (and what its ranks wrote) instead of stopping the run."""
from __future__ import annotations

import os

import pytest

from benchmarks import reliability


def test_defaults_and_shared_gpu_defaults():
    opts = reliability.options(reliability.parse_args([]))
    assert opts["stress_calls"] >= 10_000 and opts["late_ms"] == 100.0 and opts["stress_kn"] == 1024
    shared = reliability.options(reliability.parse_args(["--shared-gpu"]))
    assert shared["stress_calls"] >= 10_000 and shared["late_ms"] < 100 and shared["stress_kn"] == 512
    assert reliability.parse_args([]).out == "benchmarks/results/reliability_h200x2.json"
    custom = reliability.options(reliability.parse_args(["--late-ms", "5", "--late-every", "7", "--stress-calls",
                                                         "300", "--stress-rows", "8,16"]))
    assert (custom["late_ms"], custom["late_every"], custom["stress_calls"], custom["stress_rows"]) == \
        (5.0, 7, 300, [8, 16])
    with pytest.raises(SystemExit):
        reliability.parse_args(["--scenarios", "peer_death,nap"])


def test_every_scenario_has_a_runner_and_a_time_limit():
    opts = reliability.options(reliability.parse_args([]))
    assert set(reliability.RUNNERS) == set(reliability.SCENARIOS)
    for name in reliability.SCENARIOS:
        assert 0 < reliability.limit_s(name, opts) <= 600
    assert reliability.limit_s("peer_death", opts) > opts["timeout_s"] + 10


def test_merges():
    opts = reliability.options(reliability.parse_args([]))
    death = reliability._merge_peer_death(
        {0: {"role": "survivor", "raised": True, "seconds": 7.1, "message": "rank 0 timed out ... rank 1",
             "good_before": True}, 1: {"role": "died"}}, opts)
    assert death["raised"] and death["names_peer"] and death["within_timeout_plus_10s"] and death["seconds"] == 7.1
    assert death["pipelined_drain_s"] == 0  # a record without the pipelined calls' figure (older runs)
    drained = reliability._merge_peer_death({0: {"role": "survivor", "raised": True, "seconds": 5.0, "message": "",
                                                 "good_before": True, "pipelined_drain_s": 5.0}}, opts)
    assert drained["pipelined_drain_s"] == 5.0
    host = {"raised": True, "message": "rank 0: ... rank 1: ...", "names_every_rank": True, "later_ok": True}
    device = {"device": True, "raised": True, "message": "went out of step", "names_every_rank": True,
              "seconds": 0.3, "later_ok": True}
    mismatch = reliability._merge_mismatch({r: {"M": host, "out_of_step_ag_gemm": dict(device, seconds=0.1 + r)}
                                            for r in range(2)}, opts)
    assert mismatch["raised_on_both"] and mismatch["names_every_rank"] and mismatch["later_ok"]
    assert (mismatch["device_seconds"], mismatch["device_message"]) == (1.1, "went out of step")
    missed = reliability._merge_mismatch({0: {"out_of_step_ag_gemm": device},
                                          1: {"out_of_step_ag_gemm": dict(device, raised=False)}}, opts)
    assert not missed["raised_on_both"]
    graph = reliability._merge_graph_timeout({0: {"replay_ok": True, "raised": True, "later_replays_nan": False,
                                                  "first_replay_peer_rows_written": 96,
                                                  "later_replay_max_s": 13.0}, 1: {"replay_ok": True}}, opts)
    assert graph["raised"] and graph["later_replays_nan"] is False and graph["later_replay_max_s"] == 13.0
    assert graph["first_replay_peer_rows_written"] == 96
    rows = [{"case": "a", "clear": True, "raised": True, "later_ok": True, "epoch_advanced": False},
            {"case": "b", "clear": False, "raised": True, "later_ok": True, "epoch_advanced": False}]
    other = [dict(r, clear=True) for r in rows]
    bad = reliability._merge_bad_inputs({0: {"rows": rows}, 1: {"rows": other}}, opts)
    assert (bad["cases"], bad["unclear"], bad["unclear_cases"], bad["later_calls_ok"]) == (2, 1, ["b"], True)
    stress = reliability._merge_stress({r: {"calls": 10, "mismatches": r, "seconds": 1.0 + r,
                                            "worst_error_over_bound": 0.5, "first_mismatches": []}
                                        for r in range(2)}, opts)
    assert (stress["mismatches"], stress["seconds"]) == (1, 2.0)


def _half_fails(rank, tp, opts, out_dir):
    reliability._write(out_dir, rank, {"role": "survivor", "raised": True, "seconds": 1.0, "message": "m",
                                       "good_before": True})
    if rank == 1:
        raise RuntimeError("rank 1 broke")


def _hangs(rank, tp, opts, out_dir):
    import time
    reliability._write(out_dir, rank, {"role": "died"})
    time.sleep(60)


@pytest.fixture
def cpu_runner(monkeypatch):
    monkeypatch.setitem(reliability.RUNNERS, "peer_death", (_half_fails, reliability._merge_peer_death))
    monkeypatch.setitem(reliability.RUNNERS, "stress", (_hangs, reliability._merge_stress))
    opts = reliability.options(reliability.parse_args([]))
    opts.update(backend="gloo", stress_limit_s=3)
    return opts


def test_a_failing_scenario_is_recorded_with_what_its_ranks_wrote(cpu_runner):
    record = reliability.run_scenario("peer_death", 2, cpu_runner)
    assert "rank 1 broke" in record["error"]
    assert record["raised"] and record["survivors"] == 2  # both ranks wrote before rank 1 failed


def test_an_overrunning_scenario_is_stopped_at_its_limit(cpu_runner):
    record = reliability.run_scenario("stress", 2, cpu_runner)
    assert "did not finish within 3" in record["error"] and record["wall_s"] < 30
    assert not [p for p in os.listdir("/tmp") if p.startswith("reliability_stress_")], "scratch folder left behind"


def test_main_writes_the_record_after_every_scenario(tmp_path, monkeypatch):
    import json

    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ran = []

    def fake(name, world, opts, launch=None):
        ran.append((name, world, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")))
        return {"ok": True, "wall_s": 0.0}
    monkeypatch.setattr(reliability, "run_scenario", fake)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "unset")  # recorded, so that main's setting is undone after
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    out = tmp_path / "reliability.json"
    reliability.main(["--scenarios", "bad_inputs,stress", "--out", str(out), "--stress-calls", "500"])
    record = json.loads(out.read_text())
    assert ran == [("bad_inputs", 2, "1"), ("stress", 2, "1")]
    for key in ("command", "commit", "gpu", "gpu_count", "torch", "settings", "bad_inputs", "stress"):
        assert key in record, key
    assert record["command"].endswith("--stress-calls 500") and record["settings"]["stress_calls"] == 500
    assert record["tp"] == 2 and record["shared_gpu"] is False
