"""flux_layers/devtools/launch.py: a launch whose ranks do not finish is killed at the lower of its own limit and
FLUX_LAYERS_TEST_LAUNCH_S, after every rank printed its threads' stacks (what a hang was waiting for), and with
FLUX_LAYERS_TEST_PY_SPY after the launcher ran it on each rank still running."""
from __future__ import annotations

import time

import pytest

from flux_layers.devtools.launch import run_distributed


def _rank_that_hangs(rank, world_size):
    if rank == 1:
        _waiting_for_a_peer_that_never_comes()


def _waiting_for_a_peer_that_never_comes():
    time.sleep(3600)


def test_a_hung_rank_is_killed_at_the_cap_with_its_stacks_printed(monkeypatch, capfd, tmp_path):
    monkeypatch.setenv("FLUX_LAYERS_TEST_LAUNCH_S", "40")
    py_spy = tmp_path / "py-spy"  # stands in for py-spy: says what it was asked to dump
    py_spy.write_text('#!/bin/sh\necho "asked: $*"\n')
    py_spy.chmod(0o755)
    monkeypatch.setenv("FLUX_LAYERS_TEST_PY_SPY", str(py_spy))
    began = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[(0, )?1\] did not finish within 40.0 s"):
        run_distributed(_rank_that_hangs, 2, timeout_s=300)
    assert time.monotonic() - began < 120, "the launch ran past FLUX_LAYERS_TEST_LAUNCH_S"
    err = capfd.readouterr().err
    assert "Timeout" in err and "_waiting_for_a_peer_that_never_comes" in err, err[-2000:]
    # each rank's dump apart from the others' (four processes dumping at once to one stream interleave their lines)
    hung = err[err.index("--- rank 1: every thread's stack"):]
    assert "_waiting_for_a_peer_that_never_comes" in hung.split("--- rank", 2)[1], err[-2000:]
    native = err[err.index("--- rank 1: py-spy dump --native ---"):].splitlines()
    assert native[1].startswith("asked: dump --native --pid ") and native[1].split()[-1].isdigit(), err[-2000:]
