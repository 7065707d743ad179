"""The op library's fused calls as Python callables: the direct call (csrc/bindings/fastcall.cpp, no torch op
dispatch) where it applies, the registered op where it does not (tensor subclasses, torch-function or dispatch modes,
inputs requiring grad under grad mode, FLUX_LAYERS_DIRECT_CALLS=0, a library without direct calls). Same arguments,
results and errors either way."""
from __future__ import annotations

import functools

import torch

from flux_layers import _library


def _with_fallback(direct, op):
    def call(*args):
        result = direct(*args)
        return op(*args) if result is NotImplemented else result
    return call


@functools.cache  # the library loads once per process, and with it whether direct calls exist
def ag_gemm():
    """``(x_shard_m, weight, bias, workspace, plan, weight_nn, return_gathered, run_gemm) -> (out, gathered)``."""
    op = torch.ops.flux_layers.ag_gemm.default
    direct = _library.direct_calls()
    return op if direct is None else _with_fallback(direct.ag_gemm, op)


@functools.cache
def gemm_rs():
    """``(x, weight, bias, workspace, plan, weight_nn) -> out``."""
    op = torch.ops.flux_layers.gemm_rs.default
    direct = _library.direct_calls()
    return op if direct is None else _with_fallback(direct.gemm_rs, op)
