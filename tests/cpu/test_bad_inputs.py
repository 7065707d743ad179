"""The catalogue of bad inputs (flux_layers/devtools/bad_inputs.py) on CPU: its cases whose rejection is the same on
every backend are rejected with a message that names the argument and the rule, a valid call after each is right,
and ops' shared argument checks reject before the cross-rank check of a fused call and before any workspace."""
from __future__ import annotations

import pytest
import torch

from flux_layers.devtools import bad_inputs
from flux_layers.devtools.launch import run_distributed

STAGES = {"args", "fused", "op", "layer"}


def test_catalogue_is_large_distinct_and_complete():
    names = [c.name for c in bad_inputs.CASES]
    assert len(names) == len(set(names)), "case names repeat"
    assert len(names) >= 25
    for case in bad_inputs.CASES:
        assert case.names and case.rules and case.stage in STAGES and case.errors, case.name


def test_clear_needs_the_type_the_name_and_the_rule():
    case = next(c for c in bad_inputs.CASES if c.name == "ag_k_mismatch")
    assert bad_inputs.clear(case, ValueError("ag_gemm: x (4, 8) and weight (6, 7) disagree on K: 8 vs 7"))
    assert not bad_inputs.clear(case, ValueError("ag_gemm: shapes disagree"))  # no rule
    assert not bad_inputs.clear(case, ValueError("ag_gemm: Kx and weight disagree on KK"))  # K only inside words
    assert not bad_inputs.clear(case, TypeError("disagree on K"))  # another type
    assert not bad_inputs.clear(case, None)  # not raised


def _cpu_cases(rank, tp):
    env = bad_inputs.Env.here(rank, tp)
    assert env.device.type == "cpu" and env.backend == "reference"
    rows = bad_inputs.run_cases(env)
    expected = [c.name for c in bad_inputs.CASES if c.cpu]
    assert [r["case"] for r in rows] == expected
    unclear = [(r["case"], r["error_type"], r["message"]) for r in rows if not r["clear"]]
    assert not unclear, f"rank {rank}: unclear or missing errors: {unclear}"
    wrong = [(r["case"], r["later_error"]) for r in rows if not r["later_ok"]]
    assert not wrong, f"rank {rank}: calls after a rejected one were wrong: {wrong}"


def test_cpu_cases_are_rejected_clearly_and_later_calls_are_right():
    run_distributed(_cpu_cases, 2)


def _rejected_first(rank, tp, backend):
    from flux_layers.ops import _dispatch
    from flux_layers.runtime import workspace

    def reached(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"a bad call reached {what}")
        return fail
    _dispatch.check_same_call = reached("the cross-rank check")
    workspace.get_ag_workspace = workspace.get_rs_workspace = reached("a workspace")
    env = bad_inputs.Env.here(rank, tp)
    env.backend = backend
    for case in (c for c in bad_inputs.CASES if c.stage == "args" and c.cpu):
        with pytest.raises(case.errors) as info:
            case.call(env)
        assert bad_inputs.clear(case, info.value), f"{case.name}: {info.value}"
    assert not _dispatch._decisions, "a rejected call left a decision behind"


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_shared_checks_reject_before_the_cross_rank_check_and_any_workspace(backend):
    run_distributed(_rejected_first, 2, backend)


def test_cpu_run_needs_no_gpu_cases():
    env = bad_inputs.Env(0, 2, None, torch.device("cpu"), "reference", torch.float32)
    assert not any(bad_inputs.applicable(c, env) for c in bad_inputs.CASES if not c.cpu)
