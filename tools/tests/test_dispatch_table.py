"""The per-shape dispatch table: how tools/make_dispatch_table.py derives it from benchmark results, and that
the packaged table (flux_layers/tuning_tables/) still says what the result files it cites measured."""
import json
import os

import pytest

from flux_layers.runtime import tuning
from tools.make_dispatch_table import entries_from

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rs_row(m, fused, seq, epilogue=None, copy_engine=None, epilogue_key="fused_epilogue"):
    times = {"fused": fused, "gemm_then_nccl": seq}
    if epilogue is not None:
        times.update({epilogue_key: epilogue, "fused_copy_engine": copy_engine})
    return {"dtype": "bfloat16", "tp": 2, "m": m, "k": 4096, "n": 4096, "times_ms": times}


def test_entries_from_picks_the_faster_path_and_transport(tmp_path):
    results = tmp_path / "rs.json"
    results.write_text(json.dumps({"gpu": "G", "commit": "abc", "results": [
        _rs_row(1024, fused=0.9, seq=1.0),                                      # fused wins, one transport timed
        _rs_row(2048, fused=1.2, seq=1.0),                                      # sequential wins
        _rs_row(4096, fused=1.0, seq=1.5, epilogue=1.1, copy_engine=0.95),        # copy engine is the faster one
        _rs_row(8192, fused=1.0, seq=1.02, epilogue=1.01, copy_engine=1.05),      # epilogue, and still fused
        _rs_row(16384, fused=1.0, seq=1.04, epilogue=1.06, copy_engine=1.05),     # both transports lose
        # a record of an earlier run, which named the epilogue transport 'direct'
        _rs_row(32768, fused=1.0, seq=1.5, epilogue=0.9, copy_engine=0.95, epilogue_key="fused_direct")]}))
    gpu, entries = entries_from(str(results))
    assert gpu == "G"
    got = [(e["m"], e["path"], e.get("transport")) for e in entries]
    assert got == [(1024, "fused", None), (2048, "sequential", None), (4096, "fused", "copy_engine"),
                   (8192, "fused", "epilogue"), (16384, "sequential", "copy_engine"), (32768, "fused", "epilogue")]
    assert all(e["op"] == "gemm_rs" and e["source"] == f"{results} @ abc" for e in entries)
    # Keyed by the per-rank GEMM (K/tp for gemm_rs), the benchmark's global shape beside it.
    assert [(e["m"], e["k"], e["n"], e["global_mkn"]) for e in entries[:2]] == [(1024, 2048, 4096, [1024, 4096, 4096]),
                                                                               (2048, 2048, 4096, [2048, 4096, 4096])]
    assert entries[2]["fused_ms"] == 0.95  # the chosen transport's time, not the run's default


def test_packaged_table_matches_the_results_it_cites():
    tables = tuning._load_tables("")
    assert tables, "flux_layers/tuning_tables holds the measured dispatch table"
    checked = 0
    for table in tables:
        for entry in table["entries"]:
            path, _, commit = entry["source"].partition(" @ ")
            full = os.path.join(ROOT, path)
            if not os.path.exists(full):
                pytest.fail(f"dispatch entry {entry} cites {path}, which is not in the repository")
            _, fresh = entries_from(full)
            same_shape = [e for e in fresh if (e["op"], e["tp"], e["m"], e["k"], e["n"], e["dtype"], e.get("accum")) ==
                          (entry["op"], entry["tp"], entry["m"], entry["k"], entry["n"], entry["dtype"],
                           entry.get("accum"))]
            assert len(same_shape) == 1, f"{path} has no single row for {entry}"
            with open(full) as f:
                assert json.load(f).get("commit") == commit, f"{path} is no longer the run of {commit}"
            if entry["op"] == "gemm":  # a plain FP8 GEMM's entry (bench_gemm_fp8): its own shape, no ranks
                fresh_entry = {**same_shape[0], "source": entry["source"]}  # (the source as the tool was given it)
                assert fresh_entry == entry, f"{entry} disagrees with {path}: {same_shape[0]}"
                checked += 1
                continue
            # The key is what one rank held in that run (its own record: n_local / k_local), not the global shape.
            with open(full) as f:
                row = next(r for r in json.load(f)["results"]
                           if [r["m"], r["k"], r["n"]] == entry["global_mkn"] and r["tp"] == entry["tp"])
            held = ((row["m"], row["k"], row["n_local"]) if entry["op"] == "ag_gemm" else
                    (row["m"], row["k_local"], row["n"]))
            assert (entry["m"], entry["k"], entry["n"]) == held, f"{entry} is not keyed by the per-rank GEMM {held}"
            for key in ("path", "transport", "fused_ms", "sequential_ms"):
                assert same_shape[0].get(key) == entry.get(key), f"{key} of {entry} disagrees with {path}"
            if "transport" in entry:
                assert tuning.check_rs_transport(entry["transport"]) == entry["transport"]
            checked += 1
    assert checked > 0


def test_loop_times_decide_where_measured(tmp_path):
    """A shape whose fused op wins on GPU time but loses in the plain loop (host cost) goes sequential."""
    from tools.make_dispatch_table import apply_loop_times, loop_times
    loop = tmp_path / "overhead.json"
    rows = [{"op": "gemm_rs", "m": 2048, "k": 4096, "n": 4096, "layout": layout, "impl": impl, "loop_ms": ms}
            for layout, impl, ms in (("nt", "fused", 0.20), ("nn", "fused", 0.16), ("nt", "sequential", 0.12),
                                     ("nn", "sequential", 0.14), ("nt", "auto", 0.2))]
    loop.write_text(json.dumps({"tp": 2, "shared_gpu": False, "commit": "def", "results": rows}))
    times = loop_times(str(loop))
    # bench_overhead names the global 2048x4096x4096; the table's key is one rank's 2048x2048x4096.
    assert times == {("gemm_rs", 2, 2048, 2048, 4096): pytest.approx({"fused": 0.18, "sequential": 0.13, "auto": 0.2})}
    entries = [{"op": "gemm_rs", "tp": 2, "m": 2048, "k": 2048, "n": 4096, "path": "fused"},
               {"op": "gemm_rs", "tp": 2, "m": 4096, "k": 2048, "n": 4096, "path": "fused"}]
    apply_loop_times(entries, times, "overhead.json @ def")
    assert entries[0]["path"] == "sequential" and entries[0]["fused_loop_ms"] == pytest.approx(0.18)
    assert entries[1] == {"op": "gemm_rs", "tp": 2, "m": 4096, "k": 2048, "n": 4096, "path": "fused"}
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps({"tp": 2, "shared_gpu": True, "results": []}))
    with pytest.raises(SystemExit, match="not TP figures"):
        loop_times(str(shared))


def test_fp8_gemm_entries_from_a_run():
    """A plain FP8 GEMM run's entries: cuBLASLt ('sequential') unless the op library's best configuration was faster
    under every scale mode measured; that configuration's tile and swizzle either way."""
    from tools.make_dispatch_table import fp8_gemm_entries
    row = {"m": 4096, "k": 2048, "n": 4096, "dtype": "e4m3xe4m3", "accum": "fast"}
    run = {"commit": "abc", "results": [
        {**row, "scale": "tensor", "flux_best_over_cublas": 1.05, "config": "256x128_swz8_sk"},
        {**row, "scale": "row", "flux_best_over_cublas": 0.99, "config": "128x256_swz16_dp"}]}
    (entry,) = fp8_gemm_entries(run, "r.json")
    assert entry["path"] == "sequential" and (entry["tile"], entry["swizzle"]) == (0, 8), entry
    assert (entry["dtype"], entry["w_dtype"], entry["tp"], entry["accum"]) == ("float8_e4m3fn", "float8_e4m3fn", 1,
                                                                                "fast")
    assert entry["source"] == "r.json @ abc"
    run["results"][1]["flux_best_over_cublas"] = 1.01
    assert fp8_gemm_entries(run, "r.json")[0]["path"] == "fused"
