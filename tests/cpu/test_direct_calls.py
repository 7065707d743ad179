"""The fused ops' direct calls from Python (csrc/bindings/fastcall.cpp, flux_layers/ops/_opcalls.py), on the CPU: they
take only plain tensors outside torch-function and dispatch modes, none that autograd would record (NotImplemented
otherwise, and the callers then make the registered op's call), check their arguments as the op does, and can be
switched off. Needs the built op library
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

pytestmark = pytest.mark.skipif(not _library.load(), reason="the op library is not built")


def _direct():
    direct = _library.direct_calls()
    assert direct is not None, _library.direct_calls_unavailable_reason()
    return direct


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


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
        _direct().gemm_rs(x, w, None, 0, 0, False)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        _direct().ag_gemm(x, torch.nn.Parameter(w, requires_grad=False), x[0], 0, 0, False, False, True)
    with pytest.raises(ValueError, match="must be bfloat16, float16, float8_e4m3fn or float8_e5m2"):
        _direct().gemm_rs(x.float(), w.float(), None, 0, 0, False)


def test_argument_count_and_types():
    x = _bf16(8, 16)
    with pytest.raises(TypeError, match="ag_gemm takes 8 positional arguments, got 2"):
        _direct().ag_gemm(x, x)
    with pytest.raises(TypeError, match="gemm_rs takes 6 positional arguments, got 7"):
        _direct().gemm_rs(x, x, None, 0, 0, False, 1)
    with pytest.raises(TypeError):
        _direct().gemm_rs(x, x, None, "workspace", 0, False)


@pytest.mark.parametrize("where", ["x", "weight", "bias", "not_a_tensor"])
def test_anything_but_plain_tensors_is_not_taken(where):
    x, w, b = _bf16(8, 16), _bf16(16, 16), _bf16(16)
    args = {"x": x, "weight": w, "bias": b}
    args[where if where != "not_a_tensor" else "bias"] = (
        args[where].as_subclass(_Subclass) if where != "not_a_tensor" else 1.5)
    assert _direct().gemm_rs(args["x"], args["weight"], args["bias"], 0, 0, False) is NotImplemented
    assert _direct().ag_gemm(args["x"], args["weight"], args["bias"], 0, 0, False, False, True) is NotImplemented


@pytest.mark.parametrize("mode", [_PassThroughFunctionMode, _PassThroughDispatchMode])
def test_modes_are_left_to_the_registered_op(mode):
    x, w = _bf16(8, 16), _bf16(16, 16)
    with mode():
        assert _direct().gemm_rs(x, w, None, 0, 0, False) is NotImplemented
        assert _direct().ag_gemm(x, w, None, 0, 0, False, False, True) is NotImplemented


def test_inputs_that_autograd_would_record_are_left_to_the_registered_op():
    x, w = _bf16(8, 16), _bf16(16, 16)
    for which in ("x", "weight"):
        args = {"x": x, "weight": w}
        args[which] = torch.nn.Parameter(args[which])  # requires grad
        assert _direct().gemm_rs(args["x"], args["weight"], None, 0, 0, False) is NotImplemented
        with torch.no_grad():  # as the layers' autograd.Functions call the ops
            with pytest.raises(ValueError, match="must be a CUDA tensor"):
                _direct().gemm_rs(args["x"], args["weight"], None, 0, 0, False)
    assert _direct().ag_gemm(x, w, torch.nn.Parameter(_bf16(16)), 0, 0, False, False, True) is NotImplemented


def test_callers_fall_back_to_the_registered_op():
    # A subclass is not taken directly: the registered op runs, and with CPU tensors it has no kernel to run.
    x, w = _bf16(8, 16).as_subclass(_Subclass), _bf16(16, 16)
    with pytest.raises(NotImplementedError, match="flux_layers::gemm_rs"):
        _opcalls.gemm_rs()(x, w, None, 0, 0, False)
    # Plain tensors are taken directly: the op's own check answers.
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        _opcalls.ag_gemm()(x.as_subclass(torch.Tensor), w, None, 0, 0, False, False, True)


def test_direct_calls_can_be_switched_off():
    env = dict(os.environ, FLUX_LAYERS_DIRECT_CALLS="0")
    code = ("import torch, flux_layers._library as l; from flux_layers.ops import _opcalls; assert l.load(); "
            "assert l.direct_calls() is None; print(l.direct_calls_unavailable_reason()); "
            "assert _opcalls.gemm_rs() is torch.ops.flux_layers.gemm_rs.default")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "FLUX_LAYERS_DIRECT_CALLS=0" in out
