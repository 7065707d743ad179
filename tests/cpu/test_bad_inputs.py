"""The catalogue of bad inputs (flux_layers/devtools/bad_inputs.py) on CPU: its cases whose rejection is the same on
every backend are rejected with a message that names the argument and the rule, a valid call after each is right,
and ops' shared argument checks reject before the cross-rank check of a fused call and before any workspace."""
from __future__ import annotations

import pytest
import torch

from flux_layers.devtools import bad_inputs
from flux_layers.devtools.launch import run_distributed

STAGES = {"args", "fused", "op", "layer"}

# The catalogue, in order, written out: a case that goes missing or moves to the GPU-only set fails here, not
# silently. Adding a case means adding it here.
CPU_CASES = (
    "ag_x_1d", "ag_x_3d", "ag_weight_1d", "ag_k_mismatch", "ag_dtype_mismatch", "ag_bias_shape", "ag_bias_dtype",
    "ag_weight_layout", "ag_backend", "rs_return_gathered", "rs_m_indivisible", "rs_nn_k_mismatch", "rs_bias_shape",
    "rs_x_3d", "rs_backend", "column_output_indivisible", "row_input_indivisible",
    "row_sequence_parallel_needs_parallel_input", "column_overlap_type", "overlap_wgrad_input", "overlap_backend",
    "overlap_fused_but_switched_off")
ALL_CASES = (
    "ag_x_1d", "ag_x_3d", "ag_weight_1d", "ag_k_mismatch", "ag_dtype_mismatch", "ag_bias_shape", "ag_bias_dtype",
    "ag_weight_layout", "ag_backend", "ag_x_on_cpu", "ag_bias_on_cpu", "ag_mixed_gpus", "rs_return_gathered",
    "rs_m_indivisible", "rs_nn_k_mismatch", "rs_bias_shape", "rs_x_3d", "rs_backend", "ag_fp32_fused",
    "fused_ag_fp32", "fused_ag_on_cpu", "fused_ag_n_not_multiple_of_8", "fused_ag_k_not_multiple_of_8",
    "fused_ag_x_non_contiguous", "fused_ag_weight_transposed_view", "fused_ag_x_misaligned", "fused_ag_x_row_stride",
    "fused_ag_mode", "fused_ag_chunk_rows", "fused_ag_ws_kind", "fused_ag_ws_too_small", "fused_rs_transport",
    "fused_rs_chunk_cols", "fused_rs_n_not_multiple_of_8", "fused_rs_ws_kind", "ag_bias_non_contiguous",
    "ag_x_misaligned_decided", "rs_weight_transposed_view_decided", "fused_rs_bias_non_contiguous",
    "column_output_indivisible", "row_input_indivisible", "row_sequence_parallel_needs_parallel_input",
    "column_overlap_type", "overlap_wgrad_input", "overlap_backend", "overlap_fused_but_switched_off")


def test_catalogue_is_the_listed_one():
    assert tuple(c.name for c in bad_inputs.CASES) == ALL_CASES
    assert tuple(c.name for c in bad_inputs.CASES if c.cpu) == CPU_CASES
    for case in bad_inputs.CASES:
        assert case.names and case.rules and case.stage in STAGES and case.errors, case.name


def _wrong_rule(case) -> str:
    """The rule of another case that states none of ``case``'s rules (a message about something else)."""
    for other in bad_inputs.CASES:
        for rule in other.rules:
            if not any(mine.lower() in rule.lower() or rule.lower() in mine.lower() for mine in case.rules):
                return rule
    raise AssertionError(f"{case.name}: every other rule overlaps its own")


@pytest.mark.parametrize("case", bad_inputs.CASES, ids=lambda c: c.name)
def test_clear_rejects_a_message_with_the_name_but_another_rule(case):
    """clear() checks the rule, not only the type and the name: each case's own names with another case's rule are
    refused, and with its own rule accepted."""
    error = case.errors[0]
    named = ", ".join(case.names)
    wrong = f"{named}: {_wrong_rule(case)}"
    assert not bad_inputs.clear(case, error(wrong)), f"{case.name} accepted {wrong!r}"
    assert bad_inputs.clear(case, error(f"{named}: {case.rules[0]}"))


def test_clear_needs_the_type_the_name_and_the_rule():
    case = next(c for c in bad_inputs.CASES if c.name == "ag_k_mismatch")
    assert bad_inputs.clear(case, ValueError("ag_gemm: x (4, 8) and weight (6, 7) disagree on K: 8 vs 7"))
    assert not bad_inputs.clear(case, ValueError("ag_gemm: shapes disagree"))  # neither the name nor the rule
    assert not bad_inputs.clear(case, ValueError("ag_gemm: K is 7, expected 8"))  # the name without the rule
    assert not bad_inputs.clear(case, ValueError("ag_gemm: Kx and weight disagree on KK"))  # K only inside words
    assert not bad_inputs.clear(case, TypeError("disagree on K"))  # another type
    assert not bad_inputs.clear(case, None)  # not raised


def _cpu_cases(rank, tp):
    env = bad_inputs.Env.here(rank, tp)
    assert env.device.type == "cpu" and env.backend == "reference"
    rows = bad_inputs.run_cases(env)
    assert tuple(r["case"] for r in rows) == CPU_CASES
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
