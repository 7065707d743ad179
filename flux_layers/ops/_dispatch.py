"""The one cache of decisions: how a call of ``ops.gemm`` / ``ops.ag_gemm`` / ``ops.gemm_rs`` with given arguments
runs, decided once (``ops.decide`` is its public entry).

A call is identified by :func:`call_key` (op, group, x's and the weight's shapes, dtype, device index (-1 off the
GPU), weight layout, requested backend). The first call with a key validates the arguments, asks the dispatcher
(:func:`flux_layers.ops.backend.choose`) and, on the fused path, checks the call across ranks, finds the workspace
and registers the call plan with it: the :class:`Decision` kept then says what every later call runs (path, reason,
transport, plan) and holds ``run``, for the fused copy-engine path the op library's direct call with the workspace
and plan bound (flux_layers/ops/_opcalls.py), so a repeated call costs a dict lookup and that call, which checks the
tensors themselves before anything is enqueued. A decision asked for before its call (``ops.decide``, as the layers
decide their backward GEMMs at fprop) is kept with its choice only and binds its workspace at its first call.

Capture. A call with backend 'auto' (or None) may take another path while the current stream is being captured
into a CUDA graph (``choose`` refuses the fused path where the workspaces have no CUDA-graph twins, and the NCCL
transport's always). The capture state is not part of the key, so that an eager call does not ask for it: the
fused call finds out itself (the op library asks the stream once, to pick the twin) and raises ``NoGraphTwin``
where there is none, and the call then takes the decision made for calls under capture (:func:`under_capture`),
kept beside it. ``ops.decide`` asks for the state and returns the decision that applies.

Settings (``FLUX_LAYERS_*``) and the tuning table are read when a decision is made: after changing them in a
running process, call :func:`refresh`. A workspace outgrown by a larger call, or reset, drops the decisions bound
to it (workspace.on_retire).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from flux_layers.ops import _opcalls, reference
from flux_layers.ops._checks import check_fused_tensor, check_matmul_args, check_matmul_shapes
from flux_layers.ops.backend import Choice, choose
from flux_layers.ops.fp8 import FP8_DTYPES
from flux_layers.runtime import workspace
from flux_layers.runtime.call_plan import AgCallPlan, RsCallPlan
from flux_layers.runtime.tuning import KernelChoice

_decisions: dict[tuple, Decision] = {}
_lock = threading.Lock()
_UNDER_CAPTURE = "under capture"  # the key suffix of the decisions for calls under CUDA-graph capture


@dataclass(frozen=True, slots=True)
class Decision:
    """What a call of ``op`` with these arguments runs: ``choice`` (path 'fused' or 'reference', and why); on the fused
    path ``transport`` ('copy_engine', 'nccl' or 'hybrid' for ag_gemm; 'epilogue', 'copy_engine', 'nccl' or 'hybrid' for
    gemm_rs) and ``plan``, what the op library runs: the call plan registered with the workspace (ag_gemm: mode push /
    pull / external, order, rows per chunk; gemm_rs: transport, chunk columns; both the tile, swizzle, stream-K fill and
    SM count), or the kernel configuration of a plain GEMM. A fused decision made before its first call (``ops.decide``)
    has no plan yet (``bound`` False).

    ``run(x, weight, bias[, return_gathered])`` makes the call (it may answer NotImplemented: then ``fallback``, the
    registered op's call, makes it); ``workspace`` is the workspace it runs on."""
    op: str
    choice: Choice
    transport: str | None = None
    plan: AgCallPlan | RsCallPlan | KernelChoice | None = None
    bound: bool = True
    workspace: workspace.Workspace | None = field(default=None, compare=False, repr=False)
    run: Callable = field(default=None, compare=False, repr=False)
    fallback: Callable = field(default=None, compare=False, repr=False)
    key: tuple = field(default=(), compare=False, repr=False)

    @property
    def path(self) -> str:
        return self.choice.path

    @property
    def reason(self) -> str:
        return self.choice.reason


def call_key(op: str, group, x_shape, w_shape, dtype: torch.dtype, device_index: int, weight_layout: str,
             backend: str | None) -> tuple:
    """The key of a call's decision (ops/__init__.py builds the same tuple inline on every call)."""
    return (op, group, x_shape, w_shape, dtype, device_index, weight_layout, backend)


def _capture_sensitive(key: tuple) -> bool:
    """Whether a call may take another path under CUDA-graph capture: a requested path is taken either way (the op
    runs a captured call on the workspace's twin, or says that there is none)."""
    return key[0] != "gemm" and key[1] is not None and key[7] not in ("fused", "reference")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _drop_decisions_on(ws) -> None:
    """A workspace was retired: forget the decisions bound to it, so that nothing keeps it alive."""
    with _lock:
        for key in [k for k, d in _decisions.items() if d.workspace is ws]:
            del _decisions[key]


workspace.on_retire(_drop_decisions_on)


def refresh() -> None:
    """Forget every decision, so the next calls read the settings and the tuning table again."""
    from flux_layers.runtime import tuning
    with _lock:
        _decisions.clear()
    tuning.reload()


def _keep(decision: Decision) -> Decision:
    with _lock:
        return _decisions.setdefault(decision.key, decision)


def _tp(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


# ---------------------------------------------------------------- deciding


def decide(op: str, x, weight, group, weight_layout: str, backend: str | None, *, dtype=None,
           device=None, fast_accum: bool | None = None) -> Decision:
    """``ops.decide``: the decision for a call of ``op`` with these arguments (tensors, or shapes with ``dtype`` and
    ``device``), as the call would take it now (under CUDA-graph capture: the decision for captured calls).
    ``fast_accum`` not None: an FP8 call (tensors only: both operands' formats are part of the decision)."""
    tensors = isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    if tensors:
        dtype = _checked_dtype_slot(op, x, weight, weight_layout, fast_accum)
        x_shape, w_shape, device = x.shape, weight.shape, x.device
    else:
        if dtype is None or device is None:
            raise TypeError(f"decide: {op}'s x and weight are tensors, or shapes with dtype= and device=")
        if fast_accum is not None or dtype in FP8_DTYPES:
            raise TypeError(f"decide: an FP8 {op} is decided from its tensors (both operands' formats count)")
        x_shape, w_shape, device = tuple(x), tuple(weight), torch.device(device)
        check_matmul_shapes(op, x_shape, w_shape, weight_layout)
    index = device.index if device.type == "cuda" and device.index is not None else -1
    key = call_key(op, group, x_shape, w_shape, dtype, index, weight_layout, backend)
    if _capture_sensitive(key) and device.type == "cuda" and _capturing():
        key += (_UNDER_CAPTURE,)
    found = _decisions.get(key)
    if found is not None:
        return found
    return _keep(_chosen(key, x_shape, w_shape, dtype, device))


def decided(op: str, x: torch.Tensor, weight: torch.Tensor, group, weight_layout: str, backend: str | None,
            fast_accum: bool | None = None) -> Decision:
    """The bound decision for a call with these arguments, made and kept where there is none yet (ops/__init__.py
    calls it where its own lookup missed; ``fast_accum`` not None for an FP8 call); a call under capture that may
    take another path gets the decision for captured calls."""
    dtype = _checked_dtype_slot(op, x, weight, weight_layout, fast_accum)
    key = call_key(op, group, x.shape, weight.shape, dtype, x.get_device(), weight_layout, backend)
    if _capture_sensitive(key) and x.is_cuda and _capturing():
        key += (_UNDER_CAPTURE,)
    found = _decisions.get(key)
    if found is not None:
        return _bind(found, x, weight)
    chosen = _chosen(key, x.shape, weight.shape, dtype, x.device)
    return _keep(chosen) if chosen.bound else _bind(chosen, x, weight)


def _checked_dtype_slot(op: str, x: torch.Tensor, weight: torch.Tensor, weight_layout: str,
                        fast_accum: bool | None):
    """The dtype slot of a call's key, the operands checked: x's dtype (16-bit calls), or (x's format, the weight's
    format, fast_accum) for an FP8 call (``fast_accum`` not None; the scales are per call: the op checks them)."""
    _, _, n = check_matmul_args(op, x, weight, None, weight_layout)
    if fast_accum is None:
        return x.dtype
    from flux_layers.ops.fp8 import check_fp8_args
    check_fp8_args(op, x, weight, None, None, None, weight_layout, n, scales=False)
    return fp8_dtype_slot(x, weight, fast_accum)


def fp8_dtype_slot(x: torch.Tensor, weight: torch.Tensor, fast_accum: bool) -> tuple:
    """An FP8 call's dtype slot of :func:`call_key` (ops/__init__.py builds the same inline)."""
    return (x.dtype, weight.dtype, bool(fast_accum))


def under_capture(decision: Decision, exc: workspace.NoGraphTwin) -> Decision:
    """The decision for a call that raised ``exc`` because its stream is being captured: the one for captured
    calls where that differs (the reference path), else ``exc`` again."""
    if not _capture_sensitive(decision.key):
        raise exc
    key = decision.key + (_UNDER_CAPTURE,)
    captured = _decisions.get(key)
    if captured is None:
        op, group, x_shape, w_shape, dtype, index, _, _ = decision.key
        captured = _keep(_chosen(key, x_shape, w_shape, dtype, torch.device("cuda", index)))
    if captured.path == "fused":
        raise exc
    return captured


def _chosen(key: tuple, x_shape, w_shape, dtype, device: torch.device) -> Decision:
    """A decision with its choice made (and, off the fused path, its call): not yet bound to a workspace. ``dtype``:
    the key's dtype slot (an FP8 call's is a tuple, :func:`fp8_dtype_slot`)."""
    op, group, _, _, _, _, weight_layout, backend = key[:8]
    m, k, n = check_matmul_shapes(op, x_shape, w_shape, weight_layout)
    tp = _tp(group)
    if op != "gemm" and tp == 1:  # no communication: the plain GEMM's choice, bound to it at the first call
        gemm_key = call_key("gemm", None, x_shape, w_shape, dtype, key[5], weight_layout, backend)
        gemm = _decisions.get(gemm_key) or _keep(_chosen(gemm_key, x_shape, w_shape, dtype, device))
        decision = Decision(op, gemm.choice, key=key, bound=False)
        return replace(decision, run=_binding_run(decision))
    fp8 = _fp8(dtype)
    choice = choose(op, device=device, dtype=dtype[0] if fp8 else dtype,
                    mkn=(m * tp if op == "ag_gemm" else m, k, n), group=group, backend=backend,
                    fast_accum=fp8 and dtype[2], w_dtype=dtype[1] if fp8 else None)
    decision = Decision(op, choice, key=key, bound=False)
    if choice.path == "reference":
        return _bound(decision, _reference(op, group, weight_layout, dtype[2] if fp8 else None))
    return replace(decision, run=_binding_run(decision))


def _fp8(dtype_slot) -> bool:
    return isinstance(dtype_slot, tuple)


def _binding_run(decision: Decision) -> Callable:
    """A chosen decision's ``run``: binds it (with the tensors of its first call), then makes the call."""
    def run(x, weight, bias, *rest):  # rest: [x_scale, w_scale,] [return_gathered]
        bound = _bind(decision, x, weight)
        out = bound.run(x, weight, bias, *rest)
        return bound.fallback(x, weight, bias, *rest) if out is NotImplemented else out
    return run


def _bound(decision: Decision, run: Callable, fallback: Callable | None = None, **fields) -> Decision:
    return replace(decision, bound=True, run=run, fallback=fallback or run, **fields)


def _bind(decision: Decision, x: torch.Tensor, weight: torch.Tensor) -> Decision:
    """``decision`` bound to its call: on the fused path the arguments checked as the fused kernels need them, the
    call checked across ranks, the workspace found (or grown) and the plan registered; kept in the cache."""
    if decision.bound:
        return decision
    op, group, _, _, dtype, _, weight_layout, backend = decision.key[:8]
    fp8 = _fp8(dtype)
    if op != "gemm" and _tp(group) == 1:
        gemm = decided("gemm", x, weight, None, weight_layout, backend, dtype[2] if fp8 else None)
        run = gemm.run if op == "gemm_rs" else _with_input(gemm.run, fp8)
        bound = replace(gemm, op=op, key=decision.key, run=run, fallback=run)  # never NotImplemented
    elif fp8:
        bound = {"gemm": _fused_fp8_gemm, "ag_gemm": _fused_fp8_ag_gemm, "gemm_rs": _fused_fp8_gemm_rs}[op](
            decision, x, weight, group, weight_layout, dtype[2])
    elif op == "gemm":
        bound = _fused_gemm(decision, x, weight, weight_layout)
    elif op == "ag_gemm":
        bound = _fused_ag_gemm(decision, x, weight, group, weight_layout)
    else:
        bound = _fused_gemm_rs(decision, x, weight, group, weight_layout)
    with _lock:
        _decisions[decision.key] = bound
    return bound


def _with_input(gemm_run: Callable, fp8: bool) -> Callable:
    """ag_gemm on a group of one: the plain GEMM, and x itself as the gathered input (FP8: with its scales)."""
    if not fp8:
        def run(x, weight, bias, return_gathered):
            out = gemm_run(x, weight, bias)
            return (out, x) if return_gathered else out
        return run
    from flux_layers.ops.fp8 import ScaledTensor

    def run_fp8(x, weight, bias, x_scale, w_scale, return_gathered):
        out = gemm_run(x, weight, bias, x_scale, w_scale)
        if not return_gathered:
            return out
        return out, ScaledTensor(x, x_scale.reshape(1) if x_scale.numel() == 1 else x_scale)
    return run_fp8


def _reference(op: str, group, weight_layout: str, fast_accum: bool | None) -> Callable:
    """The reference path's call (``fast_accum`` not None: FP8 operands, whose call takes the scales after the
    bias)."""
    if fast_accum is not None:
        return _fp8_reference(op, group, weight_layout, fast_accum)
    if op == "gemm":
        def run(x, weight, bias):
            check_matmul_args("gemm", x, weight, bias, weight_layout)
            return reference.linear(x, weight, bias, weight_layout)
    elif op == "ag_gemm":
        def run(x_shard_m, weight, bias, return_gathered):
            return reference.ag_gemm(x_shard_m, weight, bias, group=group, weight_layout=weight_layout,
                                     return_gathered=return_gathered)
    else:
        def run(x, weight, bias):
            return reference.gemm_rs(x, weight, bias, group=group, weight_layout=weight_layout)
    return run


def _fp8_reference(op: str, group, weight_layout: str, fast_accum: bool) -> Callable:
    if op == "gemm":
        def run(x, weight, bias, x_scale, w_scale):
            return reference.gemm(x, weight, bias, weight_layout=weight_layout, x_scale=x_scale, w_scale=w_scale,
                                  fast_accum=fast_accum)
    elif op == "ag_gemm":
        def run(x_shard_m, weight, bias, x_scale, w_scale, return_gathered):
            return reference.ag_gemm(x_shard_m, weight, bias, group=group, weight_layout=weight_layout,
                                     return_gathered=return_gathered, x_scale=x_scale, w_scale=w_scale,
                                     fast_accum=fast_accum)
    else:
        def run(x, weight, bias, x_scale, w_scale):
            return reference.gemm_rs(x, weight, bias, group=group, weight_layout=weight_layout, x_scale=x_scale,
                                     w_scale=w_scale, fast_accum=fast_accum)
    return run


# ---------------------------------------------------------------- the fused paths


def call_signature(op: str, m: int, k: int, n: int, dtype: torch.dtype, weight_layout: str,
                   transport: str | None = None) -> tuple:
    """What :func:`check_same_call` compares: (op, M, K, N, dtype, layout), and the transport (copy engine or NCCL
    for the all-gather; epilogue, copy engine or NCCL for the GEMM+ReduceScatter; both sides of a transfer must use the
    same). M counts the gathered rows for ag_gemm, x's rows for gemm_rs."""
    signature = (op, m, k, n, str(dtype), weight_layout)
    return signature if transport is None else signature + (transport,)


def check_same_call(group, signature: tuple) -> None:
    """Every rank of ``group`` makes the same call (a collective): raises ValueError on every rank, naming each rank's
    call, where they differ. Run once per decision of a fused call (before its workspace is found or grown), so
    that ranks calling with different shapes, dtypes, layouts or transports, or in a different order, stop here
    instead of timing out in the op or hanging in the workspace's collective. Not under CUDA-graph capture (a
    collective cannot be captured; the eager warm-up checked the same calls)."""
    if _capturing():
        return
    signatures = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, signature, group=group)
    if any(other != signature for other in signatures):
        calls = "; ".join(f"rank {r}: {s}" for r, s in enumerate(signatures))
        raise ValueError(f"the ranks of the group made different fused calls ({calls}); every rank must make the "
                         "same calls in the same order")


def _fused_gemm(decision: Decision, x, weight, weight_layout: str) -> Decision:
    from flux_layers import _env
    from flux_layers.ops import fused_gemm
    from flux_layers.runtime import tuning
    m, k, n = check_matmul_args("gemm", x, weight, None, weight_layout)
    check_fused_tensor("gemm", "x", x)
    check_fused_tensor("gemm", "weight", weight)
    kernel = tuning.resolve_kernel("gemm", dtype=x.dtype, tp=1, mkn=(m, k, n))
    weight_nn, poison = weight_layout == "nn", _env.get("POISON_OUTPUTS") == "1"

    def run(x, weight, bias):
        return fused_gemm.run(x, weight, bias, weight_nn, kernel, poison)
    return _bound(decision, run, plan=kernel)


def _fused_ag_gemm(decision: Decision, x_shard_m, weight, group, weight_layout: str) -> Decision:
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.ops.backend import ag_transport
    transport = ag_transport(group)
    m, k, n = fused_ag_gemm.check_args(x_shard_m, weight, None, weight_layout, group)
    check_same_call(group, call_signature("ag_gemm", m, k, n, x_shard_m.dtype, weight_layout, transport))
    ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k, transport)
    weight_nn = weight_layout == "nn"
    if transport != "copy_engine":  # NCCL or hybrid: the transfers driven from the host
        call = fused_ag_gemm.plan_nccl_call(ws, m=m, k=k, n=n)

        def run(x_shard_m, weight, bias, return_gathered):
            return fused_ag_gemm.run_nccl(ws, call, x_shard_m, weight, bias, weight_nn, return_gathered)
        return _bound(decision, run, transport=transport, plan=call.plan, workspace=ws)
    plan = fused_ag_gemm.plan_call(ws, m=m, k=k, n=n)
    op = _opcalls.ag_gemm(ws, ws.plan_index(plan), weight_nn)
    return _bound(decision, op.direct or op.registered, op.registered, transport=transport, plan=plan, workspace=ws)


def _fused_gemm_rs(decision: Decision, x, weight, group, weight_layout: str) -> Decision:
    from flux_layers.ops import fused_gemm_rs
    from flux_layers.ops.backend import rs_host_transport
    from flux_layers.runtime import tuning
    m, k, n = fused_gemm_rs.check_args(x, weight, None, weight_layout, group)
    weight_nn = weight_layout == "nn"
    host = rs_host_transport(group)
    if host is not None:  # NCCL or hybrid: the transfers driven from the host
        check_same_call(group, call_signature("gemm_rs", m, k, n, x.dtype, weight_layout, host))
        ws = workspace.get_rs_workspace(group, x.dtype, m, n, over_nccl=host == "nccl", hybrid=host == "hybrid")
        call = fused_gemm_rs.plan_nccl_call(ws, m=m, k=k, n=n)

        def run(x, weight, bias):
            return fused_gemm_rs.run_nccl(ws, call, x, weight, bias, weight_nn)
        return _bound(decision, run, transport=host, plan=call.plan, workspace=ws)
    transport = tuning.rs_transport(dtype=x.dtype, tp=dist.get_world_size(group), mkn=(m, k, n))
    check_same_call(group, call_signature("gemm_rs", m, k, n, x.dtype, weight_layout, transport))
    ws = workspace.get_rs_workspace(group, x.dtype, m, n)
    plan = fused_gemm_rs.plan_call(ws, m=m, k=k, n=n, transport=transport)
    op = _opcalls.gemm_rs(ws, ws.plan_index(plan), weight_nn)
    return _bound(decision, op.direct or op.registered, op.registered, transport=transport, plan=plan, workspace=ws)


# ---------------------------------------------------------------- FP8 operands
# FP8 calls (flux_layers/ops/fp8.py) take the decisions above, keyed by both operand formats and the accumulation in
# the dtype slot (fp8_dtype_slot); their ``run`` takes the scales after the bias: ``run(x, weight, bias, x_scale,
# w_scale[, return_gathered])``. The scales are per-call tensors: the op checks them (their modes do not change the
# decision).


def _fused_fp8_gemm(decision: Decision, x, weight, group, weight_layout: str, fast_accum: bool) -> Decision:
    from flux_layers import _env
    from flux_layers.ops import fused_gemm
    from flux_layers.runtime import tuning
    m, k, n = check_matmul_args("gemm", x, weight, None, "nt")
    check_fused_tensor("gemm", "x", x)
    check_fused_tensor("gemm", "weight", weight)
    kernel = tuning.resolve_kernel("gemm", dtype=x.dtype, tp=1, mkn=(m, k, n), fast_accum=fast_accum,
                                   w_dtype=weight.dtype)
    poison = _env.get("POISON_OUTPUTS") == "1"

    def run(x, weight, bias, x_scale, w_scale):  # the op checks the scales and operand types
        return fused_gemm.run(x, weight, bias, False, kernel, poison, x_scale, w_scale, fast_accum)
    return _bound(decision, run, plan=kernel)


def _fused_fp8_ag_gemm(decision: Decision, x_shard_m, weight, group, weight_layout: str, fast_accum: bool) -> Decision:
    """An FP8 workspace's all-gather: the FP8 rows and their scales travel (by the copy engine, or by NCCL and the
    hybrid transport's pushes, driven from the host)."""
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.ops.backend import ag_transport
    transport = ag_transport(group)
    m, k, n = fused_ag_gemm.check_args(x_shard_m, weight, None, weight_layout, group)
    check_same_call(group, call_signature("ag_gemm", m, k, n, decision.key[4], weight_layout, transport))
    ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k, transport)
    weight_nn = weight_layout == "nn"
    if transport != "copy_engine":
        call = fused_ag_gemm.plan_nccl_call(ws, m=m, k=k, n=n, fast_accum=fast_accum)

        def run(x_shard_m, weight, bias, x_scale, w_scale, return_gathered):
            return fused_ag_gemm.run_nccl(ws, call, x_shard_m, weight, bias, weight_nn, return_gathered,
                                          x_scale=x_scale, w_scale=w_scale)
        return _bound(decision, run, transport=transport, plan=call.plan, workspace=ws)
    plan = fused_ag_gemm.plan_call(ws, m=m, k=k, n=n, fast_accum=fast_accum)
    op = _opcalls.ag_gemm_fp8(ws, ws.plan_index(plan), weight_nn)
    return _bound(decision, op, op.registered, transport=transport, plan=plan, workspace=ws)


def _fused_fp8_gemm_rs(decision: Decision, x, weight, group, weight_layout: str, fast_accum: bool) -> Decision:
    """The reduce-scatter of FP8 operands: bfloat16 partials on a bfloat16 workspace."""
    from flux_layers.ops import fused_gemm_rs
    from flux_layers.ops.backend import rs_host_transport
    from flux_layers.ops.fp8 import OUT_DTYPE
    from flux_layers.runtime import tuning
    m, k, n = fused_gemm_rs.check_args(x, weight, None, weight_layout, group)
    weight_nn = weight_layout == "nn"
    host = rs_host_transport(group)
    if host is not None:
        check_same_call(group, call_signature("gemm_rs", m, k, n, decision.key[4], weight_layout, host))
        ws = workspace.get_rs_workspace(group, OUT_DTYPE, m, n, over_nccl=host == "nccl", hybrid=host == "hybrid")
        call = fused_gemm_rs.plan_nccl_call(ws, m=m, k=k, n=n, fast_accum=fast_accum)

        def run(x, weight, bias, x_scale, w_scale):
            return fused_gemm_rs.run_nccl(ws, call, x, weight, bias, weight_nn, x_scale, w_scale)
        return _bound(decision, run, transport=host, plan=call.plan, workspace=ws)
    transport = tuning.rs_transport(dtype=x.dtype, tp=dist.get_world_size(group), mkn=(m, k, n))
    check_same_call(group, call_signature("gemm_rs", m, k, n, decision.key[4], weight_layout, transport))
    ws = workspace.get_rs_workspace(group, OUT_DTYPE, m, n)
    plan = fused_gemm_rs.plan_call(ws, m=m, k=k, n=n, transport=transport, fast_accum=fast_accum)
    op = _opcalls.gemm_rs_fp8(ws, ws.plan_index(plan), weight_nn)
    return _bound(decision, op, op.registered, transport=transport, plan=plan, workspace=ws)
