"""What a pytest run checked, from its JUnit XML report (``--junitxml``): for scripts/gpu_check.sh.

    python3 scripts/junit_summary.py REPORT.xml

Prints one line ``P passed, F failed, E errors, S skipped`` and then, per distinct reason, ``  skipped N: reason``.
Exit status 0 when at least one test ran (passed, failed or errored: pytest's own exit status says which), 3 when
none did (every test skipped, or none collected), 4 when the report is missing or unreadable. Standard library only.
"""
from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET

NOTHING_RAN, NO_REPORT = 3, 4


def counts(path: str) -> tuple[dict[str, int], collections.Counter]:
    """({'passed', 'failed', 'errors', 'skipped'}: counts, Counter of skip reasons) of a JUnit XML report."""
    root = ET.parse(path).getroot()
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    reasons: collections.Counter = collections.Counter()
    for case in root.iter("testcase"):
        if case.find("failure") is not None:
            totals["failed"] += 1
        elif case.find("error") is not None:
            totals["errors"] += 1
        elif case.find("skipped") is not None:
            totals["skipped"] += 1
            skipped = case.find("skipped")
            reasons[(skipped.get("message") or skipped.text or "no reason given").strip()] += 1
        else:
            totals["passed"] += 1
    return totals, reasons


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        totals, reasons = counts(argv[0])
    except (OSError, ET.ParseError) as exc:
        print(f"no readable pytest report ({exc})")
        return NO_REPORT
    print(", ".join(f"{n} {what}" for what, n in totals.items()))
    for reason, n in reasons.most_common():
        print(f"  skipped {n}: {reason}")
    ran = totals["passed"] + totals["failed"] + totals["errors"]
    return 0 if ran > 0 else NOTHING_RAN


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
