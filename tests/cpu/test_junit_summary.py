"""scripts/junit_summary.py, which scripts/gpu_check.sh reads each pytest step's JUnit report with: the counts, the
skip reasons, and a run whose tests all skipped (or that collected none) told apart from one that ran tests."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "junit_summary.py")


def _pytest_report(tmp_path, body: str) -> str:
    """The JUnit report of a pytest run of a test file holding ``body``."""
    (tmp_path / "test_sample.py").write_text("import pytest\n" + body)
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    str(tmp_path / "test_sample.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return str(report)


def _summary(report: str) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, SCRIPT, report], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout.splitlines()


def test_counts_and_skip_reasons_of_a_run_that_ran_tests(tmp_path):
    report = _pytest_report(tmp_path, """
def test_passes():
    pass

def test_fails():
    assert False

@pytest.mark.skip(reason="needs 2 CUDA GPUs, 1 visible")
def test_two_gpus():
    pass

@pytest.mark.skip(reason="needs 2 CUDA GPUs, 1 visible")
def test_two_gpus_again():
    pass

@pytest.mark.skip(reason="needs megatron-core")
def test_layers():
    pass
""")
    rc, lines = _summary(report)
    assert rc == 0
    assert lines == ["1 passed, 1 failed, 0 errors, 3 skipped", "  skipped 2: needs 2 CUDA GPUs, 1 visible",
                     "  skipped 1: needs megatron-core"]


@pytest.mark.parametrize("body", ['pytestmark = pytest.mark.skip(reason="needs 2 CUDA GPUs, 1 visible")\n'
                                  "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
                                  "def helper():\n    pass\n"], ids=["all skipped", "none collected"])
def test_a_run_that_ran_no_test_is_told_apart(tmp_path, body):
    rc, lines = _summary(_pytest_report(tmp_path, body))
    assert rc == 3, lines
    assert lines[0].startswith("0 passed, 0 failed, 0 errors, ")


def test_a_missing_report_is_said(tmp_path):
    rc, lines = _summary(str(tmp_path / "absent.xml"))
    assert rc == 4 and lines[0].startswith("no readable pytest report")


RUNS_SCRIPT = os.path.join(ROOT, "scripts", "shared_gpu_runs.py")


def _runs(*args, commit="c0ffee"):
    env = dict(os.environ, FLUX_LAYERS_COMMIT=commit)
    return subprocess.run([sys.executable, RUNS_SCRIPT, *args], capture_output=True, text=True, timeout=60, env=env)


def test_shared_gpu_runs_summary_counts_each_run_and_merges_earlier_ones(tmp_path):
    import json
    two = tmp_path / "two"
    two.mkdir()
    four = tmp_path / "four"
    four.mkdir()
    report_two = _pytest_report(two, "def test_a():\n    pass\n\ndef test_b():\n    assert False\n\n"
                                     "@pytest.mark.skip(reason='runs at TP = 2')\ndef test_c():\n    pass\n")
    report_four = _pytest_report(four, "def test_a():\n    pass\n\n@pytest.fixture\ndef broken():\n"
                                       "    raise OSError\n\ndef test_b(broken):\n    pass\n")
    first = tmp_path / "first.json"
    proc = _runs(str(first), f"2:1:{report_two}")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out.json"
    proc = _runs(str(out), f"4:2:{report_four}", "--merge", str(first))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["commit"] == "c0ffee" and record["date"]
    assert record["runs"] == [{"tp": 2, "nodes": 1, "tests": 3, "passed": 1, "failed": 1, "skipped": 1},
                              {"tp": 4, "nodes": 2, "tests": 2, "passed": 1, "failed": 1, "skipped": 0}]
    proc = _runs(str(out), f"4:2:{report_four}", "--merge", str(first), commit="other")
    assert proc.returncode == 1 and "cannot merge" in proc.stderr
    assert _runs(str(out), f"8:1:{tmp_path / 'missing.xml'}").returncode == 1


def test_shared_gpu_runs_counts_a_run_cut_before_its_report_from_its_log(tmp_path):
    """A run killed by its time limit writes no JUnit report: its -vv log's result lines give the counts, and the
    tests it did not reach are said."""
    import json
    (tmp_path / "test_sample.py").write_text(
        "import time\nimport pytest\n\ndef test_a():\n    print('rank output')\n\ndef test_b():\n    assert False\n\n"
        "@pytest.mark.skip(reason='runs at TP = 2')\ndef test_c():\n    pass\n\n"
        "def test_d():\n    time.sleep(120)\n\ndef test_e():\n    pass\n")
    log = tmp_path / "step.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-vv", "-p", "no:cacheprovider", "test_sample.py"],
                                cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "test_d" not in log.read_text() and time.monotonic() < deadline:  # killed in test_d, as by a limit
                time.sleep(0.2)
        finally:
            proc.kill()
            proc.wait()
    out = tmp_path / "out.json"
    proc = _runs(str(out), f"2:1:{log}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["runs"] == [
        {"tp": 2, "nodes": 1, "tests": 3, "passed": 1, "failed": 1, "skipped": 1, "from_log": True, "not_reached": 2}]
    assert "no report: counted from its log, 2 not reached" in proc.stdout
