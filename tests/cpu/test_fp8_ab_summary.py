"""scripts/fp8_ab_summary.py, which scripts/gpu_check.sh's step fp8_ab prints the side-by-side of op-library builds
with: each build's ratio per round under its shape, rounds in order, and a misnamed file refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "fp8_ab_summary.py")


def _run_file(tmp_path, name: str, ratios: dict) -> str:
    results = [{"m": m, "k": k, "n": n, "scale": scale, "accum": "split", "flux_default_over_cublas": v}
               for (m, k, n, scale), v in ratios.items()]
    path = tmp_path / name
    path.write_text(json.dumps({"results": results}))
    return str(path)


def _summary(*paths):
    proc = subprocess.run([sys.executable, SCRIPT, *paths], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def test_each_build_per_round_and_median(tmp_path):
    a, b = (4096, 2048, 4096, "tensor"), (4096, 8192, 4096, "row")
    paths = [_run_file(tmp_path, "fp8_ab_base_2.json", {a: 0.84, b: 0.89}),
             _run_file(tmp_path, "fp8_ab_base_1.json", {a: 0.83, b: 0.88}),
             _run_file(tmp_path, "fp8_ab_v14_1.json", {a: 0.82, b: 0.93}),
             _run_file(tmp_path, "fp8_ab_v14_2.json", {a: 0.82, b: 0.92})]
    rc, lines, _ = _summary(*paths)
    assert rc == 0
    assert lines[0].endswith("base | v14")
    assert lines[1] == "4096x2048x4096 tensor split: 0.830 0.840 (0.835) | 0.820 0.820 (0.820)"
    assert lines[2] == "4096x8192x4096 row split: 0.880 0.890 (0.885) | 0.930 0.920 (0.925)"


def test_a_build_missing_a_shape_shows_a_dash(tmp_path):
    a, b = (4096, 2048, 4096, "tensor"), (8192, 4096, 4096, "tensor")
    rc, lines, _ = _summary(_run_file(tmp_path, "fp8_ab_base_1.json", {a: 0.8, b: 0.9}),
                            _run_file(tmp_path, "fp8_ab_var_1.json", {a: 0.7}))
    assert rc == 0 and lines[2] == "8192x4096x4096 tensor split: 0.900 (0.900) | -"


def test_a_misnamed_file_is_refused(tmp_path):
    rc, lines, err = _summary(_run_file(tmp_path, "results.json", {(1, 1, 1, "row"): 1.0}))
    assert rc == 2 and not lines and "fp8_ab_<build>_<round>.json" in err
