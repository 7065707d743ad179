"""Fused AllGather + GEMM (column-parallel forward; row-parallel dgrad with weight_layout='nn').

| tensor | shape (this rank) | note |
|---|---|---|
| x_shard_m | [M/tp, K] | this rank's rows (sequence shard) |
| weight | [N, K] ('nt') or [K, N] ('nn') | N is this rank's output shard for a column-parallel layer |
| out | [M, N] | all_gather(x) @ op(weight) + bias |
| gathered (optional) | [M, K] | the gathered input, copied out under the GEMM's tail |

The copy engines move the peers' shards in chunks (csrc/runtime/ag_gemm.cpp), each chunk followed by a flag
(epoch-valued; under CUDA-graph capture, the workspace's twin with the reset protocol, runtime/workspace.py); the
persistent GEMM starts on its own shard at once and, per tile, waits on the flag of the chunk its A tile reads. Direction (pull/push) from FLUX_LAYERS_AG_MODE, order (mesh/ring) from the topology or
FLUX_LAYERS_AG_ORDER, chunk rows from FLUX_LAYERS_CHUNK_ROWS or schedules.default_rows_per_chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers import _env, _library
from flux_layers.ops._checks import check_fused_tensor, check_matmul_args
from flux_layers.runtime import schedules, tuning, workspace

_MODES = {"pull": 0, "push": 1}
_ORDERS = {"mesh": 0, "ring": 1}


def _rows_per_chunk(ws: workspace.AgWorkspace, rows_per_shard: int, k: int, elem: int) -> int:
    forced = _env.get_int("CHUNK_ROWS")
    rows = forced if forced > 0 else schedules.default_rows_per_chunk(rows_per_shard, k * elem, ws.tp)
    # The workspace holds chunk_capacity flags per shard: coarsen the chunks if a forced size needs more.
    while schedules.chunk_count(rows_per_shard, rows) > ws.chunk_capacity:
        rows *= 2
    return rows


@torch.library.custom_op("flux::ag_gemm", mutates_args=())
def _ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int,
             weight_nn: bool, return_gathered: bool, tile: int, swizzle: int, stream_k_fill: int, sm_count: int,
             mode: str, order: str, rows_per_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    ws = workspace.lookup(handle)
    epoch = ws.next_epoch()
    m = x_shard_m.shape[0] * ws.tp
    n = weight.shape[1] if weight_nn else weight.shape[0]
    out = x_shard_m.new_empty((m, n))
    gathered = x_shard_m.new_empty((m, x_shard_m.shape[1]) if return_gathered else (0, x_shard_m.shape[1]))
    if _env.get("POISON_OUTPUTS") == "1":
        out.fill_(float("nan"))
        gathered.fill_(float("nan"))
    _launch(ws, x_shard_m, weight, bias, out, gathered if return_gathered else None, epoch=epoch,
            weight_nn=weight_nn, tile=tile, swizzle=swizzle, stream_k_fill=stream_k_fill, sm_count=sm_count, mode=mode,
            order=order, rows_per_chunk=rows_per_chunk, run_gemm=True)
    return out, gathered


def _launch(ws, x_shard_m, weight, bias, out, gathered, *, epoch, weight_nn, tile, swizzle, stream_k_fill, sm_count,
            mode, order, rows_per_chunk, run_gemm):
    torch.ops.flux_layers.ag_gemm(
        x_shard_m, weight, bias, out, gathered, ws.data_ptrs, ws.flag_ptrs, ws.chunk_capacity, rows_per_chunk,
        ws.rank, _MODES[mode], _ORDERS[order], epoch, ws.timeout_ns, ws.error_record.data_ptr(),
        ws.error_claim.data_ptr(), [s.cuda_stream for s in ws.comm_streams], weight_nn, tile, sm_count, swizzle,
        stream_k_fill, run_gemm, ws.graph_protocol)


@_ag_gemm.register_fake
def _(x_shard_m, weight, bias, handle, weight_nn, return_gathered, tile, swizzle, stream_k_fill, sm_count, mode, order,
      rows_per_chunk):
    tp = workspace.lookup(handle).tp
    m = x_shard_m.shape[0] * tp
    n = weight.shape[1] if weight_nn else weight.shape[0]
    k = x_shard_m.shape[1]
    return x_shard_m.new_empty((m, n)), x_shard_m.new_empty((m, k) if return_gathered else (0, k))


def ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", return_gathered: bool = False,
            ws: workspace.AgWorkspace | None = None, tile: int | None = None, swizzle: int | None = None,
            stream_k: bool | int | None = None, sm_count: int = 0):
    """See the module docstring. ``tile``/``swizzle``: kernel configuration (None: tuning table or the measured
    default); ``stream_k``: split a last, partial wave of tiles along K (None:
    FLUX_LAYERS_STREAM_K; an int: the fill limit, see tuning.stream_k_fill);
    ``sm_count``: SMs the persistent GEMM may hold (0: all)."""
    _library.require()
    rows, k, n = check_matmul_args("ag_gemm", x_shard_m, weight, bias, weight_layout)
    for what, t in (("x_shard_m", x_shard_m), ("weight", weight)):
        check_fused_tensor("ag_gemm", what, t)
    tp = dist.get_world_size(group)
    m = rows * tp
    if ws is None:
        ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k)
    elif m > ws.max_m or ws.k != k or ws.dtype != x_shard_m.dtype:
        raise ValueError(f"ag_gemm: call needs M={m}, K={k}, {x_shard_m.dtype}; the workspace holds "
                         f"max_m={ws.max_m}, K={ws.k}, {ws.dtype}")
    ws = workspace.for_current_stream(ws)
    kc = tuning.resolve_kernel("ag_gemm", dtype=x_shard_m.dtype, tp=tp, mkn=(m, k, n), tile=tile, swizzle=swizzle,
                               stream_k=stream_k, sm_count=sm_count)
    rows_per_chunk = _rows_per_chunk(ws, rows, k, x_shard_m.element_size())
    out, gathered = _ag_gemm(x_shard_m, weight, bias, workspace.register(ws), weight_layout == "nn",
                             return_gathered, kc.tile, kc.swizzle, kc.stream_k_fill, kc.sm_count, _env.get("AG_MODE"),
                             ws.order, rows_per_chunk)
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
    ws = workspace.for_current_stream(ws)
    epoch = ws.next_epoch()
    dummy_w = x_shard_m.new_empty((8, k))
    dummy_out = x_shard_m.new_empty((m, 8))
    _launch(ws, x_shard_m, dummy_w, None, dummy_out, None, epoch=epoch, weight_nn=False, tile=0, swizzle=0,
            stream_k_fill=0, sm_count=0, mode=_env.get("AG_MODE"), order=ws.order,
            rows_per_chunk=_rows_per_chunk(ws, rows, k, x_shard_m.element_size()), run_gemm=False)
    # The op leaves our own rows in the buffer only in pull mode; the view is for timing, not for reading.
    return ws.buffer[:m]
