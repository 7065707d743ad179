"""Turn operator benchmark results into the per-shape dispatch table the library reads (flux_layers/tuning_tables/,
package data of flux_layers).

    python -m tools.make_dispatch_table benchmarks/results/ag_gemm_h200x2.json \
        benchmarks/results/gemm_rs_h200x2.json benchmarks/results/gemm_fp8_h200.json \
        --out flux_layers/tuning_tables/dispatch_h200.json

The benchmarks name a shape by its global M x K x N (bench_ag_gemm: N split over the ranks; bench_gemm_rs: K split);
the table is keyed by the per-rank GEMM one rank's kernel runs, as every lookup passes it (the key convention of
flux_layers/runtime/tuning.py): ag_gemm M x K x N/tp, gemm_rs M x K/tp x N. Each entry keeps the global shape
(``global_mkn``) beside its key.

For every measured shape: path 'sequential' where NCCL+GEMM (or GEMM+NCCL) was faster than the fused
operator in that run, else 'fused'; for GEMM+ReduceScatter runs that timed both transports, the faster one
('epilogue' or 'copy_engine'; :func:`rs_transport_times`). Lookups take the nearest measured shape
(flux_layers/runtime/tuning.py).

A plain FP8 GEMM run (benchmarks/bench_gemm_fp8.py: the op library's configurations beside cuBLASLt's
``torch._scaled_mm``) gives ``gemm`` entries keyed by x's format and the accumulation ('split' | 'fast'), one per
shape and accumulation: path 'sequential' (cuBLASLt: a plain GEMM has no communication, so the "sequential" path is
the vendor GEMM) unless the op library's best configuration was faster under every scale mode measured, and that
configuration's tile and swizzle, which calls forced onto the op library's kernel take (ops/backend.fp8_gemm_choice,
runtime/tuning.kernel_config), and whether it ran the stream-K tail (``stream_k``: where it ran whole tiles,
FLUX_LAYERS_STREAM_K=auto leaves the tail off; runtime/tuning.stream_k_fill).

``--loop op_overhead.json`` (benchmarks/bench_overhead.py, run on as many GPUs as the ranks): for the shapes it
measured, the path is decided by the plain back-to-back loop (host cost included: what a step sees when the CPU
cannot run ahead), averaged over the weight layouts, instead of by GPU time alone; the entry keeps both.
"""
from __future__ import annotations

import argparse
import json

from flux_layers.runtime import tuning
from flux_layers.runtime.schedules import TILE_CONFIGS

SEQ_KEY = {"ag_gemm": "nccl_then_gemm", "gemm_rs": "gemm_then_nccl"}


def per_rank_key(op: str, tp: int, m: int, k: int, n: int) -> tuple[int, int, int]:
    """The table key of a benchmark's global M x K x N at ``tp`` ranks: tuning.table_key of the tensors one rank
    holds there (ag_gemm: x [M/tp, K], weight [N/tp, K]; gemm_rs: x [M, K/tp], weight [N, K/tp])."""
    split = n if op == "ag_gemm" else k
    if split % tp != 0 or (op == "ag_gemm" and m % tp != 0):
        raise SystemExit(f"{op} {m}x{k}x{n} does not split over {tp} ranks")
    if op == "ag_gemm":
        return tuning.table_key(op, m // tp, k, n // tp, tp)
    return tuning.table_key(op, m, k // tp, n, tp)


def rs_transport_times(times_ms: dict) -> dict[str, float | None]:
    """Each peer-mapped GEMM+ReduceScatter transport's time in a bench_gemm_rs row (``fused_<transport>``; a record
    of an earlier run names a transport by its former name, tuning.RS_TRANSPORT_FORMER_NAMES), None where not
    timed."""
    former = {now: was for was, now in tuning.RS_TRANSPORT_FORMER_NAMES.items()}
    return {name: times_ms.get(f"fused_{name}", times_ms.get(f"fused_{former.get(name)}"))
            for name in tuning.RS_TRANSPORTS}


FP8_FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def fp8_gemm_entries(run: dict, path: str) -> list[dict]:
    """The ``gemm`` entries of a bench_gemm_fp8 run (module docstring): rows grouped by shape, operand formats and
    accumulation over their scale modes."""
    tile_ids = {f"{m}x{n}": tile for tile, (m, n) in TILE_CONFIGS.items()}
    groups: dict[tuple, list[dict]] = {}
    for r in run["results"]:
        groups.setdefault((r["m"], r["k"], r["n"], r["dtype"], r["accum"]), []).append(r)
    out = []
    for (m, k, n, pair, accum), rows in groups.items():
        ratios = {r["scale"]: r["flux_best_over_cublas"] for r in rows}
        best = max(rows, key=lambda r: r["flux_best_over_cublas"])
        tile_name, swizzle, mode = best["config"].split("_")
        x_format, w_format = pair.split("x")
        out.append({"op": "gemm", "dtype": FP8_FORMATS[x_format], "w_dtype": FP8_FORMATS[w_format], "tp": 1,
                    "m": m, "k": k, "n": n, "accum": accum,
                    "path": "fused" if min(ratios.values()) > 1.0 else "sequential",
                    "flux_best_over_cublas": ratios, "config": best["config"], "tile": tile_ids[tile_name],
                    "swizzle": int(swizzle.removeprefix("swz")), "stream_k": mode != "dp",
                    "source": f"{path} @ {run.get('commit', '?')}"})
    return out


def entries_from(path: str) -> tuple[str, list[dict]]:
    with open(path) as f:
        run = json.load(f)
    if "flux_best_over_cublas" in run["results"][0]:
        return run["gpu"], fp8_gemm_entries(run, path)
    op = "ag_gemm" if "ce_ag_gbps" in run["results"][0] else "gemm_rs"
    out = []
    for r in run["results"]:
        t = r["times_ms"]
        m, k, n = per_rank_key(op, r["tp"], r["m"], r["k"], r["n"])
        entry = {"op": op, "dtype": r["dtype"], "tp": r["tp"], "m": m, "k": k, "n": n,
                 "global_mkn": [r["m"], r["k"], r["n"]]}
        fused = t["fused"]
        # GEMM+ReduceScatter runs measured with both transports: the faster one is the shape's transport.
        transports = rs_transport_times(t)
        if op == "gemm_rs" and all(v is not None for v in transports.values()):
            entry["transport"] = min(transports, key=transports.get)
            fused = transports[entry["transport"]]
        entry.update({"path": "sequential" if t[SEQ_KEY[op]] < fused else "fused", "fused_ms": fused,
                      "sequential_ms": t[SEQ_KEY[op]], "source": f"{path} @ {run.get('commit', '?')}"})
        out.append(entry)
    return run["gpu"], out


def loop_times(path: str) -> dict[tuple, dict[str, float]]:
    """{(op, tp, m, k, n): {impl: loop_ms averaged over layouts}} of a bench_overhead run (GPU figures only); (m, k, n)
    the per-rank key of the run's global shape, as the entries'."""
    with open(path) as f:
        run = json.load(f)
    if run.get("shared_gpu"):
        raise SystemExit(f"{path} ran its ranks on one GPU: its loop times are not TP figures")
    sums: dict[tuple, dict[str, list[float]]] = {}
    for r in run["results"]:
        if r.get("loop_ms") is not None:
            key = (r["op"], run["tp"]) + per_rank_key(r["op"], run["tp"], r["m"], r["k"], r["n"])
            sums.setdefault(key, {}).setdefault(r["impl"], []).append(r["loop_ms"])
    return {key: {impl: sum(v) / len(v) for impl, v in impls.items()} for key, impls in sums.items()}


def apply_loop_times(entries: list[dict], loops: dict[tuple, dict[str, float]], source: str) -> None:
    """Decide the path of every entry the loop run measured by its loop times (fused vs sequential)."""
    for e in entries:
        t = loops.get((e["op"], e["tp"], e["m"], e["k"], e["n"]))
        if t is None or "fused" not in t or "sequential" not in t:
            continue
        e.update(path="sequential" if t["sequential"] < t["fused"] else "fused", fused_loop_ms=t["fused"],
                 sequential_loop_ms=t["sequential"], loop_source=source)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--loop", action="append", default=[], help="bench_overhead JSON: decide by loop times")
    args = ap.parse_args()
    gpu, entries = None, []
    for path in args.results:
        g, e = entries_from(path)
        if gpu is not None and g != gpu:
            raise SystemExit(f"{path} was measured on {g}, the others on {gpu}")
        gpu = g
        entries += e
    for path in args.loop:
        with open(path) as f:
            commit = json.load(f).get("commit", "?")
        apply_loop_times(entries, loop_times(path), f"{path} @ {commit}")
    with open(args.out, "w") as f:
        command = " ".join(args.results + [f"--loop {p}" for p in args.loop])
        json.dump({"gpu": gpu, "generated_by": "python -m tools.make_dispatch_table " + command,
                   "key": tuning.TABLE_KEY, "entries": entries}, f, indent=2)
    print(f"wrote {args.out}: {sum(e['path'] == 'sequential' for e in entries)} of {len(entries)} shapes sequential")


if __name__ == "__main__":
    main()
