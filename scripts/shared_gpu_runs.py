"""The summary of the shared-GPU GPU test runs (ranks as processes sharing one GPU), from each run's JUnit report:
for scripts/gpu_check.sh's shared_tp and shared_nodes steps.

    python3 scripts/shared_gpu_runs.py OUT.json TP:NODES:REPORT.xml|TP:NODES:LOG [...] [--merge EARLIER.json ...]

Writes ``{"commit", "date", "runs": [{"tp", "nodes", "tests", "passed", "failed", "skipped"}, ...]}`` (failed counts
errors too; tests is their sum), one run per (tp, nodes), sorted. A run that wrote no report (cut by its time limit,
or pytest itself died): given its ``pytest -vv`` log instead (any name not ending in .xml), its counts are the log's
per-test result lines, and the run gains ``"from_log": true`` and ``"not_reached"`` (tests collected less those
counted; null where the log does not say how many were collected). ``--merge``: runs of earlier summaries of the same
commit that these reports do not replace (several device calls add up to one summary); a summary of another commit is
refused. The commit is FLUX_LAYERS_COMMIT, else ``git rev-parse HEAD``. Exit status 1 when a report is missing or
unreadable. Standard library only.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import junit_summary  # noqa: E402

# A result line of ``pytest -vv``: the test's id, then its outcome (the ranks' output may follow on the same line).
_RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_COLLECTED = re.compile(r"\bcollected (\d+) items?\b")


def log_counts(path: str) -> tuple[dict[str, int], int | None]:
    """({'passed', 'failed', 'errors', 'skipped'}: counts, tests collected or None) of a ``pytest -vv`` log, each
    test once (its first result line: a test that failed and then errored in teardown counts as failed)."""
    outcome: dict[str, str] = {}
    collected = None
    with open(path, errors="replace") as f:
        for line in f:
            found = _COLLECTED.search(line)
            if found and collected is None:
                collected = int(found.group(1))
            result = _RESULT.match(line)
            if result:
                outcome.setdefault(result.group(1), result.group(2))
    kind = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
            "XFAIL": "skipped"}
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for result in outcome.values():
        totals[kind[result]] += 1
    return totals, collected


def run_of(spec: str) -> dict:
    """The run of one ``TP:NODES:REPORT.xml`` (or ``TP:NODES:LOG`` of a run that wrote no report)."""
    tp, nodes, report = spec.split(":", 2)
    from_log = not report.endswith(".xml")
    totals, collected = log_counts(report) if from_log else (junit_summary.counts(report)[0], None)
    failed = totals["failed"] + totals["errors"]
    run = {"tp": int(tp), "nodes": int(nodes), "tests": totals["passed"] + failed + totals["skipped"],
           "passed": totals["passed"], "failed": failed, "skipped": totals["skipped"]}
    if from_log:
        run.update(from_log=True, not_reached=None if collected is None else collected - run["tests"])
    return run


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
        cut = f" (no report: counted from its log, {run['not_reached']} not reached)" if run.get("from_log") else ""
        print(f"tp={run['tp']} nodes={run['nodes']}: {run['passed']} passed, {run['failed']} failed, "
              f"{run['skipped']} skipped of {run['tests']}{cut}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
