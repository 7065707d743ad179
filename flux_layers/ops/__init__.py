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
:mod:`flux_layers.ops.backend`. ``plan()`` says which path a call with those arguments would take. Each distinct
call (shapes, dtype, layout, group, backend) is decided once and the decision kept (:mod:`flux_layers.ops._dispatch`),
so a repeated call costs a dict lookup and the op; ``refresh_settings()`` makes changed settings count. Under
torch.compile each call is one opaque graph node (:mod:`flux_layers.ops._traceable`), dispatch included.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers.ops import _dispatch, _traceable, reference
from flux_layers.ops._checks import check_matmul_args
from flux_layers.ops.backend import Choice, choose
from flux_layers.ops.fp8 import FP8_DTYPES, ScaledTensor

__all__ = ["gemm", "ag_gemm", "gemm_rs", "plan", "refresh_settings", "Choice", "ScaledTensor", "reference"]


def _tp(group) -> int:
    if group is None:
        return 1
    return group.size() if torch.compiler.is_compiling() else dist.get_world_size(group)


def plan(op: str, x: torch.Tensor, weight: torch.Tensor, *, group=None, weight_layout: str = "nt",
         backend: str | None = None) -> Choice:
    """Which path ``op`` ('gemm', 'ag_gemm', 'gemm_rs') would take for these arguments, and why."""
    from flux_layers.runtime import tuning
    rows, k, n = check_matmul_args(op, x, weight, None, weight_layout)
    return choose(op, device=x.device, dtype=x.dtype, mkn=tuning.table_key(op, rows, k, n, _tp(group)), group=group,
                  backend=backend)


def _fp8_call(x, weight, x_scale, w_scale) -> bool:
    return x_scale is not None or w_scale is not None or x.dtype in FP8_DTYPES or weight.dtype in FP8_DTYPES


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_layout: str = "nt",
         x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None, fast_accum: bool = False,
         backend: str | None = None) -> torch.Tensor:
    if _fp8_call(x, weight, x_scale, w_scale):
        if torch.compiler.is_compiling():
            return _traceable.op_gemm_fp8(x, weight, bias, x_scale, w_scale, weight_layout, fast_accum, backend)
        return _dispatch.fp8_gemm_call(x, weight, weight_layout, fast_accum, backend)(x, weight, bias, x_scale,
                                                                                      w_scale)
    if torch.compiler.is_compiling():
        return _traceable.op_gemm(x, weight, bias, weight_layout, backend)
    return _dispatch.gemm_call(x, weight, weight_layout, backend)(x, weight, bias)


def ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", return_gathered: bool = False, x_scale: torch.Tensor | None = None,
            w_scale: torch.Tensor | None = None, fast_accum: bool = False, backend: str | None = None):
    if _fp8_call(x_shard_m, weight, x_scale, w_scale):
        if torch.compiler.is_compiling():
            out, data, scale = _traceable.op_ag_gemm_fp8(x_shard_m, weight, bias, x_scale, w_scale,
                                                         group.group_name if group is not None else "",
                                                         weight_layout, return_gathered, fast_accum, backend)
            return (out, ScaledTensor(data, scale)) if return_gathered else out
        call = _dispatch.fp8_ag_gemm_call(x_shard_m, weight, group, weight_layout, fast_accum, backend)
        return call(x_shard_m, weight, bias, x_scale, w_scale, return_gathered)
    if torch.compiler.is_compiling():
        if _tp(group) == 1:
            out = gemm(x_shard_m, weight, bias, weight_layout=weight_layout, backend=backend)
            return (out, x_shard_m) if return_gathered else out
        out, gathered = _traceable.op_ag_gemm(x_shard_m, weight, bias, group.group_name, weight_layout,
                                              return_gathered, backend)
        return (out, gathered) if return_gathered else out
    call = _dispatch.ag_gemm_call(x_shard_m, weight, group, weight_layout, backend)
    return call(x_shard_m, weight, bias, return_gathered)


def gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
            fast_accum: bool = False, backend: str | None = None) -> torch.Tensor:
    if _fp8_call(x, weight, x_scale, w_scale):
        if torch.compiler.is_compiling():
            return _traceable.op_gemm_rs_fp8(x, weight, bias, x_scale, w_scale,
                                             group.group_name if group is not None else "", weight_layout,
                                             fast_accum, backend)
        return _dispatch.fp8_gemm_rs_call(x, weight, group, weight_layout, fast_accum, backend)(x, weight, bias,
                                                                                               x_scale, w_scale)
    if torch.compiler.is_compiling():
        if _tp(group) == 1:
            return gemm(x, weight, bias, weight_layout=weight_layout, backend=backend)
        return _traceable.op_gemm_rs(x, weight, bias, group.group_name, weight_layout, backend)
    return _dispatch.gemm_rs_call(x, weight, group, weight_layout, backend)(x, weight, bias)


def refresh_settings() -> None:
    """Make the next calls read the ``FLUX_LAYERS_*`` settings and the tuning table again (each distinct call is
    otherwise decided once, when first made; see :mod:`flux_layers.ops._dispatch`). Workspaces keep the settings
    they were made with (FLUX_LAYERS_TIMEOUT_S, FLUX_LAYERS_POISON_OUTPUTS)."""
    _dispatch.refresh()
