"""ops' calls are decided once per (op, shapes, dtype, device, layout, group, backend) and the decision kept;
refresh_settings() makes the next calls decide again (flux_layers/ops/_dispatch.py)."""
from __future__ import annotations

import pytest
import torch

from flux_layers import ops
from flux_layers.ops import _dispatch


@pytest.fixture
def counted_choose(monkeypatch):
    ops.refresh_settings()
    calls = []
    real = _dispatch.choose

    def choose(op, **kw):
        calls.append((op, kw["mkn"], kw["backend"]))
        return real(op, **kw)
    monkeypatch.setattr(_dispatch, "choose", choose)
    yield calls
    ops.refresh_settings()


def test_repeated_calls_decide_once(counted_choose):
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    for _ in range(3):
        torch.testing.assert_close(ops.gemm(x, w, b), x @ w.t() + b)
    assert counted_choose == [("gemm", (4, 8, 6), None)]
    y = torch.randn(5, 8)
    torch.testing.assert_close(ops.gemm(y, w), y @ w.t())  # another shape: a decision of its own
    torch.testing.assert_close(ops.gemm(x, w.t().contiguous(), weight_layout="nn"), x @ w.t())
    assert [c[1] for c in counted_choose] == [(4, 8, 6), (5, 8, 6), (4, 8, 6)]
    ops.gemm(x, w, backend="reference")  # another requested backend: decided on its own
    assert len(counted_choose) == 4


def test_refresh_makes_settings_count_again(counted_choose, monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    ops.gemm(x, w)
    ops.gemm(x, w)
    assert len(counted_choose) == 1
    monkeypatch.setenv("FLUX_LAYERS_BACKEND", "fused")
    ops.gemm(x, w)  # the kept decision still holds: settings count once refreshed
    assert len(counted_choose) == 1
    ops.refresh_settings()
    with pytest.raises(Exception, match="fused backend requested"):
        ops.gemm(x, w)


def test_bad_input_is_rejected_every_time_and_never_kept(counted_choose):
    x, w = torch.randn(4, 8), torch.randn(6, 7)
    for _ in range(2):
        with pytest.raises(ValueError, match="disagree on K"):
            ops.gemm(x, w)
    assert not _dispatch._decisions
    good = torch.randn(6, 8)
    ops.gemm(x, good)
    with pytest.raises(ValueError, match="bias must have shape"):  # per-call arguments are still checked
        ops.gemm(x, good, torch.randn(5))


def test_group_of_one_runs_the_plain_gemm(counted_choose):
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    out, gathered = ops.ag_gemm(x, w, b, group=None, return_gathered=True)
    torch.testing.assert_close(out, x @ w.t() + b)
    assert gathered is x
    torch.testing.assert_close(ops.gemm_rs(x, w, group=None), x @ w.t())


def _same_call(rank, tp, differ):
    import torch.distributed as dist
    signature = ("ag_gemm", 2048 * (1 + (differ and rank == 1)), 4096, 4096, "torch.bfloat16", "nt")
    if not differ:
        _dispatch.check_same_call(dist.group.WORLD, signature)
        return
    with pytest.raises(ValueError, match=r"rank 0: \('ag_gemm', 2048, .*rank 1: \('ag_gemm', 4096, "):
        _dispatch.check_same_call(dist.group.WORLD, signature)


@pytest.mark.parametrize("differ", [False, True])
def test_ranks_making_different_calls_raise_on_every_rank(differ):
    from flux_layers.devtools.launch import run_distributed
    run_distributed(_same_call, 2, differ)


def test_call_signature_holds_every_field_a_peer_must_agree_on():
    base = ("gemm_rs", 4096, 1024, 512, torch.bfloat16, "nn", "epilogue")
    assert _dispatch.call_signature(*base) == ("gemm_rs", 4096, 1024, 512, "torch.bfloat16", "nn", "epilogue")
    assert _dispatch.call_signature(*base[:6]) == ("gemm_rs", 4096, 1024, 512, "torch.bfloat16", "nn")
    changed = ("ag_gemm", 2048, 2048, 1024, torch.float16, "nt", "copy_engine")
    for i, value in enumerate(changed):
        other = base[:i] + (value,) + base[i + 1:]
        assert _dispatch.call_signature(*other) != _dispatch.call_signature(*base), f"field {i} is not compared"


_OTHER = ("ag_gemm", 2048, 2048, 256, torch.float16, "nn", "copy_engine")  # every field differs from the base


def _each_field(rank, tp):
    import torch.distributed as dist
    base = ("gemm_rs", 4096, 1024, 512, torch.bfloat16, "nt", "epilogue")
    for i in range(len(base)):
        mine = base if rank == 0 else base[:i] + (_OTHER[i],) + base[i + 1:]
        with pytest.raises(ValueError, match=r"rank 0: \('gemm_rs', 4096.*; rank 1: \("):
            _dispatch.check_same_call(dist.group.WORLD, _dispatch.call_signature(*mine))
    _dispatch.check_same_call(dist.group.WORLD, _dispatch.call_signature(*base))  # still in step


def test_a_difference_in_any_field_raises_on_every_rank():
    from flux_layers.devtools.launch import run_distributed
    run_distributed(_each_field, 2)


def test_one_cache_holds_the_decision_a_call_runs(counted_choose):
    """ops.decide returns the decision a call finds (by _dispatch.call_key, which ops builds inline) and runs: its path,
    reason and (reference path) no plan; a decision asked for by shape before its call is the one the call runs."""
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    ops.gemm(x, w)
    decision = ops.decide("gemm", x, w)
    key = _dispatch.call_key("gemm", None, x.shape, w.shape, x.dtype, -1, "nt", None)
    assert _dispatch._decisions[key] is decision and decision.key == key
    assert decision.path == "reference" == ops.plan("gemm", x, w).path and decision.reason
    assert decision.plan is None and decision.transport is None and decision.bound
    assert len(counted_choose) == 1
    ahead = ops.decide("gemm", (5, 8), (6, 8), dtype=x.dtype, device=x.device)  # before its tensors exist
    y = torch.randn(5, 8)
    torch.testing.assert_close(ops.gemm(y, w), y @ w.t())
    assert ops.decide("gemm", y, w) is ahead and len(counted_choose) == 2
    with pytest.raises(TypeError, match="dtype= and device="):
        ops.decide("gemm", (5, 8), (6, 8))
    with pytest.raises(ValueError, match="disagree on K"):
        ops.decide("gemm", (5, 7), (6, 8), dtype=x.dtype, device=x.device)
    ops.refresh_settings()
    assert not _dispatch._decisions


def test_retired_workspaces_drop_their_decisions(counted_choose):
    """The workspace module's public subscription (on_retire) drops the decisions bound to a retired workspace."""
    from dataclasses import replace

    from flux_layers.runtime import workspace
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    ops.gemm(x, w)
    key = next(iter(_dispatch._decisions))
    marker = object()
    _dispatch._decisions[key] = replace(_dispatch._decisions[key], workspace=marker)
    assert _dispatch._drop_decisions_on in workspace._on_retire
    for callback in workspace._on_retire:
        callback(marker)
    assert key not in _dispatch._decisions


def test_fp8_calls_take_the_same_decisions_bound_to_the_fp8_fused_calls(monkeypatch):
    """An FP8 call is decided as a 16-bit one (its key's dtype slot: both formats and the accumulation), bound at its
    first call to the FP8 fused call of its op, and kept; the 16-bit call of the same shapes is another decision."""
    from flux_layers.ops.backend import Choice
    ops.refresh_settings()
    group = object()  # any hashable stands for the group: the group size and the choice are stubbed
    monkeypatch.setattr(_dispatch, "_tp", lambda g: 1 if g is None else 2)
    monkeypatch.setattr(_dispatch, "choose", lambda op, **kw: Choice("fused", "stubbed"))
    bound = []

    def binder(name):
        def bind(decision, x, weight, group_, weight_layout, *fast_accum):
            bound.append((name, decision.key[4], fast_accum))
            return _dispatch._bound(decision, lambda *args: (name, len(args)))
        return bind
    for name in ("_fused_fp8_ag_gemm", "_fused_fp8_gemm_rs", "_fused_ag_gemm", "_fused_gemm_rs"):
        monkeypatch.setattr(_dispatch, name, binder(name))
    x8 = torch.randn(32, 64).to(torch.float8_e4m3fn)
    w8 = torch.randn(48, 64).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    for _ in range(2):
        assert ops.ag_gemm(x8, w8, group=group, x_scale=one, w_scale=one, fast_accum=True) == ("_fused_fp8_ag_gemm", 6)
        assert ops.gemm_rs(x8, w8, group=group, x_scale=one, w_scale=one) == ("_fused_fp8_gemm_rs", 5)
    slot = (torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert bound == [("_fused_fp8_ag_gemm", slot + (True,), (True,)), ("_fused_fp8_gemm_rs", slot + (False,), (False,))]
    decision = ops.decide("ag_gemm", x8, w8, group=group, fast_accum=True)
    assert decision.bound and decision.key[4] == slot + (True,) and decision.reason == "stubbed"
    x16, w16 = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    assert ops.ag_gemm(x16, w16, group=group) == ("_fused_ag_gemm", 4)
    assert bound[-1] == ("_fused_ag_gemm", torch.bfloat16, ())
    with pytest.raises(ValueError, match="must have the same dtype"):
        ops.ag_gemm(x8, w16, group=group, x_scale=one, w_scale=one)
    ops.refresh_settings()
