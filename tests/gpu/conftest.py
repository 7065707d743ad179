"""Hooks shared by the GPU tests."""
from __future__ import annotations

import sys

import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failure's report written as it happens, not only in the session's summary: the GPU steps
    (scripts/gpu_check.sh) run under a time limit, and a step killed by it never reaches the summary."""
    if report.failed:
        sys.stderr.write(f"\n---- {report.nodeid} failed ({report.when}) ----\n{report.longreprtext}\n----\n")
        sys.stderr.flush()
