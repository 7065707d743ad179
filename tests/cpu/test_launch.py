"""flux_layers/devtools/launch.py: a launch whose ranks do not finish is killed at the lower of its own limit and
FLUX_LAYERS_TEST_LAUNCH_S, after every rank printed its threads' stacks (what a hang was waiting for)."""
from __future__ import annotations

import time

import pytest

from flux_layers.devtools.launch import run_distributed


def _rank_that_hangs(rank, world_size):
    if rank == 1:
        _waiting_for_a_peer_that_never_comes()


def _waiting_for_a_peer_that_never_comes():
    time.sleep(3600)


def test_a_hung_rank_is_killed_at_the_cap_with_its_stacks_printed(monkeypatch, capfd):
    monkeypatch.setenv("FLUX_LAYERS_TEST_LAUNCH_S", "40")
    began = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[(0, )?1\] did not finish within 40.0 s"):
        run_distributed(_rank_that_hangs, 2, timeout_s=300)
    assert time.monotonic() - began < 120, "the launch ran past FLUX_LAYERS_TEST_LAUNCH_S"
    err = capfd.readouterr().err
    assert "Timeout" in err and "_waiting_for_a_peer_that_never_comes" in err, err[-2000:]
    # each rank's dump apart from the others' (four processes dumping at once to one stream interleave their lines)
    hung = err[err.index("--- rank 1: every thread's stack"):]
    assert "_waiting_for_a_peer_that_never_comes" in hung.split("--- rank", 2)[1], err[-2000:]
