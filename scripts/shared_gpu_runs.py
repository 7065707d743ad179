"""The summary of the shared-GPU GPU test runs (ranks as processes sharing one GPU), from each run's JUnit report:
for scripts/gpu_check.sh's shared_tp and shared_nodes steps.

    python3 scripts/shared_gpu_runs.py OUT.json TP:NODES:REPORT.xml [...] [--merge EARLIER.json ...]

Writes ``{"commit", "date", "runs": [{"tp", "nodes", "tests", "passed", "failed", "skipped"}, ...]}`` (failed counts
errors too; tests is their sum), one run per (tp, nodes), sorted. ``--merge``: runs of earlier summaries of the same
commit that these reports do not replace (several device calls add up to one summary); a summary of another commit is
refused. The commit is FLUX_LAYERS_COMMIT, else ``git rev-parse HEAD``. Exit status 1 when a report is missing or
unreadable. Standard library only.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import junit_summary  # noqa: E402


def run_of(spec: str) -> dict:
    """The run of one ``TP:NODES:REPORT.xml``."""
    tp, nodes, report = spec.split(":", 2)
    totals, _ = junit_summary.counts(report)
    failed = totals["failed"] + totals["errors"]
    return {"tp": int(tp), "nodes": int(nodes), "tests": totals["passed"] + failed + totals["skipped"],
            "passed": totals["passed"], "failed": failed, "skipped": totals["skipped"]}


def commit() -> str:
    found = os.environ.get("FLUX_LAYERS_COMMIT")
    if found:
        return found
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summary(specs: list[str], merged: list[dict], at: str) -> dict:
    runs = {(r["tp"], r["nodes"]): r for earlier in merged for r in earlier["runs"]}
    for spec in specs:
        run = run_of(spec)
        runs[(run["tp"], run["nodes"])] = run
    head = commit()
    for earlier in merged:
        if earlier["commit"] != head:
            raise ValueError(f"a summary of commit {earlier['commit']} cannot merge into one of {head}")
    return {"commit": head, "date": at, "runs": [runs[key] for key in sorted(runs)]}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    out, args = argv[0], argv[1:]
    specs, merged = [], []
    while args:
        arg = args.pop(0)
        if arg == "--merge":
            with open(args.pop(0)) as f:
                merged.append(json.load(f))
        else:
            specs.append(arg)
    try:
        record = summary(specs, merged, datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    except (OSError, ValueError) as exc:
        print(f"shared_gpu_runs: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # an unreadable report (xml.etree's ParseError)
        print(f"shared_gpu_runs: unreadable report: {exc}", file=sys.stderr)
        return 1
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    for run in record["runs"]:
        print(f"tp={run['tp']} nodes={run['nodes']}: {run['passed']} passed, {run['failed']} failed, "
              f"{run['skipped']} skipped of {run['tests']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
