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
These are fixed in a call plan (runtime/call_plan.py) registered with the workspace (:func:`plan_call`); :func:`run`
makes the call.

Transport ``nccl`` (a group whose GPUs cannot map each other's memory, one that spans nodes, or
FLUX_LAYERS_TRANSPORT=nccl): the workspace is local memory, the chunks arrive by NCCL send/recv driven from the
host on the workspace's transfer stream, each followed by its flag, and the GEMM runs in external-transfer mode,
in the transfer plan's arrival order, on all SMs but FLUX_LAYERS_NCCL_SMS
(flux_layers/runtime/multinode/nccl_transport.py; :func:`plan_nccl_call`, :func:`run_nccl`). Not under CUDA-graph
capture.

Transport ``hybrid`` (FLUX_LAYERS_TRANSPORT=hybrid; a group over several nodes with peer access inside each): the
same call, on a workspace mapped inside the node (runtime/workspace.py), with the transfer plan of
``nccl_transport.hybrid_plan``: NCCL between nodes, and inside the node the transfer stream pushes chunks into the
node peers' buffers with the copy engine (``copy_``, then the chunk's flag at the peer). Handshake, epoch e: a push
into peer q first waits (once per call) until q's done word here holds e - 1; after the join, this rank writes done
= e at every node peer that pushes here (its GEMM and transfers of call e stopped reading its buffer). A chunk pushed
here that this rank forwards, and every chunk pushed here before the gathered input is copied out, is waited for
on its flag.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flux_layers import _env, _library
from flux_layers.ops import _opcalls
from flux_layers.ops._checks import check_fused_dims, check_fused_tensor, check_matmul_args
from flux_layers.ops.fp8 import FP8_DTYPES, ScaledTensor
from flux_layers.runtime import schedules, tuning, workspace
from flux_layers.runtime.call_plan import AgCallPlan
from flux_layers.runtime.multinode import nccl_transport

DIRECTIONS = ("pull", "push")  # the copy engine's (the call plan's third mode, 'external', is the NCCL transport's)
ORDERS = ("mesh", "ring")


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
    check_fused_dims("ag_gemm", k, n)
    for what, t in (("x_shard_m", x_shard_m), ("weight", weight)):
        check_fused_tensor("ag_gemm", what, t)
    return rows * dist.get_world_size(group), k, n


def plan_call(ws: workspace.AgWorkspace, *, m: int, k: int, n: int, tile: int | None = None,
              swizzle: int | None = None, stream_k: bool | int | None = None, sm_count: int = 0,
              mode: str | None = None, order: str | None = None, chunk_rows: int | None = None,
              fast_accum: bool = False) -> AgCallPlan:
    """The call plan for an [M, K] x [K, N] call on ``ws``: kernel configuration from the arguments or the tuning
    table, transfer direction, order and chunking (registered with ``ws`` by :func:`run`, once per distinct plan).
    An FP8 workspace's calls take ``fast_accum`` (their accumulation)."""
    mode = _env.get("AG_MODE") if mode is None else mode
    order = ws.order if order is None else order
    if mode not in DIRECTIONS:
        raise ValueError(f"ag_gemm: mode must be 'pull' or 'push', got {mode!r}")
    if order not in ORDERS:
        raise ValueError(f"ag_gemm: order must be 'mesh' or 'ring', got {order!r}")
    fp8 = ws.dtype in FP8_DTYPES
    kc = tuning.resolve_kernel("ag_gemm", dtype=ws.dtype, tp=ws.tp, mkn=(m, k, n), tile=tile, swizzle=swizzle,
                               stream_k=stream_k, sm_count=sm_count, fast_accum=fast_accum if fp8 else None)
    elem = torch.tensor([], dtype=ws.dtype).element_size()
    rows_per_chunk = _rows_per_chunk(ws, m // ws.tp, k * elem, chunk_rows)
    return AgCallPlan(tile=kc.tile, swizzle=kc.swizzle, stream_k_fill=kc.stream_k_fill, sm_count=kc.sm_count,
                      mode=mode, order=order, rows_per_chunk=rows_per_chunk,
                      accumulation="fast" if fp8 and fast_accum else "split")


@dataclass(frozen=True)
class NcclCall:
    """What a call on a workspace of the NCCL or hybrid transport runs: the op's call plan (external transfers, the
    GEMM's shard order, the SMs it may hold) and its index in the workspace, the chunking, this rank's part of the
    transfer plan, and the index in the workspace's flags of each chunk's flag, ``chunk_flags[shard][chunk]``.

    Hybrid only: this rank's ``pushes`` inside its node (nccl_transport.NodePushes). A push into a target waits
    first, once per call, until the target's done of the previous call is set, word ``done_flags[target]`` of this
    rank's flags; after every call this rank sets done, word ``done_at_peers``, at each of the node's other ranks
    (whichever plan the next call runs)."""
    plan: AgCallPlan
    index: int
    rows_per_chunk: int
    executor: nccl_transport.AgExecutor
    chunk_flags: tuple[tuple[int, ...], ...]
    pushes: nccl_transport.NodePushes | None = None
    done_flags: tuple[int, ...] = ()
    done_at_peers: int = -1


def plan_nccl_call(ws: workspace.AgWorkspace, *, m: int, k: int, n: int, tile: int | None = None,
                   swizzle: int | None = None, stream_k: bool | int | None = None, sm_count: int = 0,
                   order: str | None = None, chunk_rows: int | None = None, fast_accum: bool = False) -> NcclCall:
    """:func:`plan_call` for a workspace of the NCCL or hybrid transport. ``order``: the transfer plan's (None:
    FLUX_LAYERS_AG_ORDER, 'auto' choosing from the layout); ``sm_count`` 0:
    :func:`nccl_transport.gemm_sms_beside_nccl`; an FP8 workspace's calls take ``fast_accum``."""
    if ws.transport not in ("nccl", "hybrid"):
        raise ValueError(f"plan_nccl_call: the workspace's transport is {ws.transport!r}")
    hybrid = ws.transport == "hybrid"
    order = _env.get("AG_ORDER") if order is None else order
    elem = torch.tensor([], dtype=ws.dtype).element_size()
    rows = m // ws.tp
    rows_per_chunk = _rows_per_chunk(ws, rows, k * elem, chunk_rows)
    chunks = max(1, schedules.chunk_count(rows, rows_per_chunk))
    transfers = (nccl_transport.hybrid_plan if hybrid else nccl_transport.nccl_plan)(ws.layout, chunks, order)
    executor = nccl_transport.AgExecutor(transfers, ws.rank, ws.group, copy_engine=hybrid)
    fp8 = ws.dtype in FP8_DTYPES
    kc = tuning.resolve_kernel("ag_gemm", dtype=ws.dtype, tp=ws.tp, mkn=(m, k, n), tile=tile, swizzle=swizzle,
                               stream_k=stream_k, sm_count=sm_count or nccl_transport.gemm_sms_beside_nccl(ws.device),
                               fast_accum=fast_accum if fp8 else None)
    plan = AgCallPlan(tile=kc.tile, swizzle=kc.swizzle, stream_k_fill=kc.stream_k_fill, sm_count=kc.sm_count,
                      mode="external", order="mesh", rows_per_chunk=rows_per_chunk,
                      shard_order=tuple(executor.gemm_order), accumulation="fast" if fp8 and fast_accum else "split")
    chunk_flags = tuple(tuple(ws.flag_index("chunk", g, c) for c in range(chunks)) for g in range(ws.tp))
    call = NcclCall(plan, ws.plan_index(plan), rows_per_chunk, executor, chunk_flags)
    if not hybrid:
        return call
    pushes = nccl_transport.node_pushes(transfers, ws.rank)
    members = tuple(sorted((ws.rank, *pushes.peers)))
    if members != ws.mapped:  # then on every rank: nodes are alike
        raise ValueError(f"ag_gemm: the hybrid plan's node holds ranks {members}, the workspace maps {ws.mapped} (the "
                         "node size changed since it was made; make a new workspace)")
    return dataclasses.replace(call, pushes=pushes, done_flags=tuple(ws.flag_index("done", q) for q in range(ws.tp)),
                               done_at_peers=ws.flag_index("done", ws.rank))


def flag_ops():
    """(write_flag, wait_flag): the op library's stream operations on a 32-bit flag word (cuStreamWriteValue32,
    cuStreamWaitValue32 >=), which :func:`run_nccl` issues; the CPU tests of the hybrid handshake put host stand-ins
    here."""
    return torch.ops.flux_layers.write_flag.default, torch.ops.flux_layers.wait_flag.default


def run_nccl(ws: workspace.AgWorkspace, call: NcclCall, x_shard_m: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, weight_nn: bool, return_gathered: bool, run_gemm: bool = True,
             x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None):
    """One call on a workspace of the NCCL or hybrid transport (module docstring): fork the transfer stream from the
    compute stream, enqueue the GEMM (it waits per chunk on this rank's flags), then this rank's batches on the
    transfer stream (NCCL, each received chunk's flag set to the call's epoch after it; hybrid: then its pushes into
    node peers' buffers, each followed by the chunk's flag there), the gathered input copied out there if asked for,
    and join, then the call's end (its completion word: ``_opcalls.end_external_call``); hybrid: then done at each of
    the node's other ranks. Returns out, or (out, gathered) if ``return_gathered``. ``run_gemm`` False: the transfers
    alone (benchmarks). A call under CUDA-graph capture raises NoGraphTwin (the transport has none).

    FP8 rows (an FP8 workspace; ``x_scale``, ``w_scale`` as ``ops.ag_gemm`` takes them): a chunk travels with its
    scales, into the scale region's slots of the call's epoch (``ws.scale_index``), in the chunk's batch and so ahead
    of its flag: a row-wise shard's scales of the chunk's rows, a shard's one scale with every chunk (the GEMM reads it
    for a tile after that tile's chunk flag, whichever of the shard's chunks lands first; a later copy rewrites the
    same value). The gathered input is then a ScaledTensor (the rows, and the scales [tp] or [M, 1])."""
    if torch.cuda.is_current_stream_capturing():
        raise workspace.NoGraphTwin(f"ag_gemm: {nccl_transport.CAPTURE_REFUSAL}")
    x = x_shard_m if x_shard_m.is_contiguous() else x_shard_m.contiguous()  # NCCL sends contiguous memory
    rows, tp, rpc = x.shape[0], ws.tp, call.rows_per_chunk
    compute, stream = torch.cuda.current_stream(), ws.transfer_stream
    stream.wait_stream(compute)  # fork before the GEMM: the transfers never wait on the GEMM they feed
    scaled = ws.dtype in FP8_DTYPES
    if scaled:
        out = _opcalls.ag_gemm_fp8(ws, call.index, weight_nn, run_gemm)(x, weight, bias, x_scale, w_scale, False)
    else:
        out = _opcalls.ag_gemm(ws, call.index, weight_nn, run_gemm)(x, weight, bias, False)
    if rows == 0:  # no epoch, nothing moved (every rank); the gathered input's shapes as the op library's
        if not return_gathered:
            return out
        empty = x.new_empty((0, x.shape[1]))
        if not scaled:
            return out, empty
        return out, ScaledTensor(empty, x_scale.new_empty((tp,) if x_scale.numel() == 1 else (0, 1)))
    epoch = ws.epoch  # the value this call's GEMM waits for
    buffer, flags, chunk_flags = ws.buffer[:rows * tp], ws.flags, call.chunk_flags
    write_flag, wait_flag = flag_ops()
    # FP8: the scales per shard (1, or the shard's rows: the op checked x_scale), and where each shard's start.
    per_shard = x_scale.numel() if scaled else 0
    scale_at = [ws.scale_index(epoch, g, per_shard) for g in range(tp)] if scaled else []

    def rows_of(c: int) -> slice:
        return slice(c * rpc, min((c + 1) * rpc, rows))

    def chunk(c: int, data: torch.Tensor, scales: torch.Tensor | None) -> nccl_transport.ChunkData:
        """Chunk c of a shard, given the shard's rows and (FP8) its scales: what carries it (FP8 rows as bytes, which
        every send/recv moves)."""
        if not scaled:
            return data[rows_of(c)]
        return data[rows_of(c)].view(torch.uint8), scales if per_shard == 1 else scales[rows_of(c)]

    def shard_scales(g: int, q: int | None = None) -> torch.Tensor | None:
        """FP8: shard g's scales in rank q's scale region (None: this rank's)."""
        if not scaled:
            return None
        return (ws.scales if q is None else ws.peer_scales[q])[scale_at[g]:scale_at[g] + per_shard]

    def region(g: int, c: int, q: int | None = None) -> nccl_transport.ChunkData:
        """Chunk c of shard g in rank q's gathered buffer and scale region (None: this rank's)."""
        return chunk(c, (buffer if q is None else ws.peer_buffers[q])[g * rows:(g + 1) * rows], shard_scales(g, q))

    cleared: set[int] = set()  # push targets whose previous call's GEMM is known to have stopped reading

    def push(dst: int, g: int, c: int, data: nccl_transport.ChunkData) -> None:
        if dst not in cleared:  # the target's done of the previous call: its buffer may be written again
            wait_flag(flags, call.done_flags[dst], epoch - 1)
            cleared.add(dst)
        for into, part in zip(nccl_transport.parts(region(g, c, dst)), nccl_transport.parts(data)):
            into.copy_(part)
        write_flag(ws.peer_flags(dst), chunk_flags[g][c], epoch)

    def wait_arrival(g: int, c: int) -> None:
        wait_flag(flags, chunk_flags[g][c], epoch)

    own_scales = x_scale.reshape(-1) if scaled else None
    with torch.cuda.stream(stream):
        call.executor.run(lambda c: chunk(c, x, own_scales), region,
                          lambda g, c: write_flag(flags, chunk_flags[g][c], epoch), push, wait_arrival)
        if return_gathered:
            for g, c in call.pushes.arriving if call.pushes else ():  # landed by the node peers' pushes
                wait_arrival(g, c)
            gathered = torch.empty((rows * tp, x.shape[1]), dtype=x.dtype, device=x.device)
            gathered.copy_(buffer)
            gathered[ws.rank * rows:(ws.rank + 1) * rows].copy_(x)
            if scaled:  # [tp] or [M, 1], as the op library returns them
                gathered_scale = torch.cat([own_scales if g == ws.rank else shard_scales(g) for g in range(tp)])
                gathered_scale = gathered_scale.view(-1, 1) if per_shard > 1 else gathered_scale
    compute.wait_stream(stream)
    _opcalls.end_external_call(ws, call.index, epoch)  # after the transfers (_opcalls.end_external_call says why)
    # This rank's GEMM and transfers stopped reading its buffer: the node's other ranks may push their next call.
    for q in call.pushes.peers if call.pushes else ():
        write_flag(ws.peer_flags(q), call.done_at_peers, epoch)
    if not return_gathered:
        return out
    gathered.record_stream(compute)
    if not scaled:
        return out, gathered
    gathered_scale.record_stream(compute)
    return out, ScaledTensor(gathered, gathered_scale)


def run(ws: workspace.AgWorkspace, plan: AgCallPlan, x_shard_m: torch.Tensor, weight: torch.Tensor,
        bias: torch.Tensor | None, weight_nn: bool, return_gathered: bool, run_gemm: bool = True):
    """One call of the op library's ag_gemm with ``plan`` (registered with ``ws`` once): out [M, N], or (out,
    gathered [M, K]) if ``return_gathered``. The op checks the tensors against the workspace before anything is
    enqueued."""
    return _opcalls.ag_gemm(ws, ws.plan_index(plan), weight_nn, run_gemm)(x_shard_m, weight, bias, return_gathered)


def ag_gemm(x_shard_m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
            weight_layout: str = "nt", return_gathered: bool = False,
            ws: workspace.AgWorkspace | None = None, tile: int | None = None, swizzle: int | None = None,
            stream_k: bool | int | None = None, sm_count: int = 0, mode: str | None = None,
            order: str | None = None, chunk_rows: int | None = None, transport: str | None = None):
    """See the module docstring: the fused op with every choice open (tests, benchmarks); ``ops.ag_gemm`` is the
    same call decided once per shape. ``tile``/``swizzle``: kernel configuration (None: tuning table or the
    measured default); ``stream_k``: split a last, partial wave of tiles along K (None: FLUX_LAYERS_STREAM_K; an
    int: the fill limit, see tuning.stream_k_fill); ``sm_count``: SMs the persistent GEMM may hold (0: all, or all
    but FLUX_LAYERS_NCCL_SMS on the NCCL and hybrid transports); ``mode``, ``order``, ``chunk_rows``: the transfers
    (None: the settings); ``transport``: 'copy_engine', 'nccl' or 'hybrid' (None: ``ws``'s, else
    backend.ag_transport)."""
    m, k, n = check_args(x_shard_m, weight, bias, weight_layout, group)
    if ws is not None and not isinstance(ws, workspace.AgWorkspace):
        raise TypeError(f"ag_gemm: ws must be an AgWorkspace or None, got {type(ws).__name__}")
    if transport is None:
        from flux_layers.ops.backend import ag_transport
        transport = ws.transport if ws is not None else ag_transport(group)
    if ws is None:
        ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k, transport)
    elif m > ws.max_m or ws.k != k or ws.dtype != x_shard_m.dtype or ws.transport != transport:
        raise ValueError(f"ag_gemm: call needs M={m}, K={k}, {x_shard_m.dtype}, transport {transport}; the workspace "
                         f"holds max_m={ws.max_m}, K={ws.k}, {ws.dtype}, transport {ws.transport}")
    if transport not in workspace.AG_TRANSPORTS:
        raise ValueError(f"ag_gemm: transport must be one of {workspace.AG_TRANSPORTS}, got {transport!r}")
    if transport != "copy_engine":
        call = plan_nccl_call(ws, m=m, k=k, n=n, tile=tile, swizzle=swizzle, stream_k=stream_k, sm_count=sm_count,
                              order=order, chunk_rows=chunk_rows)
        return run_nccl(ws, call, x_shard_m, weight, bias, weight_layout == "nn", return_gathered)
    plan = plan_call(ws, m=m, k=k, n=n, tile=tile, swizzle=swizzle, stream_k=stream_k, sm_count=sm_count,
                     mode=mode, order=order, chunk_rows=chunk_rows)
    return run(ws, plan, x_shard_m, weight, bias, weight_layout == "nn", return_gathered)


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


def nccl_all_gather(x_shard_m: torch.Tensor, *, group, ws: workspace.AgWorkspace | None = None) -> torch.Tensor:
    """The NCCL (or, on such a ``ws``, hybrid) transport's transfers alone (no GEMM): returns a view [M, K] of the
    workspace's gathered buffer (our own rows not filled), valid until the next call on that workspace. Used to time
    what the fused op overlaps."""
    _library.require()
    check_fused_tensor("nccl_all_gather", "x_shard_m", x_shard_m)
    rows, k = x_shard_m.shape
    m = rows * dist.get_world_size(group)
    if ws is None:
        ws = workspace.get_ag_workspace(group, x_shard_m.dtype, m, k, "nccl")
    call = plan_nccl_call(ws, m=m, k=k, n=8, tile=0, swizzle=0, stream_k=False)
    run_nccl(ws, call, x_shard_m, x_shard_m.new_empty((8, k)), None, False, False, run_gemm=False)
    return ws.buffer[:m]
