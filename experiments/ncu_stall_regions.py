"""Where the GEMM kernel's warps stall, by region of its SASS: reads the per-instruction source page that Nsight Compute
exports (``ncu -i REPORT --page source --csv --print-source sass``; the report taken with ``--section
SourceCounters``) and sums the warp-stall samples of each region, by reason, plus the most-sampled instructions.

Regions come from markers in the SASS, so the split is approximate at the edges:
  loop top    : from the consumers' register allocation (the first ``USETMAXREG``) to the first wgmma (``QGMMA`` or
                ``HGMMA``): the tile loop's scheduling and the mainloop's first stage wait
  mainloop    : the first to the last wgmma, and the waits that follow up to the first instruction after it that is
                neither a wgmma wait nor a floating-point add (the last promotion)
  after       : from there to the first ``STSM``: the error claim, the scales, bias and flags
  stores      : from the first ``STSM`` to the producer's register release (the second ``USETMAXREG``)
  producer    : the rest (the producer warp and the kernel's end)

The epilogue's path: the runs of executed instructions (``Instructions Executed`` > 0) between the end of the
mainloop and the producer, with the instructions skipped before each run (a taken branch) and its fetch stalls.

On 2139091's FP8 split kernel it found the epilogue's time mostly instruction-fetch stalls (``stall_no_inst``):
docs/experiments.md, FP8 GEMM section, and benchmarks/results/history/2139091-fp8-epilogue-ab. The epilogue's path
there was 458 instructions (tensor-wise) in 19 runs spread over 2,657, and most of its fetch stalls sat at the
starts of runs.

    python -m experiments.ncu_stall_regions sass.csv [--top 20] [--runs] [--out regions.json]
"""
import argparse
import csv
import json

REGIONS = ("loop top", "mainloop", "after", "stores", "producer")


def read_source_page(path):
    """(header, rows) of an ncu source-page CSV: its first line names the kernel, the second the columns."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    start = next(i for i, row in enumerate(lines) if row and row[0] == "Address")
    return lines[start], lines[start + 1:]


def region_bounds(sources):
    """Start index of each region (REGIONS order) in the SASS listing ``sources``."""
    setmaxreg = [i for i, s in enumerate(sources) if "USETMAXREG" in s]
    wgmma = [i for i, s in enumerate(sources) if "GMMA." in s]
    stsm = [i for i, s in enumerate(sources) if "STSM" in s]
    if len(setmaxreg) < 2 or not wgmma or not stsm:
        raise ValueError("not a warp-specialized GEMM listing: needs two USETMAXREG, a wgmma and an STSM")
    end = wgmma[-1] + 1
    while end < len(sources) and ("WARPGROUP.DEPBAR" in sources[end] or sources[end].strip().startswith("FADD")):
        end += 1
    return [setmaxreg[0], wgmma[0], end, stsm[0], setmaxreg[1]]


def cell(row, col, name):
    """Column `name` of a source-page row as an int: 0 where it is empty, "-", or not in the page."""
    v = row[col[name]] if name in col else ""
    return int(v) if v not in ("", "-") else 0


def summarize(header, rows, top=20):
    col = {name: i for i, name in enumerate(header)}
    samples = "Warp Stall Sampling (All Samples)"
    reasons = [name for name in header if name.startswith("stall_") and "(Not Issued)" not in name]

    def value(row, name):
        return cell(row, col, name)

    sources = [row[col["Source"]].strip() for row in rows]
    bounds = region_bounds(sources) + [len(rows)]
    total = sum(value(row, samples) for row in rows)
    regions = []
    for name, a, b in zip(REGIONS, bounds[:-1], bounds[1:]):
        by_reason = {r: sum(value(row, r) for row in rows[a:b]) for r in reasons}
        n = sum(value(row, samples) for row in rows[a:b])
        regions.append({"region": name, "first": a, "end": b, "samples": n, "share": n / total if total else 0.0,
                        "by_reason": {r: v for r, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v}})
    hot = sorted(range(len(rows)), key=lambda i: -value(rows[i], samples))[:top]
    hottest = [{"index": i, "sass": sources[i], "samples": value(rows[i], samples),
                "region": next(name for name, b in zip(REGIONS, bounds[1:]) if i < b) if i >= bounds[0] else "pre",
                "by_reason": {r: value(rows[i], r) for r in reasons if value(rows[i], r)}} for i in sorted(hot)]
    return {"instructions": len(rows), "samples": total, "regions": regions, "hottest": hottest,
            "epilogue_path": epilogue_path(rows, col, bounds[2], bounds[4])}


def epilogue_path(rows, col, first, end):
    """Runs of executed instructions in rows[first:end]: each with the instructions skipped before it, its length,
    its samples and fetch stalls (``stall_no_inst``), and the totals. Empty without the executed-count column."""
    executed = "Instructions Executed"
    if executed not in col:
        return {}

    def value(row, name):
        return cell(row, col, name)

    runs, skipped, i = [], 0, first
    while i < end:
        if value(rows[i], executed) == 0:
            skipped, i = skipped + 1, i + 1
            continue
        j = i
        while j < end and value(rows[j], executed) > 0:
            j += 1
        block = rows[i:j]
        runs.append({"first": i, "length": j - i, "skipped_before": skipped,
                     "samples": sum(value(r, "Warp Stall Sampling (All Samples)") for r in block),
                     "no_inst": sum(value(r, "stall_no_inst") for r in block)})
        skipped, i = 0, j
    return {"first": first, "end": end, "executed": sum(r["length"] for r in runs), "runs": len(runs),
            "no_inst": sum(r["no_inst"] for r in runs), "run_list": runs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu source page, SASS, as CSV")
    ap.add_argument("--top", type=int, default=20, help="most-sampled instructions to list")
    ap.add_argument("--runs", action="store_true", help="list the epilogue path's runs of executed instructions")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    header, rows = read_source_page(args.csv)
    result = summarize(header, rows, args.top)
    for r in result["regions"]:
        reasons = ", ".join(f"{k[6:]} {v}" for k, v in list(r["by_reason"].items())[:4])
        print(f"{r['region']:9s} {r['samples']:6d} samples ({100 * r['share']:4.1f}%): {reasons}")
    path = result["epilogue_path"]
    if path:
        print(f"epilogue path: {path['executed']} instructions executed in {path['runs']} runs over "
              f"{path['end'] - path['first']}, {path['no_inst']} no_inst samples")
        for r in path["run_list"] if args.runs else ():
            print(f"  after {r['skipped_before']:4d} skipped: {r['length']:4d} at {r['first']}, "
                  f"samples {r['samples']}, no_inst {r['no_inst']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"source": args.csv, **result}, f, indent=1)


if __name__ == "__main__":
    main()
