"""The fused ops' direct calls from Python (csrc/bindings/fastcall.cpp, flux_layers/ops/_opcalls.py), on the CPU: they
take only plain tensors outside torch-function and dispatch modes, none that autograd would record (NotImplemented
otherwise, and the callers then make the registered op's call), check their arguments as the op does, raise the typed
failures as the registered op's callers do, and can be switched off. Their arguments come in the order a decision
binds them: (workspace, plan, weight_nn[, run_gemm], x, weight, bias[, return_gathered]). Needs the built op library
(it loads without a GPU); the GPU tests run the calls themselves."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from flux_layers import _library
from flux_layers.ops import _opcalls
from flux_layers.runtime.workspace import NoGraphTwin, WorkspaceError

pytestmark = pytest.mark.skipif(not _library.load(), reason="the op library is not built")


def _direct():
    direct = _library.direct_calls()
    assert direct is not None, _library.direct_calls_unavailable_reason()
    return direct


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


class _Workspace:  # what _opcalls reads of a workspace: no live one has handle 0
    handle, graph_twin, graph_protocol = 0, None, False


def _ag(x, w, b, return_gathered=False):
    return _direct().ag_gemm(0, 0, False, True, x, w, b, return_gathered)


def _rs(x, w, b):
    return _direct().gemm_rs(0, 0, False, x, w, b)


class _Subclass(torch.Tensor):
    pass


class _PassThroughFunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassThroughDispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_tensors_reach_the_ops_checks():
    x, w = _bf16(8, 16), _bf16(16, 16)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        _rs(x, w, None)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        _ag(x, torch.nn.Parameter(w, requires_grad=False), x[0])
    with pytest.raises(ValueError, match="must be bfloat16, float16, float8_e4m3fn or float8_e5m2"):
        _rs(x.float(), w.float(), None)


def test_argument_count_and_types():
    x = _bf16(8, 16)
    with pytest.raises(TypeError, match="ag_gemm takes 8 positional arguments, got 2"):
        _direct().ag_gemm(x, x)
    with pytest.raises(TypeError, match="gemm_rs takes 6 positional arguments, got 7"):
        _direct().gemm_rs(0, 0, False, x, x, None, 1)
    with pytest.raises(TypeError):
        _direct().gemm_rs("workspace", 0, False, x, x, None)


@pytest.mark.parametrize("where", ["x", "weight", "bias", "not_a_tensor"])
def test_anything_but_plain_tensors_is_not_taken(where):
    x, w, b = _bf16(8, 16), _bf16(16, 16), _bf16(16)
    args = {"x": x, "weight": w, "bias": b}
    args[where if where != "not_a_tensor" else "bias"] = (
        args[where].as_subclass(_Subclass) if where != "not_a_tensor" else 1.5)
    assert _rs(args["x"], args["weight"], args["bias"]) is NotImplemented
    assert _ag(args["x"], args["weight"], args["bias"]) is NotImplemented


@pytest.mark.parametrize("mode", [_PassThroughFunctionMode, _PassThroughDispatchMode])
def test_modes_are_left_to_the_registered_op(mode):
    x, w = _bf16(8, 16), _bf16(16, 16)
    with mode():
        assert _rs(x, w, None) is NotImplemented
        assert _ag(x, w, None) is NotImplemented


def test_inputs_that_autograd_would_record_are_left_to_the_registered_op():
    x, w = _bf16(8, 16), _bf16(16, 16)
    for which in ("x", "weight"):
        args = {"x": x, "weight": w}
        args[which] = torch.nn.Parameter(args[which])  # requires grad
        assert _rs(args["x"], args["weight"], None) is NotImplemented
        with torch.no_grad():  # as the layers' autograd.Functions call the ops
            with pytest.raises(ValueError, match="must be a CUDA tensor"):
                _rs(args["x"], args["weight"], None)
    assert _ag(x, w, torch.nn.Parameter(_bf16(16))) is NotImplemented


def test_callers_fall_back_to_the_registered_op():
    # A subclass is not taken directly: the registered op runs, and with CPU tensors it has no kernel to run.
    x, w = _bf16(8, 16).as_subclass(_Subclass), _bf16(16, 16)
    with pytest.raises(NotImplementedError, match="flux_layers::gemm_rs"):
        _opcalls.gemm_rs(_Workspace, 0, False)(x, w, None)
    # Plain tensors are taken directly: the op's own check answers.
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        _opcalls.ag_gemm(_Workspace, 0, False)(x.as_subclass(torch.Tensor), w, None, False)


@pytest.mark.parametrize("direct", [True, False])
def test_typed_failures_cross_as_their_python_types(direct):
    """A failed workspace raises WorkspaceError on either path (the registered op's DistError translated once, in
    _opcalls); a captured call without a CUDA-graph twin raises NoGraphTwin from the direct call, a RuntimeError from
    the registered op outside capture (as here)."""
    probe = (_direct().typed_error_probe if direct
             else _opcalls._typed(torch.ops.flux_layers.typed_error_probe.default, _Workspace))
    with pytest.raises(WorkspaceError, match="a failed workspace") as failed:
        probe("workspace_failed")
    assert "Exception raised from" not in str(failed.value)
    with pytest.raises(NoGraphTwin if direct else RuntimeError, match="no CUDA-graph twin") as twin:
        probe("no_graph_twin")
    assert direct or not isinstance(twin.value, (NoGraphTwin, WorkspaceError))
    with pytest.raises(ValueError, match="which must be"):
        probe("other")


def test_direct_calls_can_be_switched_off():
    env = dict(os.environ, FLUX_LAYERS_DIRECT_CALLS="0")
    code = ("import torch, flux_layers._library as l; from flux_layers.ops import _opcalls; assert l.load(); "
            "assert l.direct_calls() is None; print(l.direct_calls_unavailable_reason()); "
            "ws = type('W', (), {'handle': 0, 'graph_twin': None, 'graph_protocol': False}); "
            "assert _opcalls.gemm_rs(ws, 0, False).direct is None")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "FLUX_LAYERS_DIRECT_CALLS=0" in out
