"""The tuning table's key convention (flux_layers/runtime/tuning.py: the per-rank GEMM) through real calls' decisions.

gloo groups of 2, 4 and 8 CPU processes make the decisions of ``ops.ag_gemm`` / ``ops.gemm_rs`` calls (the
dispatcher's, ``flux_layers.ops._dispatch``) and ``ops.plan`` queries on the tensors one rank holds for each shape
the benchmarks measured (zero-stride tensors: nothing is computed). On CPU the fused path is blocked before the
table is read, so the key each decision hands the dispatcher (``choose``'s ``mkn``) is recorded and then decided the
way an unblocked call is (``backend.auto_choice``, ``tuning.rs_transport``, with the GPU name set to the table's).
At TP 2 and 4 the packaged table must give what the committed benchmark results measured for that global shape,
including the TP=4 shape where the sequential path won; at TP 8, which has no measurements, a table made here holds
each shape twice, the per-rank key and (as a decoy with the opposite verdict) the global one.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from flux_layers.devtools.launch import run_distributed
from tools.make_dispatch_table import rs_transport_times

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = {(op, tp): f"benchmarks/results/{op}_h200x{tp}.json" for op in ("ag_gemm", "gemm_rs") for tp in (2, 4)}
SEQUENTIAL_TIME = {"ag_gemm": "nccl_then_gemm", "gemm_rs": "gemm_then_nccl"}


def _per_rank(op: str, tp: int, m: int, k: int, n: int) -> tuple[int, int, int]:
    """The GEMM one rank's kernel runs for a global M x K x N: ag_gemm gathers all M rows and computes its N/tp
    columns; gemm_rs multiplies all M rows by its K/tp slice of the reduction."""
    return (m, k, n // tp) if op == "ag_gemm" else (m, k // tp, n)


def _measured(op: str, tp: int) -> list[dict]:
    """What the committed benchmark run measured per global shape: the faster path, the faster reduce-scatter
    transport where both were timed, and the two times the table entry must carry."""
    with open(os.path.join(ROOT, RESULTS[(op, tp)])) as f:
        run = json.load(f)
    assert run["gpu"] == "NVIDIA H200"
    shapes = []
    for r in run["results"]:
        t = r["times_ms"]
        fused = t["fused"]
        transport = None
        timed = rs_transport_times(t) if op == "gemm_rs" else {}
        if timed and None not in timed.values():
            transport = "epilogue" if timed["epilogue"] <= timed["copy_engine"] else "copy_engine"
            fused = timed[transport]
        seq = t[SEQUENTIAL_TIME[op]]
        shapes.append({"op": op, "global": (r["m"], r["k"], r["n"]), "key": _per_rank(op, tp, r["m"], r["k"], r["n"]),
                       "path": "reference" if seq < fused else "fused", "transport": transport, "fused_ms": fused,
                       "sequential_ms": seq})
    return shapes


def _rank_tensors(op: str, tp: int, m: int, k: int, n: int, layout: str):
    """This rank's x and weight for the global shape (zero-stride views: the decision reads shapes only)."""
    def held(rows, cols):
        return torch.zeros((), dtype=torch.bfloat16).expand(rows, cols)
    if op == "ag_gemm":
        x, (k_w, n_w) = held(m // tp, k), (k, n // tp)
    else:
        x, (k_w, n_w) = held(m, k // tp), (k // tp, n)
    return x, held(n_w, k_w) if layout == "nt" else held(k_w, n_w)


def _recorded_keys(monkeypatch_targets):
    """Wrap ``choose`` where the dispatcher and ops.plan call it; returns the list of (op, mkn, backend) asked."""
    asked = []
    for module in monkeypatch_targets:
        real = module.choose

        def spy(op, *, real=real, **kw):
            asked.append((op, kw["mkn"], kw["backend"]))
            return real(op, **kw)
        module.choose = spy
    return asked


def _decide_every_shape(rank, tp, shapes, table, gpu):
    import torch.distributed as dist

    from flux_layers import ops
    from flux_layers.ops import _dispatch, backend
    from flux_layers.runtime import tuning
    os.environ.update(FLUX_LAYERS_TUNING=table, FLUX_LAYERS_DISPATCH="table", FLUX_LAYERS_RS_TRANSPORT="auto")
    ops.refresh_settings()
    tuning._gpu_name = lambda: gpu
    asked = _recorded_keys((_dispatch,))
    group = dist.group.WORLD
    for s in shapes:
        op, expected_key = s["op"], tuple(s["key"])
        for layout in ("nt", "nn"):
            x, w = _rank_tensors(op, tp, *s["global"], layout)
            what = f"rank {rank}: {op} {layout} global {s['global']} at TP {tp}"
            del asked[:]
            decided = _dispatch.decided(op, x, w, group, layout, None)  # what the call's first run decides
            plan = ops.plan(op, x, w, group=group, weight_layout=layout)
            assert plan.path == "reference", f"{what}: the fused path is blocked on CPU, got {plan}"
            assert plan == decided.choice, f"{what}: ops.plan {plan} is not the call's decision {decided.choice}"
            # One key, from the call's decision (ops.plan reads the same decision): the per-rank GEMM.
            assert asked == [(op, expected_key, None)], f"{what}: decisions asked about {asked}"
            entry = tuning.dispatch_entry(op, dtype=torch.bfloat16, tp=tp, mkn=expected_key)
            assert entry is not None, f"{what}: no table entry for the call's key {expected_key}"
            assert (entry["fused_ms"], entry["sequential_ms"]) == (s["fused_ms"], s["sequential_ms"]), \
                f"{what}: the call's key {expected_key} found the entry of another measurement: {entry}"
            choice = backend.auto_choice(op, dtype=torch.bfloat16, tp=tp, mkn=expected_key)
            assert choice.path == s["path"], f"{what}: decided {choice}, measured faster: {s['path']}"
            if op == "gemm_rs":
                got = tuning.rs_transport(dtype=torch.bfloat16, tp=tp, mkn=expected_key)
                assert got == (s["transport"] or "epilogue"), f"{what}: transport {got}, measured {s['transport']}"
        _dispatch.refresh()


@pytest.mark.parametrize("tp", [2, 4])
def test_real_calls_find_the_measured_entry_of_their_shape(tp):
    shapes = _measured("ag_gemm", tp) + _measured("gemm_rs", tp)
    if tp == 4:  # the table's one sequential entry must be reachable by a real call
        assert [s["global"] for s in shapes if s["path"] == "reference"] == [(2048, 4096, 4096)]
    run_distributed(_decide_every_shape, tp, shapes, "", "NVIDIA H200")


def test_real_calls_at_tp8_take_the_per_rank_entry_not_the_global_decoy(tmp_path):
    tp, entries, shapes = 8, [], []
    for op, rows in (("ag_gemm", _measured("ag_gemm", 2)), ("gemm_rs", _measured("gemm_rs", 2))):
        for r in rows:
            m, k, n = r["global"]
            key = _per_rank(op, tp, m, k, n)
            base = {"op": op, "dtype": "bfloat16", "tp": tp, "source": "this test"}
            entries.append({**base, "m": key[0], "k": key[1], "n": key[2], "path": "sequential",
                            "transport": "copy_engine", "fused_ms": 2.0, "sequential_ms": 1.0})
            entries.append({**base, "m": m, "k": k, "n": n, "path": "fused", "transport": "epilogue",
                            "fused_ms": 1.0, "sequential_ms": 2.0})
            shapes.append({"op": op, "global": (m, k, n), "key": key, "path": "reference", "transport": "copy_engine",
                           "fused_ms": 2.0, "sequential_ms": 1.0})
    table = tmp_path / "tp8.json"
    table.write_text(json.dumps({"gpu": "cpu", "entries": entries}))
    run_distributed(_decide_every_shape, tp, shapes, str(table), "cpu")


def test_packaged_table_declares_the_per_rank_key():
    from flux_layers.runtime import tuning
    tuning._load_tables.cache_clear()
    tables = tuning._load_tables("")
    assert tables and all(t.get("key") == tuning.TABLE_KEY for t in tables)


@pytest.mark.parametrize("op,rows,k,n,tp,key", [("ag_gemm", 1024, 4096, 2048, 2, (2048, 4096, 2048)),
                                                ("ag_gemm", 512, 8192, 1024, 8, (4096, 8192, 1024)),
                                                ("gemm_rs", 4096, 1024, 8192, 4, (4096, 1024, 8192)),
                                                ("gemm", 64, 32, 16, 1, (64, 32, 16))])
def test_table_key_is_the_per_rank_gemm(op, rows, k, n, tp, key):
    from flux_layers.runtime import tuning
    assert tuning.table_key(op, rows, k, n, tp) == key


def test_nearest_entry_is_taken_within_half_a_factor_two_only(monkeypatch, tmp_path):
    from flux_layers.runtime import tuning
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"gpu": "cpu", "entries": [
        {"op": "gemm_rs", "dtype": "bfloat16", "tp": 2, "m": 4096, "k": 4096, "n": 8192, "path": "sequential"}]}))
    monkeypatch.setenv("FLUX_LAYERS_TUNING", str(table))
    tuning._load_tables.cache_clear()
    try:
        def hit(mkn):
            return tuning.dispatch_entry("gemm_rs", dtype=torch.bfloat16, tp=2, mkn=mkn) is not None
        assert hit((4096, 4096, 8192)) and hit((4096, 5120, 8192))  # log2(5/4) = 0.32
        assert not hit((6144, 4096, 8192))  # log2(1.5) = 0.58
        assert not hit((4096, 8192, 8192)) and not hit((4096, 2048, 8192))  # a factor 2: the global key at TP 2
    finally:
        tuning._load_tables.cache_clear()


def test_fp8_entries_are_chosen_within_their_accumulation(monkeypatch, tmp_path):
    """A split-accumulation call takes the nearest split entry even where a fast one is nearer (and back), and
    its kernel comes from that entry, not from the default."""
    from flux_layers.runtime import tuning
    table = tmp_path / "t.json"
    entry = {"op": "gemm", "dtype": "float8_e4m3fn", "tp": 1, "k": 4096, "n": 4096}
    table.write_text(json.dumps({"gpu": "cpu", "entries": [
        dict(entry, m=4096, accum="fast", tile=1, swizzle=8),
        dict(entry, m=5120, accum="split", tile=2, swizzle=4)]}))
    monkeypatch.setenv("FLUX_LAYERS_TUNING", str(table))
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "cpu")
    tuning._load_tables.cache_clear()
    try:
        fp8, mkn = torch.float8_e4m3fn, (4096, 4096, 4096)
        assert tuning.dispatch_entry("gemm", dtype=fp8, tp=1, mkn=mkn)["accum"] == "fast"  # the nearest of any
        assert tuning.dispatch_entry("gemm", dtype=fp8, tp=1, mkn=mkn, accum="split")["m"] == 5120
        assert tuning.kernel_config("gemm", dtype=fp8, tp=1, mkn=mkn, fast_accum=False) == (2, 4)
        assert tuning.kernel_config("gemm", dtype=fp8, tp=1, mkn=(5120, 4096, 4096), fast_accum=True) == (1, 8)
        assert tuning.kernel_config("gemm", dtype=fp8, tp=1, mkn=(16384, 4096, 4096), fast_accum=False) == \
            tuning._DEFAULT_KERNEL_FP8["split"]  # nothing near: the default
    finally:
        tuning._load_tables.cache_clear()
