"""Functional operators.

| op | inputs (this rank) | output (this rank) |
|---|---|---|
| ``gemm(x, w, bias, weight_layout)`` | x [M, K] | [M, N] (no communication) |
| ``ag_gemm(x_shard_m, w, bias, group=...)`` | x_shard_m [M/tp, K], w [N_local, K] ('nt') or [K, N_local] ('nn') | [M, N_local] (+ gathered x [M, K] if ``return_gathered``) |
| ``gemm_rs(x, w, bias, group=...)`` | x [M, K_local], w [N, K_local] ('nt') or [K_local, N] ('nn') | [M/tp, N], summed over ranks |

FP8 operands (``torch.float8_e4m3fn`` / ``float8_e5m2``, 'nt' layout) take ``x_scale`` and ``w_scale`` (fp32
dequantization scales, tensor-wise or row-wise; for ``ag_gemm`` x_scale is this rank's shard's) and
``fast_accum``, and give bfloat16; ``ag_gemm``'s gathered input is then a :class:`ScaledTensor` (the FP8 rows and
their scales): see :mod:`flux_layers.ops.fp8`.

Every op takes ``backend=`` ('auto' | 'fused' | 'reference', default from ``FLUX_LAYERS_BACKEND``); see
:mod:`flux_layers.ops.backend`. Each distinct call (shapes, dtype, layout, group, backend) is decided once and the
:class:`Decision` kept: :func:`decide` returns it (path, reason, and on the fused path the transport and the call
plan the op library runs), :func:`plan` its :class:`Choice`; a repeated call costs a dict lookup and the decided
call (on the fused path a direct call into the op library); ``refresh_settings()`` makes changed settings count.
Under torch.compile each call is one opaque graph node (:mod:`flux_layers.ops._traceable`), dispatch included.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers.ops import _dispatch, _traceable, fp8, reference
from flux_layers.ops._dispatch import Decision
from flux_layers.ops.backend import Choice
from flux_layers.ops.fp8 import FP8_DTYPES, ScaledTensor
from flux_layers.runtime.workspace import NoGraphTwin

__all__ = ["gemm", "ag_gemm", "gemm_rs", "decide", "plan", "refresh_settings", "Choice", "Decision", "ScaledTensor",
           "reference"]

_compiling = torch.compiler.is_compiling
# The decisions, by _dispatch.call_key (built inline below: a repeated call costs this lookup and the decided call).
_decisions = _dispatch._decisions


def _tp(group) -> int:
    if group is None:
        return 1
    return group.size() if torch.compiler.is_compiling() else dist.get_world_size(group)


def decide(op: str, x, weight, *, group=None, weight_layout: str = "nt", backend: str | None = None,
           dtype: torch.dtype | None = None, device: torch.device | None = None,
           fast_accum: bool = False) -> Decision:
    """How a call of ``op`` ('gemm', 'ag_gemm', 'gemm_rs') with these arguments runs (decided once, and kept: the
    call then runs exactly this). ``x``, ``weight``: the call's tensors, or their shapes with ``dtype`` and
    ``device`` (a call decided before its tensors exist). Under CUDA-graph capture: what a captured call runs. FP8
    tensors: the FP8 call's decision (``fast_accum`` its accumulation)."""
    fp8 = isinstance(x, torch.Tensor) and x.dtype in FP8_DTYPES
    return _dispatch.decide(op, x, weight, group, weight_layout, backend, dtype=dtype, device=device,
                            fast_accum=fast_accum if fp8 else None)


def plan(op: str, x: torch.Tensor, weight: torch.Tensor, *, group=None, weight_layout: str = "nt",
         backend: str | None = None) -> Choice:
    """Which path ``op`` ('gemm', 'ag_gemm', 'gemm_rs') would take for these arguments, and why
    (``decide(...).choice``)."""
    return decide(op, x, weight, group=group, weight_layout=weight_layout, backend=backend).choice


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_layout: str = "nt",
         x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None, fast_accum: bool = False,
         backend: str | None = None) -> torch.Tensor:
    if x_scale is not None or w_scale is not None or x.dtype in FP8_DTYPES:
        if _compiling():
            return _traceable.op_gemm_fp8(x, weight, bias, x_scale, w_scale, weight_layout, fast_accum, backend)
        decision = _decisions.get(("gemm", None, x.shape, weight.shape, (x.dtype, weight.dtype, bool(fast_accum)),
                                   x.get_device(), weight_layout, backend))
        if decision is None:
            decision = _dispatch.decided("gemm", x, weight, None, weight_layout, backend, fast_accum)
        return decision.run(x, weight, bias, x_scale, w_scale)
    if _compiling():
        return _traceable.op_gemm(x, weight, bias, weight_layout, backend)
    decision = _decisions.get(("gemm", None, x.shape, weight.shape, x.dtype, x.get_device(), weight_layout, backend))
    if decision is None:
        decision = _dispatch.decided("gemm", x, weight, None, weight_layout, backend)
    return decision.run(x, weight, bias)


def ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", return_gathered: bool = False, x_scale: torch.Tensor | None = None,
            w_scale: torch.Tensor | None = None, fast_accum: bool = False, backend: str | None = None):
    if x_scale is not None or w_scale is not None or x_shard_m.dtype in FP8_DTYPES:
        if _compiling():
            out, data, scale = _traceable.op_ag_gemm_fp8(x_shard_m, weight, bias, x_scale, w_scale,
                                                         group.group_name if group is not None else "",
                                                         weight_layout, return_gathered, fast_accum, backend)
            return (out, ScaledTensor(data, scale)) if return_gathered else out
        args = (x_shard_m, weight, bias, x_scale, w_scale, return_gathered)
        decision = _decisions.get(("ag_gemm", group, x_shard_m.shape, weight.shape,
                                   (x_shard_m.dtype, weight.dtype, bool(fast_accum)), x_shard_m.get_device(),
                                   weight_layout, backend))
        if decision is None:
            decision = _dispatch.decided("ag_gemm", x_shard_m, weight, group, weight_layout, backend, fast_accum)
        return _run(decision, args)
    if _compiling():
        if _tp(group) == 1:
            out = gemm(x_shard_m, weight, bias, weight_layout=weight_layout, backend=backend)
            return (out, x_shard_m) if return_gathered else out
        out, gathered = _traceable.op_ag_gemm(x_shard_m, weight, bias, group.group_name, weight_layout,
                                              return_gathered, backend)
        return (out, gathered) if return_gathered else out
    decision = _decisions.get(("ag_gemm", group, x_shard_m.shape, weight.shape, x_shard_m.dtype,
                               x_shard_m.get_device(), weight_layout, backend))
    if decision is None:
        decision = _dispatch.decided("ag_gemm", x_shard_m, weight, group, weight_layout, backend)
    return _run(decision, (x_shard_m, weight, bias, return_gathered))


def gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
            fast_accum: bool = False, backend: str | None = None) -> torch.Tensor:
    if x_scale is not None or w_scale is not None or x.dtype in FP8_DTYPES:
        if _compiling():
            return _traceable.op_gemm_rs_fp8(x, weight, bias, x_scale, w_scale,
                                             group.group_name if group is not None else "", weight_layout,
                                             fast_accum, backend)
        decision = _decisions.get(("gemm_rs", group, x.shape, weight.shape, (x.dtype, weight.dtype, bool(fast_accum)),
                                   x.get_device(), weight_layout, backend))
        if decision is None:
            decision = _dispatch.decided("gemm_rs", x, weight, group, weight_layout, backend, fast_accum)
        return _run(decision, (x, weight, bias, x_scale, w_scale))
    if _compiling():
        if _tp(group) == 1:
            return gemm(x, weight, bias, weight_layout=weight_layout, backend=backend)
        return _traceable.op_gemm_rs(x, weight, bias, group.group_name, weight_layout, backend)
    decision = _decisions.get(("gemm_rs", group, x.shape, weight.shape, x.dtype, x.get_device(), weight_layout,
                               backend))
    if decision is None:
        decision = _dispatch.decided("gemm_rs", x, weight, group, weight_layout, backend)
    return _run(decision, (x, weight, bias))


def _run(decision: Decision, args: tuple):
    """A communicating call on its decision: the registered op where the direct call does not apply, and the
    decision for captured calls where this call is captured and its path under capture differs
    (_dispatch.under_capture)."""
    try:
        out = decision.run(*args)
        return decision.fallback(*args) if out is NotImplemented else out
    except NoGraphTwin as exc:
        return _dispatch.under_capture(decision, exc).run(*args)


def refresh_settings() -> None:
    """Make the next calls read the ``FLUX_LAYERS_*`` settings and the tuning table again (each distinct call is
    otherwise decided once, when first made; see :func:`decide`). Workspaces keep the settings they were made with
    (FLUX_LAYERS_TIMEOUT_S, FLUX_LAYERS_POISON_OUTPUTS)."""
    _dispatch.refresh()
    fp8.reload_settings()
