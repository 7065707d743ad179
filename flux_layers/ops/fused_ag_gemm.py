"""Fused AllGather + GEMM (column-parallel forward; row-parallel dgrad with weight_layout='nn').

| tensor | shape (this rank) | note |
|---|---|---|
| x_shard_m | [M/tp, K] | this rank's rows (sequence shard) |
| weight | [N, K] ('nt') or [K, N] ('nn') | N is this rank's output shard for a column-parallel layer |
| out | [M, N] | all_gather(x) @ op(weight) + bias |
| gathered (optional) | [M, K] | the gathered input, copied out under the GEMM's tail |

The copy engines move the peers' shards in chunks (csrc/runtime/ag_gemm.cpp), each chunk followed by a flag
(epoch-valued; under CUDA-graph capture, the workspace's twin with the reset protocol, runtime/workspace.py); the
persistent GEMM starts on its own shard at once and, per tile, waits on the flag of the chunk its A tile reads.
Direction (pull/push) from ``mode`` or FLUX_LAYERS_AG_MODE, order (mesh/ring) from ``order``, the topology or
FLUX_LAYERS_AG_ORDER, chunk rows from ``chunk_rows``, FLUX_LAYERS_CHUNK_ROWS or schedules.default_rows_per_chunk.
These are fixed in a call plan registered with the workspace (:func:`plan_call`); :func:`run` makes the call.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers import _env, _library
from flux_layers.ops._checks import check_fused_tensor, check_matmul_args
from flux_layers.runtime import schedules, tuning, workspace

_MODES = {"pull": 0, "push": 1}
_ORDERS = {"mesh": 0, "ring": 1}


def _rows_per_chunk(ws: workspace.AgWorkspace, rows_per_shard: int, row_bytes: int, chunk_rows: int | None) -> int:
    forced = _env.get_int("CHUNK_ROWS") if chunk_rows is None else chunk_rows
    if forced < 0:
        raise ValueError(f"ag_gemm: chunk_rows must be >= 0 (0: per-shape heuristic), got {forced}")
    rows = forced if forced > 0 else schedules.default_rows_per_chunk(rows_per_shard, row_bytes, ws.tp)
    # The workspace holds chunk_capacity flags per shard: coarsen the chunks if a forced size needs more.
    while schedules.chunk_count(rows_per_shard, rows) > ws.chunk_capacity:
        rows *= 2
    return rows


def check_args(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str,
               group) -> tuple[int, int, int]:
    """The fused path's checks of a call (the op library checks strides and alignment again per call); returns
    (M, K, N) with M the gathered rows."""
    _library.require()
    rows, k, n = check_matmul_args("ag_gemm", x_shard_m, weight, bias, weight_layout)
    for what, t in (("x_shard_m", x_shard_m), ("weight", weight)):
        check_fused_tensor("ag_gemm", what, t)
    return rows * dist.get_world_size(group), k, n


def plan_call(ws: workspace.AgWorkspace, *, m: int, k: int, n: int, tile: int | None = None,
              swizzle: int | None = None, stream_k: bool | int | None = None, sm_count: int = 0,
              mode: str | None = None, order: str | None = None, chunk_rows: int | None = None) -> int:
    """The index of the call plan for an [M, K] x [K, N] call on ``ws`` (registered once per distinct plan):
    kernel configuration from the arguments or the tuning table, transfer direction, order and chunking."""
    mode = _env.get("AG_MODE") if mode is None else mode
    order = ws.order if order is None else order
    if mode not in _MODES:
        raise ValueError(f"ag_gemm: mode must be 'pull' or 'push', got {mode!r}")
    if order not in _ORDERS:
        raise ValueError(f"ag_gemm: order must be 'mesh' or 'ring', got {order!r}")
    kc = tuning.resolve_kernel("ag_gemm", dtype=ws.dtype, tp=ws.tp, mkn=(m, k, n), tile=tile, swizzle=swizzle,
                               stream_k=stream_k, sm_count=sm_count)
    elem = torch.tensor([], dtype=ws.dtype).element_size()
    rows_per_chunk = _rows_per_chunk(ws, m // ws.tp, k * elem, chunk_rows)
    return ws.plan_index((kc.tile, kc.swizzle, kc.stream_k_fill, kc.sm_count, _MODES[mode], _ORDERS[order],
                          rows_per_chunk, False, 0, ()))


def run(ws: workspace.AgWorkspace, plan: int, x_shard_m: torch.Tensor, weight: torch.Tensor,
        bias: torch.Tensor | None, weight_nn: bool, return_gathered: bool,
        run_gemm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the op library's ag_gemm: (out [M, N], gathered [M, K], or [0, K] unless ``return_gathered``).
    The op checks the tensors against the workspace before anything is enqueued."""
    try:
        return torch.ops.flux_layers.ag_gemm(x_shard_m, weight, bias, ws.handle, plan, weight_nn, return_gathered,
                                             run_gemm)
    except RuntimeError as exc:
        failed = workspace.workspace_error(exc)
        if failed is None:
            raise
        raise failed from None


def ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", return_gathered: bool = False,
            ws: workspace.AgWorkspace | None = None, tile: int | None = None, swizzle: int | None = None,
            stream_k: bool | int | None = None, sm_count: int = 0, mode: str | None = None,
            order: str | None = None, chunk_rows: int | None = None):
    """See the module docstring: the fused op with every choice open (tests, benchmarks); ``ops.ag_gemm`` is the
    same call decided once per shape. ``tile``/``swizzle``: kernel configuration (None: tuning table or the
    measured default); ``stream_k``: split a last, partial wave of tiles along K (None: FLUX_LAYERS_STREAM_K; an
    int: the fill limit, see tuning.stream_k_fill); ``sm_count``: SMs the persistent GEMM may hold (0: all);
    ``mode``, ``order``, ``chunk_rows``: the transfers (None: the settings)."""
    m, k, n = check_args(x_shard_m, weight, bias, weight_layout, group)
    if ws is None:
        ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k)
    elif m > ws.max_m or ws.k != k or ws.dtype != x_shard_m.dtype:
        raise ValueError(f"ag_gemm: call needs M={m}, K={k}, {x_shard_m.dtype}; the workspace holds "
                         f"max_m={ws.max_m}, K={ws.k}, {ws.dtype}")
    plan = plan_call(ws, m=m, k=k, n=n, tile=tile, swizzle=swizzle, stream_k=stream_k, sm_count=sm_count,
                     mode=mode, order=order, chunk_rows=chunk_rows)
    out, gathered = run(ws, plan, x_shard_m, weight, bias, weight_layout == "nn", return_gathered)
    return (out, gathered) if return_gathered else out


def copy_engine_all_gather(x_shard_m: torch.Tensor, *, group, ws: workspace.AgWorkspace | None = None
                           ) -> torch.Tensor:
    """The copy-engine all-gather alone (no GEMM): returns a view [M, K] of the workspace's gathered buffer,
    valid until the next call on that workspace. Used to time the transfers the fused op overlaps."""
    _library.require()
    check_fused_tensor("copy_engine_all_gather", "x_shard_m", x_shard_m)
    tp = dist.get_world_size(group)
    rows, k = x_shard_m.shape
    m = rows * tp
    if ws is None:
        ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k)
    plan = plan_call(ws, m=m, k=k, n=8, tile=0, swizzle=0, stream_k=False)
    run(ws, plan, x_shard_m, x_shard_m.new_empty((8, k)), None, False, False, run_gemm=False)
    # The op leaves our own rows in the buffer only in pull mode; the view is for timing, not for reading.
    return workspace.for_current_stream(ws).buffer[:m]
