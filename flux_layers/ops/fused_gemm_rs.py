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
bf16 data); the sum is accumulated in fp32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flux_layers import _env, _library
from flux_layers.ops._checks import check_fused_tensor, check_matmul_args
from flux_layers.runtime import tuning, workspace


@torch.library.custom_op("flux::gemm_rs", mutates_args=())
def _gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int, weight_nn: bool,
             tile: int, swizzle: int, stream_k_fill: int, sm_count: int, copy_engine: bool,
             chunk_cols: int) -> torch.Tensor:
    ws = workspace.lookup(handle)
    epoch = ws.next_epoch()
    n = weight.shape[1] if weight_nn else weight.shape[0]
    out = x.new_empty((x.shape[0] // ws.tp, n))
    if _env.get("POISON_OUTPUTS") == "1":
        out.fill_(float("nan"))
    torch.ops.flux_layers.gemm_rs(
        x, weight, bias, out, ws.data_ptrs, ws.slot_rows, ws.flag_ptrs, ws.flags_per_source, ws.rank, epoch,
        ws.timeout_ns, ws.error_record.data_ptr(), ws.error_claim.data_ptr(), weight_nn, tile, sm_count, swizzle,
        stream_k_fill, ws.stage_buffer().data_ptr() if copy_engine else 0, chunk_cols,
        [s.cuda_stream for s in ws.comm_streams], ws.graph_protocol)
    return out


@_gemm_rs.register_fake
def _(x, weight, bias, handle, weight_nn, tile, swizzle, stream_k_fill, sm_count, copy_engine, chunk_cols):
    tp = workspace.lookup(handle).tp
    n = weight.shape[1] if weight_nn else weight.shape[0]
    return x.new_empty((x.shape[0] // tp, n))


def gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", ws: workspace.RsWorkspace | None = None,
            tile: int | None = None, swizzle: int | None = None, stream_k: bool | int | None = None,
            sm_count: int = 0, transport: str | None = None, chunk_cols: int | None = None) -> torch.Tensor:
    """See the module docstring. ``tile``/``swizzle``: kernel configuration (None: tuning table or the measured
    default); ``stream_k``: split a last, partial wave of tiles along K (None:
    FLUX_LAYERS_STREAM_K; an int: the fill limit, see tuning.stream_k_fill);
    ``sm_count``: SMs the persistent GEMM may hold (0: all); ``transport``: ``'direct'``, ``'copy_engine'`` or
    ``'auto'`` (the tuning table's choice; None: FLUX_LAYERS_RS_TRANSPORT); ``chunk_cols``: columns per
    copy-engine chunk (None: FLUX_LAYERS_RS_CHUNK_COLS; 0: 1024). Every rank must pass the same transport."""
    if transport is not None:
        tuning.check_rs_transport(transport)  # before anything else, so that bad arguments fail anywhere
    chunk_cols = _env.get_int("RS_CHUNK_COLS") if chunk_cols is None else chunk_cols
    if chunk_cols < 0:
        raise ValueError(f"gemm_rs: chunk_cols must be >= 0 (0: default), got {chunk_cols}")
    _library.require()
    m, k, n = check_matmul_args("gemm_rs", x, weight, bias, weight_layout)
    for what, t in (("x", x), ("weight", weight)):
        check_fused_tensor("gemm_rs", what, t)
    tp = dist.get_world_size(group)
    if m % tp != 0:
        raise ValueError(f"gemm_rs: M={m} rows are not divisible by the group size {tp}")
    if ws is None:
        ws = workspace.get_rs_workspace(group, x.dtype, m, n)
    elif m > ws.max_m or ws.n != n or ws.dtype != x.dtype:
        raise ValueError(f"gemm_rs: call needs M={m}, N={n}, {x.dtype}; the workspace holds "
                         f"max_m={ws.max_m}, N={ws.n}, {ws.dtype}")
    ws = workspace.for_current_stream(ws)
    transport = tuning.rs_transport(dtype=x.dtype, tp=tp, mkn=(m, k, n), requested=transport)
    kc = tuning.resolve_kernel("gemm_rs", dtype=x.dtype, tp=tp, mkn=(m, k, n), tile=tile, swizzle=swizzle,
                               stream_k=stream_k, sm_count=sm_count)
    return _gemm_rs(x, weight, bias, workspace.register(ws), weight_layout == "nn", kc.tile, kc.swizzle,
                    kc.stream_k_fill, kc.sm_count, transport == "copy_engine", chunk_cols)
