"""Fused GEMM + ReduceScatter (row-parallel forward; column-parallel dgrad with weight_layout='nn').

| tensor | shape (this rank) | note |
|---|---|---|
| x | [M, K] | K is this rank's shard of the reduction dimension |
| weight | [N, K] ('nt') or [K, N] ('nn') | |
| out | [M/tp, N] | rows [rank*M/tp, (rank+1)*M/tp) of sum_r x_r @ op(weight_r), + bias once |

Each tile of a peer's rows reaches that peer's receive slot and is flagged there; tiles of this rank's rows
come last and add the peers' partials in rank order (deterministic), see csrc/runtime/gemm_rs.cpp. Two
transports: ``epilogue``, the GEMM epilogue stores the tile into the peer's memory over NVLink; ``copy_engine``,
the epilogue stores it locally and a copy engine moves each finished chunk (a panel of tiles x a strip of
columns), so the SMs never wait on NVLink. Partials travel in the input dtype (as with NCCL's reduce-scatter of
bf16 data); the sum is accumulated in fp32. Kernel configuration and transport are fixed in a call plan
(runtime/call_plan.py) registered with the workspace (:func:`plan_call`); :func:`run` makes the call.

Transport ``nccl`` (``transport='nccl'`` here, FLUX_LAYERS_TRANSPORT=nccl for ``ops.gemm_rs``): the workspace is
local memory, the kernel stages every peer's partial locally and counts it per full-width chunk as with the copy
engine, and the partials move by NCCL send/recv driven from the host on the workspace's transfer stream, each
received chunk followed by its flag; the GEMM runs on all SMs but FLUX_LAYERS_NCCL_SMS
(flux_layers/runtime/multinode/nccl_rs_transport.py; :func:`plan_nccl_call`, :func:`run_nccl`). Not under CUDA-graph
capture. It has not run over NCCL yet (tests/gpu/test_nccl_transport_gpu.py is its check; on one GPU, emulated nodes
run it over the host-staged stand-in).

Transport ``hybrid`` (``transport='hybrid'``, FLUX_LAYERS_TRANSPORT=hybrid for a group over several nodes, nodes of
consecutive ranks): the two-level plan (csrc/include/flux/workspace_layout.h ``RsTwoLevel``, with
transfer_plan.build_rs_plan's inter-node part) on a workspace mapped inside the node. Inside the node the epilogue
stores each tile into its owner's slot (a block of this node) or into the slot of this node's collector of it (a
block of another node: the rank with the block's local index); the collector adds its node's partials of the blocks
it collects (tiles after the peers' in every walk) and stages the sum, the node partial, counted per full-width
chunk; the host sends it on the transfer stream by NCCL to the owner (one send per node partial and chunk, in the
order the collector completes them: nccl_rs_transport.node_partial_batches), where it lands in the collector's slot
and its flag is set. The owner adds its node's partials, then the other nodes' node partials in node order: the
same bits on every run. It has not run over NCCL yet (tests/gpu/test_hybrid_rs_gpu.py is its check; on one GPU its
tests pass at 2 x 2, 2 x 4 and 4 x 2 emulated nodes, after two runs at 8 ranks with intermittent wrong or unwritten
outputs, docs/design.md §7).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flux_layers import _env, _library
from flux_layers.ops import _opcalls
from flux_layers.ops._checks import check_fused_dims, check_fused_tensor, check_matmul_args
from flux_layers.ops.fp8 import FP8_DTYPES
from flux_layers.runtime import tuning, workspace
from flux_layers.runtime.call_plan import RsCallPlan
from flux_layers.runtime.multinode import nccl_rs_transport, nccl_transport
from flux_layers.runtime.multinode.transfer_plan import GroupLayout, build_rs_plan


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
              transport: str | None = None, chunk_cols: int | None = None,
              fast_accum: bool | None = None) -> RsCallPlan:
    """The call plan for an [M, K] x [K, N] call on ``ws`` (registered with ``ws`` by :func:`run`, once per distinct
    plan). Every rank resolves the same transport (same shape, same table), as both sides of a transfer must
    agree. ``fast_accum``: None for 16-bit operands, else the FP8 operands' accumulation."""
    chunk_cols = _env.get_int("RS_CHUNK_COLS") if chunk_cols is None else chunk_cols
    if chunk_cols < 0:
        raise ValueError(f"gemm_rs: chunk_cols must be >= 0 (0: default), got {chunk_cols}")
    transport = tuning.rs_transport(dtype=ws.dtype, tp=ws.tp, mkn=(m, k, n), requested=transport)
    kc = tuning.resolve_kernel("gemm_rs", dtype=torch.float8_e4m3fn if fast_accum is not None else ws.dtype,
                               tp=ws.tp, mkn=(m, k, n), tile=tile, swizzle=swizzle, stream_k=stream_k,
                               sm_count=sm_count, fast_accum=fast_accum)
    if transport == "copy_engine":
        ws.stage_buffer()
    return RsCallPlan(tile=kc.tile, swizzle=kc.swizzle, stream_k_fill=kc.stream_k_fill, sm_count=kc.sm_count,
                      transport=transport, chunk_cols=chunk_cols, accumulation="fast" if fast_accum else "split")


@dataclass(frozen=True)
class NcclCall:
    """What a call on a workspace of the NCCL transport runs: the op's call plan (external transfers, full-width chunks,
    the SMs the GEMM may hold) and its index in the workspace, the chunks of each destination's rows, this rank's
    batches, and the index in the workspace's flags of ``count_flags[dst][chunk]`` (this rank's staged tiles of
    dst's rows) and ``partial_flags[src][chunk]`` (src's partial of ours received)."""
    plan: RsCallPlan
    index: int
    chunks: tuple[nccl_rs_transport.RsChunk, ...]
    executor: nccl_rs_transport.RsExecutor
    count_flags: tuple[tuple[int, ...], ...]
    partial_flags: tuple[tuple[int, ...], ...]


def plan_nccl_call(ws: workspace.RsWorkspace, *, m: int, k: int, n: int, tile: int | None = None,
                   swizzle: int | None = None, stream_k: bool | int | None = None, sm_count: int = 0,
                   fast_accum: bool | None = None) -> NcclCall:
    """:func:`plan_call` for a workspace of the NCCL or hybrid transport (its two-level plan); ``sm_count`` 0: all
    SMs but FLUX_LAYERS_NCCL_SMS; ``fast_accum`` not None: calls of FP8 operands (bfloat16 partials), with that
    accumulation."""
    if not ws.over_nccl:
        raise ValueError("plan_nccl_call: the workspace is not the NCCL or hybrid transport's (RsWorkspace(..., "
                         "over_nccl=True) or (..., hybrid=True))")
    kc = tuning.resolve_kernel("gemm_rs", dtype=torch.float8_e4m3fn if fast_accum is not None else ws.dtype,
                               tp=ws.tp, mkn=(m, k, n), tile=tile, swizzle=swizzle, stream_k=stream_k,
                               sm_count=sm_count or nccl_transport.gemm_sms_beside_nccl(ws.device),
                               fast_accum=fast_accum)
    chunks = nccl_rs_transport.full_width_chunks(m // ws.tp, n, kc.tile, kc.swizzle)
    if len(chunks) > ws.flags_per_source:
        raise AssertionError(f"gemm_rs: {len(chunks)} chunks exceed the workspace's {ws.flags_per_source} flags")
    node_size, batches = 0, None  # the flat transport's: every partial to its owner
    if ws.hybrid:  # the two-level plan: only the node partials cross between nodes, by these batches
        node_size = len(ws.mapped)
        first = ws.rank // node_size * node_size
        if ws.mapped != tuple(range(first, first + node_size)) or ws.tp % node_size:
            raise ValueError(f"gemm_rs: the hybrid transport's two-level plan needs nodes of consecutive ranks alike "
                             f"in size; rank {ws.rank}'s node holds ranks {ws.mapped} of {ws.tp}")
        rs_plan = build_rs_plan(GroupLayout.uniform(ws.tp // node_size, node_size), chunks=max(1, len(chunks)))
        batches = nccl_rs_transport.node_partial_batches(rs_plan, ws.rank)
    plan = RsCallPlan(tile=kc.tile, swizzle=kc.swizzle, stream_k_fill=kc.stream_k_fill, sm_count=kc.sm_count,
                      transport="hybrid" if ws.hybrid else "external", chunk_cols=n, node_size=node_size,
                      accumulation="fast" if fast_accum else "split")
    count_flags = tuple(tuple(ws.count_index(q, c) for c in range(len(chunks))) for q in range(ws.tp))
    partial_flags = tuple(tuple(ws.partial_flag_index(q, c) for c in range(len(chunks))) for q in range(ws.tp))
    return NcclCall(plan, ws.plan_index(plan), chunks,
                    nccl_rs_transport.RsExecutor(ws.rank, ws.tp, max(1, len(chunks)), ws.group, batches), count_flags,
                    partial_flags)


def run_nccl(ws: workspace.RsWorkspace, call: NcclCall, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, weight_nn: bool, x_scale: torch.Tensor | None = None,
             w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One call on a workspace of the NCCL transport (flux_layers/runtime/multinode/nccl_rs_transport.py): the op
    clears the counts, forks the transfer stream and enqueues the GEMM; then this rank's batches on the transfer stream
    (per chunk: wait for its count, send it, receive the peer's partial of our rows, set that chunk's flag to the call's
    epoch), the compute stream joins it, and then the call's end (``_opcalls.end_external_call``). FP8 operands
    (``x_scale``, ``w_scale``): each rank's partials scaled in its epilogue, moved as bfloat16 like any other."""
    if torch.cuda.is_current_stream_capturing():
        raise workspace.NoGraphTwin(f"gemm_rs: {nccl_rs_transport.CAPTURE_REFUSAL}")
    compute, stream = torch.cuda.current_stream(), ws.transfer_stream
    if x.dtype in FP8_DTYPES:  # the op forks the transfer stream before the GEMM
        out = _opcalls.gemm_rs_fp8(ws, call.index, weight_nn)(x, weight, bias, x_scale, w_scale)
    else:
        out = _opcalls.gemm_rs(ws, call.index, weight_nn)(x, weight, bias)
    if out.shape[0] == 0:
        return out  # no epoch, nothing moved (every rank)
    epoch = ws.epoch  # the value this call's GEMM waits for
    flags, chunks, rows = ws.flags, call.chunks, nccl_rs_transport.chunk_rows
    counts, partials = call.count_flags, call.partial_flags
    wait_flag, write_flag = torch.ops.flux_layers.wait_flag.default, torch.ops.flux_layers.write_flag.default
    with torch.cuda.stream(stream):
        call.executor.run(lambda d, c: wait_flag(flags, counts[d][c], chunks[c].tiles),
                          lambda d, c: rows(ws.stage_slot(d), chunks[c]), lambda s, c: rows(ws.recv[s], chunks[c]),
                          lambda s, c: write_flag(flags, partials[s][c], epoch))
    compute.wait_stream(stream)
    _opcalls.end_external_call(ws, call.index, epoch)  # after the transfers (_opcalls.end_external_call says why)
    return out


def run(ws: workspace.RsWorkspace, plan: RsCallPlan, x: torch.Tensor, weight: torch.Tensor,
        bias: torch.Tensor | None, weight_nn: bool) -> torch.Tensor:
    """One call of the op library's gemm_rs with ``plan`` (registered with ``ws`` once); the op checks the tensors
    against the workspace before anything is enqueued."""
    return _opcalls.gemm_rs(ws, ws.plan_index(plan), weight_nn)(x, weight, bias)


def gemm_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", ws: workspace.RsWorkspace | None = None,
            tile: int | None = None, swizzle: int | None = None, stream_k: bool | int | None = None,
            sm_count: int = 0, transport: str | None = None, chunk_cols: int | None = None) -> torch.Tensor:
    """See the module docstring: the fused op with every choice open (tests, benchmarks); ``ops.gemm_rs`` is the
    same call decided once per shape. ``tile``/``swizzle``: kernel configuration (None: tuning table or the
    measured default); ``stream_k``: split a last, partial wave of tiles along K (None: FLUX_LAYERS_STREAM_K; an
    int: the fill limit, see tuning.stream_k_fill); ``sm_count``: SMs the persistent GEMM may hold (0: all);
    ``transport``: ``'epilogue'``, ``'copy_engine'``, ``'nccl'``, ``'hybrid'`` or ``'auto'`` (the tuning table's
    choice between the first two; None: ``ws``'s if it is the NCCL or hybrid transport's, else
    FLUX_LAYERS_RS_TRANSPORT); ``chunk_cols``: columns per copy-engine chunk (None: FLUX_LAYERS_RS_CHUNK_COLS; 0:
    1024; the NCCL and hybrid transports' chunks are full-width). Every rank must pass the same transport."""
    host = ("nccl", "hybrid")  # the transports whose transfers the host drives (plan_nccl_call, run_nccl)
    if transport is not None and transport not in host:
        tuning.check_rs_transport(transport)  # before anything else, so that bad arguments fail anywhere
    if chunk_cols is not None and chunk_cols < 0:
        raise ValueError(f"gemm_rs: chunk_cols must be >= 0 (0: default), got {chunk_cols}")
    m, k, n = check_args(x, weight, bias, weight_layout, group)
    if ws is not None and not isinstance(ws, workspace.RsWorkspace):
        raise TypeError(f"gemm_rs: ws must be an RsWorkspace or None, got {type(ws).__name__}")

    def kind(w: workspace.RsWorkspace) -> str:
        return "hybrid" if w.hybrid else "nccl" if w.over_nccl else "peer-mapped"
    if transport is None and ws is not None and ws.over_nccl:
        transport = kind(ws)
    need = transport if transport in host else "peer-mapped"
    if ws is None:
        ws = workspace.get_rs_workspace(group, x.dtype, m, n, over_nccl=need == "nccl", hybrid=need == "hybrid")
    elif m > ws.max_m or ws.n != n or ws.dtype != x.dtype or kind(ws) != need:
        raise ValueError(f"gemm_rs: call needs M={m}, N={n}, {x.dtype}, a {need} workspace; the workspace holds "
                         f"max_m={ws.max_m}, N={ws.n}, {ws.dtype}, {kind(ws)}")
    if need in host:
        call = plan_nccl_call(ws, m=m, k=k, n=n, tile=tile, swizzle=swizzle, stream_k=stream_k, sm_count=sm_count)
        return run_nccl(ws, call, x, weight, bias, weight_layout == "nn")
    plan = plan_call(ws, m=m, k=k, n=n, tile=tile, swizzle=swizzle, stream_k=stream_k, sm_count=sm_count,
                     transport=transport, chunk_cols=chunk_cols)
    return run(ws, plan, x, weight, bias, weight_layout == "nn")
