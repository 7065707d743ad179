"""Fused GEMM + ReduceScatter (row-parallel forward; column-parallel dgrad with weight_layout='nn').

| tensor | shape (this rank) | note |
|---|---|---|
| x | [M, K] | K is this rank's shard of the reduction dimension |
| weight | [N, K] ('nt') or [K, N] ('nn') | |
| out | [M/tp, N] | rows [rank*M/tp, (rank+1)*M/tp) of sum_r x_r @ op(weight_r), + bias once |

Each tile of a peer's rows reaches that peer's receive slot and is flagged there; tiles of this rank's rows
come last and add the peers' partials in rank order (deterministic), see csrc/runtime/gemm_rs.cpp. Two
transports: ``direct``, the GEMM epilogue stores the tile into the peer's memory over NVLink; ``copy_engine``,
the epilogue stores it locally and a copy engine moves each finished chunk (a panel of tiles x a strip of
columns), so the SMs never wait on NVLink. Partials travel in the input dtype (as with NCCL's reduce-scatter of
bf16 data); the sum is accumulated in fp32. Kernel configuration and transport are fixed in a call plan
registered with the workspace (:func:`plan_call`); :func:`run` makes the call.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers import _env, _library
from flux_layers.ops._checks import check_fused_dims, check_fused_tensor, check_matmul_args
from flux_layers.runtime import tuning, workspace


def check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str,
               group) -> tuple[int, int, int]:
    """The fused path's checks of a call (the op library checks strides and alignment again per call); (M, K, N)."""
    _library.require()
    m, k, n = check_matmul_args("gemm_rs", x, weight, bias, weight_layout)
    check_fused_dims("gemm_rs", k, n)
    for what, t in (("x", x), ("weight", weight)):
        check_fused_tensor("gemm_rs", what, t)
    tp = dist.get_world_size(group)
    if m % tp != 0:
        raise ValueError(f"gemm_rs: M={m} rows are not divisible by the group size {tp}")
    return m, k, n


def plan_call(ws: workspace.RsWorkspace, *, m: int, k: int, n: int, tile: int | None = None,
              swizzle: int | None = None, stream_k: bool | int | None = None, sm_count: int = 0,
              transport: str | None = None, chunk_cols: int | None = None) -> int:
    """The index of the call plan for an [M, K] x [K, N] call on ``ws`` (registered once per distinct plan).
    Every rank resolves the same transport (same shape, same table), as both sides of a transfer must agree."""
    chunk_cols = _env.get_int("RS_CHUNK_COLS") if chunk_cols is None else chunk_cols
    if chunk_cols < 0:
        raise ValueError(f"gemm_rs: chunk_cols must be >= 0 (0: default), got {chunk_cols}")
    transport = tuning.rs_transport(dtype=ws.dtype, tp=ws.tp, mkn=(m, k, n), requested=transport)
    kc = tuning.resolve_kernel("gemm_rs", dtype=ws.dtype, tp=ws.tp, mkn=(m, k, n), tile=tile, swizzle=swizzle,
                               stream_k=stream_k, sm_count=sm_count)
    copy_engine = transport == "copy_engine"
    if copy_engine:
        ws.stage_buffer()
    return ws.plan_index((kc.tile, kc.swizzle, kc.stream_k_fill, kc.sm_count, 0, 0, 0, copy_engine, chunk_cols,
                          ()))


def run(ws: workspace.RsWorkspace, plan: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        weight_nn: bool) -> torch.Tensor:
    """One call of the op library's gemm_rs; the op checks the tensors against the workspace before anything is
    enqueued."""
    try:
        return torch.ops.flux_layers.gemm_rs(x, weight, bias, ws.handle, plan, weight_nn)
    except RuntimeError as exc:
        failed = workspace.workspace_error(exc)
        if failed is None:
            raise
        raise failed from None


def gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", ws: workspace.RsWorkspace | None = None,
            tile: int | None = None, swizzle: int | None = None, stream_k: bool | int | None = None,
            sm_count: int = 0, transport: str | None = None, chunk_cols: int | None = None) -> torch.Tensor:
    """See the module docstring: the fused op with every choice open (tests, benchmarks); ``ops.gemm_rs`` is the
    same call decided once per shape. ``tile``/``swizzle``: kernel configuration (None: tuning table or the
    measured default); ``stream_k``: split a last, partial wave of tiles along K (None: FLUX_LAYERS_STREAM_K; an
    int: the fill limit, see tuning.stream_k_fill); ``sm_count``: SMs the persistent GEMM may hold (0: all);
    ``transport``: ``'direct'``, ``'copy_engine'`` or ``'auto'`` (the tuning table's choice; None:
    FLUX_LAYERS_RS_TRANSPORT); ``chunk_cols``: columns per copy-engine chunk (None: FLUX_LAYERS_RS_CHUNK_COLS; 0:
    1024). Every rank must pass the same transport."""
    if transport is not None:
        tuning.check_rs_transport(transport)  # before anything else, so that bad arguments fail anywhere
    if chunk_cols is not None and chunk_cols < 0:
        raise ValueError(f"gemm_rs: chunk_cols must be >= 0 (0: default), got {chunk_cols}")
    m, k, n = check_args(x, weight, bias, weight_layout, group)
    if ws is None:
        ws = workspace.get_rs_workspace(group, x.dtype, m, n)
    elif not isinstance(ws, workspace.RsWorkspace):
        raise TypeError(f"gemm_rs: ws must be an RsWorkspace or None, got {type(ws).__name__}")
    elif m > ws.max_m or ws.n != n or ws.dtype != x.dtype:
        raise ValueError(f"gemm_rs: call needs M={m}, N={n}, {x.dtype}; the workspace holds "
                         f"max_m={ws.max_m}, N={ws.n}, {ws.dtype}")
    plan = plan_call(ws, m=m, k=k, n=n, tile=tile, swizzle=swizzle, stream_k=stream_k, sm_count=sm_count,
                     transport=transport, chunk_cols=chunk_cols)
    return run(ws, plan, x, weight, bias, weight_layout == "nn")
