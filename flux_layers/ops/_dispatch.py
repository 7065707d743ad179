"""Calls of ``ops.gemm`` / ``ops.ag_gemm`` / ``ops.gemm_rs`` decided once.

A call is identified by (op, group, shapes, dtype, device index (-1 off the GPU), weight layout, requested
backend, whether the current stream is being captured). The first call with such a key validates the arguments,
asks the dispatcher (:func:`flux_layers.ops.backend.choose`), finds the workspace and registers the
kernel/transfer plan; the decision is kept, so every later call with the key costs one dict lookup and the op
(which checks the tensors themselves, strides and alignment, before anything is enqueued). Settings
(``FLUX_LAYERS_*``) and the tuning table are read when a decision is made: after changing them in a running
process, call :func:`refresh`.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from flux_layers.ops import _opcalls, reference
from flux_layers.ops._checks import check_fused_tensor, check_matmul_args
from flux_layers.ops.backend import Choice, choose

_decisions: dict[tuple, object] = {}
_choices: dict[tuple, Choice] = {}
_lock = threading.Lock()


def _drop_calls_on(ws) -> None:
    """A workspace was replaced by a larger one: forget the calls bound to it, so that nothing keeps it alive."""
    with _lock:
        for key in [k for k, call in _decisions.items() if getattr(call, "ws", None) is ws]:
            del _decisions[key]


def _register() -> None:
    from flux_layers.runtime import workspace
    if _drop_calls_on not in workspace._on_retire:
        workspace._on_retire.append(_drop_calls_on)


_register()


def refresh() -> None:
    """Forget every decision, so the next calls read the settings and the tuning table again."""
    from flux_layers.runtime import tuning
    with _lock:
        _decisions.clear()
        _choices.clear()
    tuning._load_tables.cache_clear()


def _tp(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _capturing(x: torch.Tensor, backend: str | None) -> bool:
    """Part of a call's key only where it can change the decision: with the path left to the dispatcher (a capture
    without CUDA-graph twins takes the reference path). A requested path is taken either way; the op itself runs a
    captured call on the workspace's twin, or says that there is none."""
    return backend not in ("fused", "reference") and x.is_cuda and torch.cuda.is_current_stream_capturing()


def choice(op: str, device: torch.device, dtype: torch.dtype, mkn: tuple[int, int, int], group,
           backend: str | None) -> Choice:
    """:func:`choose`, decided once per (op, device, dtype, shape, group, backend, capture state)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = (op, device, dtype, mkn, group, backend, capturing)
    found = _choices.get(key)
    if found is None:
        found = choose(op, device=device, dtype=dtype, mkn=mkn, group=group, backend=backend)
        _choices[key] = found
    return found


class _FusedGemm:
    __slots__ = ("kernel", "weight_nn", "poison", "fast_accum")

    def __init__(self, x, weight, weight_layout, fast_accum=None):
        from flux_layers import _env
        from flux_layers.runtime import tuning
        m, k, n = check_matmul_args("gemm", x, weight, None, weight_layout)
        check_fused_tensor("gemm", "x", x)
        check_fused_tensor("gemm", "weight", weight)
        self.kernel = tuning.resolve_kernel("gemm", dtype=x.dtype, tp=1, mkn=(m, k, n), fast_accum=fast_accum)
        self.weight_nn = weight_layout == "nn"
        self.poison = _env.get("POISON_OUTPUTS") == "1"
        self.fast_accum = bool(fast_accum)

    def __call__(self, x, weight, bias, x_scale=None, w_scale=None):
        from flux_layers.ops import fused_gemm
        return fused_gemm.run(x, weight, bias, self.weight_nn, self.kernel, self.poison, x_scale, w_scale,
                              self.fast_accum)


def _raise_workspace_error(exc: RuntimeError):
    from flux_layers.runtime import workspace
    failed = workspace.workspace_error(exc)
    if failed is None:
        raise exc
    raise failed from None


def call_signature(op: str, m: int, k: int, n: int, dtype: torch.dtype, weight_layout: str,
                   transport: str | None = None) -> tuple:
    """What :func:`check_same_call` compares: (op, M, K, N, dtype, layout), and the transport (copy engine or NCCL
    for the all-gather; direct, copy engine or NCCL for the GEMM+ReduceScatter; both sides of a transfer must use the
    same). M counts the gathered rows for ag_gemm, x's rows for gemm_rs."""
    signature = (op, m, k, n, str(dtype), weight_layout)
    return signature if transport is None else signature + (transport,)


def check_same_call(group, signature: tuple) -> None:
    """Every rank of ``group`` makes the same call (a collective): raises ValueError on every rank, naming each rank's
    call, where they differ. Run once per decision of a fused call (before its workspace is found or grown), so
    that ranks calling with different shapes, dtypes, layouts or transports, or in a different order, stop here
    instead of timing out in the op or hanging in the workspace's collective. Not under CUDA-graph capture (a
    collective cannot be captured; the eager warm-up checked the same calls)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    signatures = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, signature, group=group)
    if any(other != signature for other in signatures):
        calls = "; ".join(f"rank {r}: {s}" for r, s in enumerate(signatures))
        raise ValueError(f"the ranks of the group made different fused calls ({calls}); every rank must make the "
                         "same calls in the same order")


class _FusedAgGemm:
    """ops.ag_gemm on the fused path: the op, the workspace (kept alive here) and the plan registered with it. A
    workspace outgrown by a larger call drops the calls bound to it (_drop_calls_on): they are decided anew."""
    __slots__ = ("ws", "handle", "plan", "weight_nn", "op")

    def __init__(self, x_shard_m, weight, group, weight_layout):
        from flux_layers.ops import fused_ag_gemm
        from flux_layers.runtime import workspace
        m, k, n = fused_ag_gemm.check_args(x_shard_m, weight, None, weight_layout, group)
        check_same_call(group, call_signature("ag_gemm", m, k, n, x_shard_m.dtype, weight_layout, "copy_engine"))
        self.ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k)
        self.handle, self.plan = self.ws.handle, fused_ag_gemm.plan_call(self.ws, m=m, k=k, n=n)
        self.weight_nn = weight_layout == "nn"
        self.op = _opcalls.ag_gemm()

    def __call__(self, x_shard_m, weight, bias, return_gathered):
        try:
            out, gathered = self.op(x_shard_m, weight, bias, self.handle, self.plan, self.weight_nn, return_gathered,
                                    True)
        except RuntimeError as exc:
            _raise_workspace_error(exc)
        return (out, gathered) if return_gathered else out


class _FusedAgGemmNccl:
    """ops.ag_gemm on the fused path with the NCCL transport (flux_layers/runtime/nccl_transport.py): the workspace
    in local memory, the call plan and this rank's NCCL batches, as :class:`_FusedAgGemm`."""
    __slots__ = ("ws", "call", "weight_nn", "run")

    def __init__(self, x_shard_m, weight, group, weight_layout):
        from flux_layers.ops import fused_ag_gemm
        from flux_layers.runtime import workspace
        m, k, n = fused_ag_gemm.check_args(x_shard_m, weight, None, weight_layout, group)
        check_same_call(group, call_signature("ag_gemm", m, k, n, x_shard_m.dtype, weight_layout, "nccl"))
        self.ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k, "nccl")
        self.call = fused_ag_gemm.plan_nccl_call(self.ws, m=m, k=k, n=n)
        self.weight_nn = weight_layout == "nn"
        self.run = fused_ag_gemm.run_nccl

    def __call__(self, x_shard_m, weight, bias, return_gathered):
        out, gathered = self.run(self.ws, self.call, x_shard_m, weight, bias, self.weight_nn, return_gathered)
        return (out, gathered) if return_gathered else out


class _FusedGemmRsNccl:
    """ops.gemm_rs on the fused path with the NCCL transport (flux_layers/runtime/nccl_rs_transport.py): the workspace
    in local memory, the call plan and this rank's NCCL batches, as :class:`_FusedGemmRs`."""
    __slots__ = ("ws", "call", "weight_nn", "run")

    def __init__(self, x, weight, group, weight_layout):
        from flux_layers.ops import fused_gemm_rs
        from flux_layers.runtime import workspace
        m, k, n = fused_gemm_rs.check_args(x, weight, None, weight_layout, group)
        check_same_call(group, call_signature("gemm_rs", m, k, n, x.dtype, weight_layout, "nccl"))
        self.ws = workspace.get_rs_workspace(group, x.dtype, m, n, nccl=True)
        self.call = fused_gemm_rs.plan_nccl_call(self.ws, m=m, k=k, n=n)
        self.weight_nn = weight_layout == "nn"
        self.run = fused_gemm_rs.run_nccl

    def __call__(self, x, weight, bias):
        return self.run(self.ws, self.call, x, weight, bias, self.weight_nn)


class _FusedGemmRs:
    """ops.gemm_rs on the fused path: as :class:`_FusedAgGemm`."""
    __slots__ = ("ws", "handle", "plan", "weight_nn", "op")

    def __init__(self, x, weight, group, weight_layout):
        from flux_layers.ops import fused_gemm_rs
        from flux_layers.runtime import tuning, workspace
        m, k, n = fused_gemm_rs.check_args(x, weight, None, weight_layout, group)
        transport = tuning.rs_transport(dtype=x.dtype, tp=dist.get_world_size(group), mkn=(m, k, n))
        check_same_call(group, call_signature("gemm_rs", m, k, n, x.dtype, weight_layout, transport))
        self.ws = workspace.get_rs_workspace(group, x.dtype, m, n)
        self.handle, self.plan = self.ws.handle, fused_gemm_rs.plan_call(self.ws, m=m, k=k, n=n)
        self.weight_nn = weight_layout == "nn"
        self.op = _opcalls.gemm_rs()

    def __call__(self, x, weight, bias):
        try:
            return self.op(x, weight, bias, self.handle, self.plan, self.weight_nn)
        except RuntimeError as exc:
            _raise_workspace_error(exc)


def _reference_gemm(weight_layout):
    def call(x, weight, bias):
        check_matmul_args("gemm", x, weight, bias, weight_layout)
        return reference.linear(x, weight, bias, weight_layout)
    return call


def _reference_ag_gemm(group, weight_layout):
    def call(x_shard_m, weight, bias, return_gathered):
        return reference.ag_gemm(x_shard_m, weight, bias, group=group, weight_layout=weight_layout,
                                 return_gathered=return_gathered)
    return call


def _reference_gemm_rs(group, weight_layout):
    def call(x, weight, bias):
        return reference.gemm_rs(x, weight, bias, group=group, weight_layout=weight_layout)
    return call


def _decide(key, make):
    call = make()
    with _lock:
        return _decisions.setdefault(key, call)


def gemm_call(x: torch.Tensor, weight: torch.Tensor, weight_layout: str, backend: str | None):
    """The callable ``(x, weight, bias) -> out`` that ``ops.gemm`` runs for these arguments."""
    key = ("gemm", x.shape, weight.shape, x.dtype, x.get_device(), weight_layout, backend, _capturing(x, backend))
    call = _decisions.get(key)
    if call is not None:
        return call

    def make():
        m, k, n = check_matmul_args("gemm", x, weight, None, weight_layout)
        if choose("gemm", device=x.device, dtype=x.dtype, mkn=(m, k, n), group=None, backend=backend).path == "fused":
            return _FusedGemm(x, weight, weight_layout)
        return _reference_gemm(weight_layout)
    return _decide(key, make)


def ag_gemm_call(x_shard_m: torch.Tensor, weight: torch.Tensor, group, weight_layout: str, backend: str | None):
    """The callable ``(x_shard_m, weight, bias, return_gathered)`` that ``ops.ag_gemm`` runs for these arguments."""
    key = ("ag_gemm", group, x_shard_m.shape, weight.shape, x_shard_m.dtype, x_shard_m.get_device(), weight_layout,
           backend, _capturing(x_shard_m, backend))
    call = _decisions.get(key)
    if call is not None:
        return call

    def make():
        rows, k, n = check_matmul_args("ag_gemm", x_shard_m, weight, None, weight_layout)
        tp = _tp(group)
        if tp == 1:
            gemm = gemm_call(x_shard_m, weight, weight_layout, backend)
            return lambda x, w, b, return_gathered: (gemm(x, w, b), x) if return_gathered else gemm(x, w, b)
        path = choose("ag_gemm", device=x_shard_m.device, dtype=x_shard_m.dtype, mkn=(rows * tp, k, n), group=group,
                      backend=backend).path
        if path == "fused":
            from flux_layers.ops.backend import ag_transport
            fused = _FusedAgGemmNccl if ag_transport(group) == "nccl" else _FusedAgGemm
            return fused(x_shard_m, weight, group, weight_layout)
        return _reference_ag_gemm(group, weight_layout)
    return _decide(key, make)


def gemm_rs_call(x: torch.Tensor, weight: torch.Tensor, group, weight_layout: str, backend: str | None):
    """The callable ``(x, weight, bias) -> out`` that ``ops.gemm_rs`` runs for these arguments."""
    key = ("gemm_rs", group, x.shape, weight.shape, x.dtype, x.get_device(), weight_layout, backend,
           _capturing(x, backend))
    call = _decisions.get(key)
    if call is not None:
        return call

    def make():
        m, k, n = check_matmul_args("gemm_rs", x, weight, None, weight_layout)
        if _tp(group) == 1:
            return gemm_call(x, weight, weight_layout, backend)
        path = choose("gemm_rs", device=x.device, dtype=x.dtype, mkn=(m, k, n), group=group, backend=backend).path
        if path == "fused":
            from flux_layers.ops.backend import transport
            fused = _FusedGemmRsNccl if transport("gemm_rs", group) == "nccl" else _FusedGemmRs
            return fused(x, weight, group, weight_layout)
        return _reference_gemm_rs(group, weight_layout)
    return _decide(key, make)


# ---- FP8 operands (flux_layers/ops/fp8.py): calls keyed by both operand dtypes and the accumulation as well; the
# scales are per-call tensors (their modes are checked per call, they do not change the decision).
def _fp8_key(op, x, weight, group, weight_layout, fast_accum, backend):
    return (op + "_fp8", group, x.shape, weight.shape, x.dtype, weight.dtype, x.get_device(), weight_layout,
            bool(fast_accum), backend, _capturing(x, backend))


def fp8_gemm_call(x, weight, weight_layout: str, fast_accum: bool, backend: str | None):
    """The callable ``(x, weight, bias, x_scale, w_scale) -> out`` that ``ops.gemm`` runs for FP8 operands."""
    key = _fp8_key("gemm", x, weight, None, weight_layout, fast_accum, backend)
    call = _decisions.get(key)
    if call is not None:
        return call

    def make():
        m, k, n = check_matmul_args("gemm", x, weight, None, weight_layout)
        if choose("gemm", device=x.device, dtype=x.dtype, mkn=(m, k, n), group=None, backend=backend).path == "fused":
            fused = _FusedGemm(x, weight, weight_layout, fast_accum)
            return lambda x, w, b, xs, ws: fused(x, w, b, *_checked_scales(x, w, b, xs, ws, weight_layout))
        return lambda x, w, b, xs, ws: reference.gemm(x, w, b, weight_layout=weight_layout, x_scale=xs, w_scale=ws,
                                                      fast_accum=fast_accum)
    return _decide(key, make)


def _checked_scales(x, weight, bias, x_scale, w_scale, weight_layout):
    from flux_layers.ops.fp8 import check_fp8_args
    check_fp8_args("gemm", x, weight, bias, x_scale, w_scale, weight_layout, weight.shape[0])
    return x_scale, w_scale


def fp8_ag_gemm_call(x_shard_m, weight, group, weight_layout: str, fast_accum: bool, backend: str | None):
    """The callable ``(x_shard_m, weight, bias, x_scale, w_scale, return_gathered)`` of ``ops.ag_gemm`` with FP8
    operands (the reference path: the fused FP8 all-gather is not built yet)."""
    key = _fp8_key("ag_gemm", x_shard_m, weight, group, weight_layout, fast_accum, backend)
    call = _decisions.get(key)
    if call is not None:
        return call

    def make():
        rows, k, n = check_matmul_args("ag_gemm", x_shard_m, weight, None, weight_layout)
        if _tp(group) == 1:
            from flux_layers.ops.fp8 import ScaledTensor
            gemm = fp8_gemm_call(x_shard_m, weight, weight_layout, fast_accum, backend)

            def local(x, w, b, xs, ws, return_gathered):
                out = gemm(x, w, b, xs, ws)
                return (out, ScaledTensor(x, xs.reshape(1) if xs.numel() == 1 else xs)) if return_gathered else out
            return local
        choose("ag_gemm", device=x_shard_m.device, dtype=x_shard_m.dtype, mkn=(rows * _tp(group), k, n),
               group=group, backend=backend)  # raises where the fused path is requested and cannot run
        return lambda x, w, b, xs, ws, return_gathered: reference.ag_gemm(
            x, w, b, group=group, weight_layout=weight_layout, return_gathered=return_gathered, x_scale=xs,
            w_scale=ws, fast_accum=fast_accum)
    return _decide(key, make)


def fp8_gemm_rs_call(x, weight, group, weight_layout: str, fast_accum: bool, backend: str | None):
    """The callable ``(x, weight, bias, x_scale, w_scale) -> out`` of ``ops.gemm_rs`` with FP8 operands (the
    reference path: the fused FP8 reduce-scatter is not built yet)."""
    key = _fp8_key("gemm_rs", x, weight, group, weight_layout, fast_accum, backend)
    call = _decisions.get(key)
    if call is not None:
        return call

    def make():
        m, k, n = check_matmul_args("gemm_rs", x, weight, None, weight_layout)
        if _tp(group) == 1:
            return fp8_gemm_call(x, weight, weight_layout, fast_accum, backend)
        choose("gemm_rs", device=x.device, dtype=x.dtype, mkn=(m, k, n), group=group, backend=backend)
        return lambda x, w, b, xs, ws: reference.gemm_rs(x, w, b, group=group, weight_layout=weight_layout,
                                                         x_scale=xs, w_scale=ws, fast_accum=fast_accum)
    return _decide(key, make)
