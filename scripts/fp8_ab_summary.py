"""The side-by-side of op-library builds that scripts/gpu_check.sh's step fp8_ab timed: one line per shape and scale
mode, each build's default configuration over cuBLASLt in every round, and its median over the rounds.

    python3 scripts/fp8_ab_summary.py fp8_ab_<build>_<round>.json ...

Each file is a benchmarks/bench_gemm_fp8.py run of one build in one round (the build and round are read from the
name). cuBLASLt ran in the same process, so the ratio is what compares builds across processes and rounds (the
machine drifts between them). Exit status 2 when a file is unreadable or misnamed. Standard library only.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys

NAME = re.compile(r"fp8_ab_(?P<build>.+)_(?P<round>\d+)\.json$")


def ratios(paths: list[str]) -> tuple[list[str], dict[tuple, dict[str, list[float]]]]:
    """(builds in first-seen order, {(m, k, n, scale, accum): {build: [default/cuBLASLt of each round, in round
    order]}})."""
    builds: list[str] = []
    rows: dict[tuple, dict[str, list[tuple[int, float]]]] = {}
    for path in paths:
        match = NAME.search(os.path.basename(path))
        if match is None:
            raise ValueError(f"{path}: not named fp8_ab_<build>_<round>.json")
        build, rnd = match["build"], int(match["round"])
        if build not in builds:
            builds.append(build)
        with open(path) as f:
            for r in json.load(f)["results"]:
                key = (r["m"], r["k"], r["n"], r["scale"], r["accum"])
                rows.setdefault(key, {}).setdefault(build, []).append((rnd, r["flux_default_over_cublas"]))
    return builds, {key: {b: [v for _, v in sorted(s)] for b, s in by.items()} for key, by in rows.items()}


def main(argv: list[str]) -> int:
    try:
        builds, rows = ratios(argv)
    except (OSError, ValueError, KeyError) as exc:
        print(f"fp8_ab_summary: {exc}", file=sys.stderr)
        return 2
    print("default / cuBLASLt, per round (median): " + " | ".join(builds))
    for (m, k, n, scale, accum), by in rows.items():
        cells = []
        for b in builds:
            values = by.get(b, [])
            cells.append(" ".join(f"{v:.3f}" for v in values) + (f" ({statistics.median(values):.3f})" if values
                                                                  else "-"))
        print(f"{m}x{k}x{n} {scale} {accum}: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
