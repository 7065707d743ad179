"""Fixtures shared by the CPU tests."""
from __future__ import annotations

import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def schedule_dump(tmp_path_factory) -> str:
    """tests/cpu/schedule_dump.cpp built once: the C++ schedules and layouts printed for comparison."""
    exe = tmp_path_factory.mktemp("schedule_dump") / "schedule_dump"
    include = os.path.join(HERE, "..", "..", "csrc", "include")
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", include, "-o", str(exe), os.path.join(HERE, "schedule_dump.cpp")],
                   check=True)
    return str(exe)
