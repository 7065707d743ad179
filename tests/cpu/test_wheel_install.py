"""An installed (non-editable) flux_layers finds its tuning table: build the wheel of this tree, install it into a
folder, and ask the tuning module of that install, in a process that imports nothing from the repository."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tables of this tree (one per GPU), as paths inside the package.
TABLES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "flux_layers/tuning_tables/*.json")))

# Run inside the installed package: which flux_layers is imported, the tables its tuning module reads, and a
# lookup of the first entry of each table (the GPU name as the table's, since this machine has none).
_CHECK = """
import json, sys
import torch
import flux_layers
from flux_layers.runtime import tuning
paths = tuning.table_paths()
hits = []
for path in paths:
    with open(path) as f:
        table = json.load(f)
    entry = table["entries"][0]
    tuning._gpu_name = lambda: table["gpu"]
    w_dtype = getattr(torch, entry["w_dtype"]) if "w_dtype" in entry else None
    hit = tuning.dispatch_entry(entry["op"], dtype=getattr(torch, entry["dtype"]), tp=entry["tp"],
                                mkn=(entry["m"], entry["k"], entry["n"]), accum=entry.get("accum"), w_dtype=w_dtype)
    hits.append(hit == entry)
json.dump({"package": flux_layers.__file__, "tables": paths, "hits": hits}, sys.stdout)
"""


def _run(cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_installed_wheel_finds_its_tuning_table(tmp_path):
    # Build from a copy of what setup.py packages, so that the build's outputs (build/, *.egg-info) stay out of
    # the repository and no earlier build's leftovers reach the wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "flux_layers"), src / "flux_layers",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    env = dict(os.environ, FLUX_LAYERS_BUILD_OPS="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("FLUX_LAYERS_TUNING", None)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
          str(src)], env=env)
    (wheel,) = wheels.glob("flux_layers-*.whl")
    assert TABLES, "the tree holds no tuning table"
    with zipfile.ZipFile(wheel) as zf:
        for table in TABLES:
            assert table in zf.namelist(), f"{wheel.name} lacks {table}: {zf.namelist()}"

    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)], env=env)
    shutil.rmtree(src)  # nothing left to import from but the install
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    got = json.loads(_run([sys.executable, "-c", _CHECK], env=env, cwd=elsewhere))

    assert got["package"] == str(site / "flux_layers" / "__init__.py")
    assert got["tables"] == [str(site / table) for table in TABLES]
    for table in TABLES:
        with open(os.path.join(ROOT, table)) as ours, open(site / table) as installed:
            assert json.load(installed) == json.load(ours)
    assert all(got["hits"]) and len(got["hits"]) == len(TABLES), \
        f"the installed tuning module does not find the first entry of each of its tables: {TABLES}, {got['hits']}"
