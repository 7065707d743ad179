"""Turn operator benchmark results into the per-shape dispatch table the library reads (configs/tuning/).

    python -m benchmarks.make_dispatch_table benchmarks/results/ag_gemm_h200x2.json \
        benchmarks/results/gemm_rs_h200x2.json --out configs/tuning/dispatch_h200.json

For every measured shape: path 'sequential' where NCCL+GEMM (or GEMM+NCCL) was faster than the fused
operator in that run, else 'fused'; for GEMM+ReduceScatter runs that timed both transports, the faster one
('direct' or 'copy_engine'). Lookups take the nearest measured shape (flux_layers/runtime/tuning.py).
"""
from __future__ import annotations

import argparse
import json

SEQ_KEY = {"ag_gemm": "nccl_then_gemm", "gemm_rs": "gemm_then_nccl"}


def entries_from(path: str) -> tuple[str, list[dict]]:
    with open(path) as f:
        run = json.load(f)
    op = "ag_gemm" if "ce_ag_gbps" in run["results"][0] else "gemm_rs"
    out = []
    for r in run["results"]:
        t = r["times_ms"]
        entry = {"op": op, "dtype": r["dtype"], "tp": r["tp"], "m": r["m"], "k": r["k"], "n": r["n"]}
        fused = t["fused"]
        # GEMM+ReduceScatter runs measured with both transports: the faster one is the shape's transport.
        transports = {name: t.get(f"fused_{name}") for name in ("direct", "copy_engine")}
        if op == "gemm_rs" and all(v is not None for v in transports.values()):
            entry["transport"] = min(transports, key=transports.get)
            fused = transports[entry["transport"]]
        entry.update({"path": "sequential" if t[SEQ_KEY[op]] < fused else "fused", "fused_ms": fused,
                      "sequential_ms": t[SEQ_KEY[op]], "source": f"{path} @ {run.get('commit', '?')}"})
        out.append(entry)
    return run["gpu"], out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gpu, entries = None, []
    for path in args.results:
        g, e = entries_from(path)
        if gpu is not None and g != gpu:
            raise SystemExit(f"{path} was measured on {g}, the others on {gpu}")
        gpu = g
        entries += e
    with open(args.out, "w") as f:
        json.dump({"gpu": gpu, "generated_by": "python -m benchmarks.make_dispatch_table " + " ".join(args.results),
                   "entries": entries}, f, indent=2)
    print(f"wrote {args.out}: {sum(e['path'] == 'sequential' for e in entries)} of {len(entries)} shapes sequential")


if __name__ == "__main__":
    main()
