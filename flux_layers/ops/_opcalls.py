"""The op library's fused calls as Python callables bound to a workspace's plan: the direct call
(csrc/bindings/fastcall.cpp, no torch op dispatch) where it applies, the registered op where it does not (tensor
subclasses, torch-function or dispatch modes, inputs requiring grad under grad mode, FLUX_LAYERS_DIRECT_CALLS=0, a
library without direct calls). Same arguments, results and errors either way; the registered op's DistError becomes
WorkspaceError here, the one place that translates it (the direct calls raise it themselves).

``ag_gemm(...)(x_shard_m, weight, bias, return_gathered)`` returns ``out``, or ``(out, gathered)`` if
``return_gathered``; ``gemm_rs(...)(x, weight, bias)`` returns ``out``.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from flux_layers import _library
from flux_layers.runtime.workspace import NoGraphTwin, WorkspaceError


class BoundCall:
    """One workspace's plan as a fused call: ``direct`` (a C function with the workspace and plan bound, which returns
    NotImplemented where it does not apply) and ``registered`` (the registered op's call, which always applies)."""
    __slots__ = ("direct", "registered")

    def __init__(self, direct, registered):
        self.direct, self.registered = direct, registered

    def __call__(self, *args):
        result = self.direct(*args) if self.direct is not None else NotImplemented
        return self.registered(*args) if result is NotImplemented else result


def _typed(call, ws):
    """The registered op's ``call`` raising the typed failures: WorkspaceError (torch raises the op's as DistError),
    and NoGraphTwin (a RuntimeError under CUDA-graph capture on a workspace without a twin: the only one the op raises
    before it enqueues anything there, besides ValueErrors)."""
    def typed(*args):
        try:
            return call(*args)
        except dist.DistError as exc:
            raise WorkspaceError(str(exc)) from None
        except RuntimeError as exc:
            if (ws.graph_twin is None and not ws.graph_protocol and torch.cuda.is_available()
                    and torch.cuda.is_current_stream_capturing()):
                raise NoGraphTwin(str(exc)) from None
            raise
    return typed


def ag_gemm(ws, plan: int, weight_nn: bool, run_gemm: bool = True) -> BoundCall:
    """``(x_shard_m, weight, bias, return_gathered)`` on ``ws`` with its registered plan ``plan``."""
    op = torch.ops.flux_layers.ag_gemm.default

    def registered(x_shard_m, weight, bias, return_gathered):
        out, gathered = op(x_shard_m, weight, bias, ws.handle, plan, weight_nn, return_gathered, run_gemm)
        return (out, gathered) if return_gathered else out
    direct = _library.direct_calls()
    bound = None if direct is None else functools.partial(direct.ag_gemm, ws.handle, plan, weight_nn, run_gemm)
    return BoundCall(bound, _typed(registered, ws))


def gemm_rs(ws, plan: int, weight_nn: bool) -> BoundCall:
    """``(x, weight, bias)`` on ``ws`` with its registered plan ``plan``."""
    op = torch.ops.flux_layers.gemm_rs.default

    def registered(x, weight, bias):
        return op(x, weight, bias, ws.handle, plan, weight_nn)
    direct = _library.direct_calls()
    bound = None if direct is None else functools.partial(direct.gemm_rs, ws.handle, plan, weight_nn)
    return BoundCall(bound, _typed(registered, ws))


def ag_gemm_fp8(ws, plan: int, weight_nn: bool, run_gemm: bool = True) -> BoundCall:
    """``(x_shard_m, weight, bias, x_scale, w_scale, return_gathered)`` with FP8 operands on ``ws`` (an FP8
    workspace): ``out``, or ``(out, ScaledTensor(gathered rows, their scales))``."""
    from flux_layers.ops.fp8 import ScaledTensor
    op = torch.ops.flux_layers.ag_gemm_fp8.default

    def registered(x_shard_m, weight, bias, x_scale, w_scale, return_gathered):
        out, data, scale = op(x_shard_m, weight, bias, x_scale, w_scale, ws.handle, plan, weight_nn,
                              return_gathered, run_gemm)
        return (out, ScaledTensor(data, scale)) if return_gathered else out
    direct = _library.direct_calls()
    bound = None
    if direct is not None:
        call = functools.partial(direct.ag_gemm_fp8, ws.handle, plan, weight_nn, run_gemm)

        def bound(x_shard_m, weight, bias, x_scale, w_scale, return_gathered):
            result = call(x_shard_m, weight, bias, x_scale, w_scale, return_gathered)
            if return_gathered and result is not NotImplemented:
                return result[0], ScaledTensor(result[1], result[2])
            return result
    return BoundCall(bound, _typed(registered, ws))


def gemm_rs_fp8(ws, plan: int, weight_nn: bool) -> BoundCall:
    """``(x, weight, bias, x_scale, w_scale)`` with FP8 operands on ``ws`` (a bfloat16 workspace)."""
    op = torch.ops.flux_layers.gemm_rs_fp8.default

    def registered(x, weight, bias, x_scale, w_scale):
        return op(x, weight, bias, x_scale, w_scale, ws.handle, plan, weight_nn)
    direct = _library.direct_calls()
    bound = None if direct is None else functools.partial(direct.gemm_rs_fp8, ws.handle, plan, weight_nn)
    return BoundCall(bound, _typed(registered, ws))


def end_external_call(ws, plan: int, epoch: int) -> None:
    """The end of ``ws``'s external-transfer call of ``plan`` and ``epoch`` (the NCCL and hybrid transports: the
    caller moves the chunks or partials): the words the op library writes once the call is done (its completion for
    the workspace's watchdog; a two-level reduce-scatter's slots freed at the node's peers), on the current stream.
    The caller enqueues it after its transfers joined that stream. Enqueued with the GEMM, it waits there for the GEMM
    to end; with it there, under one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), the transfers the GEMM waits for
    did not run until the GEMM gave up (emulated nodes), and with it here they do (docs/design.md section 7)."""
    ws.native.end_external_call(plan=plan, epoch=epoch)
