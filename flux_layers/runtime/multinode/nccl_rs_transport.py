"""The NCCL transport of the fused GEMM+ReduceScatter: a host-driven executor of the partials' NCCL sends.

Where the GPUs of a group cannot map each other's memory (other nodes, or no peer access inside a node), or when
``FLUX_LAYERS_TRANSPORT=nccl``, each rank's partial of a peer's rows moves by NCCL send/recv through the TP group's
own process group (torch.distributed, the NCCL torch ships). The fused op is split between two streams of this
rank, with nothing shared across ranks but NCCL's messages:

* the **compute stream** runs the persistent GEMM in external-transfer mode (csrc/runtime/gemm_rs.cpp): exactly
  the kernel of the copy-engine transport. A tile of destination d's rows is stored into this rank's local staging
  slot for d and counted into its chunk (``count[d][c]``, a 32-bit word of this rank's flags, cleared per call);
  tiles of this rank's own rows come last, wait on this rank's flag of every (source, chunk) they read and add the
  peers' partials from this rank's receive slots in rank order, so the sum is bitwise-repeatable. Workspace in
  *local* memory: no peer mapping, no handshake, no write to a peer;
* the **transfer stream** (the workspace's, forked from the compute stream by the op itself, after the counts are
  cleared and before the kernel is enqueued, so that it neither sees the previous call's counts nor waits on the
  GEMM it feeds) walks this rank's batches (:func:`rs_batches`): per batch, ``cuStreamWaitValue32`` until the
  chunk's count is complete (``torch.ops.flux_layers.wait_flag``), one group of NCCL calls
  (``dist.batch_isend_irecv``: our staged partial of that chunk to the destination, the source's partial of our
  rows' chunk into our receive slot for that source), ``wait`` on the stream, then the received chunk's flag set
  to the call's epoch (``write_flag``). The compute stream joins the transfer stream at the end of the call.

Chunks are full-width: a chunk is one panel of the tile schedule (the tiles along M swept together) across all N
columns (``chunk_cols = N``), so it is contiguous rows in the staging slot and in the receive slot, which NCCL sends
and receives in place. Strided chunks (strips of columns, as the copy engine moves with 2-D copies) would need a
packing copy per chunk on each side, through an extra buffer, by SMs or the copy engine: more bytes and more
host-issued operations for a finer grain that NCCL's per-message cost does not reward.

Batches. The kernel writes destination shards in the order rank+1, rank+2, ..., own rows last, and sweeps each
shard's chunks in index order, so step j (1 <= j < tp) chunk c completes before step j chunk c+1 and before step
j+1. A batch of rank r has the key (j, c): send chunk c of destination (r + j) % tp, receive chunk c of our rows
from (r - j) % tp, the rank whose step j is us. Every rank issues its batches in key order, and a pair's send and
receive carry the same key, so every batch's partners are in their own batch of that key and the ranks cannot
deadlock (NCCL matches a pair's calls in issue order, which is key order on both sides).

Back-to-back calls need no handshake: the next call's receives (into our receive slots) and its count waits are
queued on the transfer stream behind this call's GEMM (the fork follows the compute stream), and the next call's
kernel, which overwrites the staging slots, follows this call's sends (the join). The GEMM must leave SMs to
NCCL's kernels: the call plan's ``sm_count`` holds back ``FLUX_LAYERS_NCCL_SMS``
(:func:`flux_layers.runtime.multinode.nccl_transport.gemm_sms_beside_nccl`, shared with the all-gather).

This is a flat transport: every partial goes straight to its owner, intra-node pairs included. Across nodes the
two-level plan of transfer_plan.build_rs_plan moves fewer bytes over the network: inside a node each block's
partials are summed at its collector (the rank of the block's local index), then one NCCL send per node partial
and chunk reaches the owner, which adds the nodes' partials in the plan's ``sum_order``. The same executor runs that
inter-node part (:func:`node_partial_batches`: the same batches and keys, with the collectors as partners) for the
``hybrid`` transport (flux_layers/ops/fused_gemm_rs.py), whose kernel makes the node partials (its collector tiles)
on a workspace mapped inside the node. Neither has run over NCCL yet (only on one GPU, emulated nodes over the
host-staged stand-in): each is taken only where FLUX_LAYERS_TRANSPORT forces it ('nccl', 'hybrid'), and a group
that spans nodes otherwise keeps the reference path.

The executor is generic over how a chunk's count is awaited, its flag set and which tensors hold the partials
(:meth:`RsExecutor.run` takes callables), so the CPU tests run this very code with gloo and CPU tensors
(tests/cpu/multinode/test_nccl_rs_transport.py), and over the send/recv primitive under each batch
(flux_layers/runtime/multinode/sendrecv.py: torch.distributed's, or the host-staged stand-in for ranks sharing one GPU).

CUDA graphs: not supported; a captured call is refused (:data:`CAPTURE_REFUSAL`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flux_layers.runtime import schedules
from flux_layers.runtime.multinode.sendrecv import for_group
from flux_layers.runtime.multinode.transfer_plan import PlanError, RsPlan

CAPTURE_REFUSAL = ("the NCCL transport of the fused GEMM+ReduceScatter cannot run under CUDA-graph capture (its "
                   "transfers are driven from the host per call); capture with the epilogue or copy-engine transport "
                   "(peer-mapped GPUs) or keep these calls out of the graph")


@dataclass(frozen=True)
class RsBatch:
    """One group of NCCL calls of a rank: its partial of chunk ``chunk`` of ``dst``'s rows out, the partial of
    chunk ``chunk`` of its own rows from ``src`` in."""
    key: tuple[int, int]  # (step j in the kernel's destination order, 1..tp-1; chunk)
    dst: int
    src: int

    @property
    def chunk(self) -> int:
        return self.key[1]


def rs_batches(rank: int, tp: int, chunks: int) -> tuple[RsBatch, ...]:
    """What ``rank`` issues, in key order (module docstring)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return tuple(RsBatch((j, c), (rank + j) % tp, (rank - j) % tp) for j in range(1, tp) for c in range(chunks))


def node_partial_batches(plan: RsPlan, rank: int) -> tuple[RsBatch, ...]:
    """What ``rank`` issues in the inter-node part of a two-level reduce-scatter (transfer_plan.build_rs_plan), in
    key order: per plan step t and chunk c (key (t + 1, c)), its node's partial of chunk c of the block it collects
    for the node t + 1 ahead out to that block's owner, and the partial of chunk c of its own rows that the node
    t + 1 behind summed in from that node's collector. The plan lists a step's sends in completion order, so the
    count waits come in the order the collector's GEMM finishes the partials; a send and its receive carry the same
    key, so batches cannot deadlock, as with :func:`rs_batches`."""
    if not 0 <= rank < plan.layout.tp:
        raise ValueError(f"rank {rank} outside [0, {plan.layout.tp})")
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for step, kind, send in plan.rank_ops(rank):
        (sends if kind == "send" else recvs).setdefault((step + 1, send.chunk[1]), []).append(send)
    lone = sorted(sends.keys() ^ recvs.keys())
    doubled = sorted(k for k, v in (*sends.items(), *recvs.items()) if len(v) != 1)
    if lone or doubled:
        raise PlanError(f"rank {rank}: reduce-scatter plan batches {lone or doubled} do not pair one send with one "
                        "receive")
    return tuple(RsBatch(key, sends[key][0].dst, recvs[key][0].src) for key in sorted(sends))


@dataclass(frozen=True)
class RsChunk:
    """Chunk ``index`` of every destination shard: rows [row0, row0 + rows) of the shard, all N columns, complete
    once ``tiles`` tiles were counted into it (the kernel's count target)."""
    index: int
    row0: int
    rows: int
    tiles: int


def chunk_rows(slot: torch.Tensor, chunk: RsChunk) -> torch.Tensor:
    """The rows of ``chunk`` in a slot [rows, N] (staging or receive): contiguous, what NCCL sends or receives."""
    return slot[chunk.row0:chunk.row0 + chunk.rows]


def full_width_chunks(rows_per_shard: int, n: int, tile: int, swizzle: int) -> tuple[RsChunk, ...]:
    """The chunks of a call's destination shards as the kernel counts them in external mode (flux::RsChunkGrid with
    chunk_cols = N, mirrored by schedules.RsChunkGrid): ``tile`` the flux::TileConfig id, ``swizzle`` the call
    plan's (0: the kernel's default)."""
    if rows_per_shard <= 0:
        return ()
    tile_m, tile_n = schedules.TILE_CONFIGS[tile]
    swizzle_m = {"swizzle_m": swizzle} if swizzle > 0 else {}  # else the kernel's default, TileSchedule's too
    sched = schedules.TileSchedule(rows_per_shard=rows_per_shard, n=n, num_shards=1, shard_order=(0,),
                                   tile_m=tile_m, tile_n=tile_n, **swizzle_m)
    grid = schedules.RsChunkGrid(sched, chunk_cols=n)
    if grid.chunks_n != 1:
        raise AssertionError(f"full-width chunks of N={n} cut into {grid.chunks_n} strips")
    span = grid.chunk_tiles_m * tile_m
    return tuple(RsChunk(cm, cm * span, min(rows_per_shard, (cm + 1) * span) - cm * span, grid.tiles_in(cm, 0))
                 for cm in range(grid.chunks_m))


class RsExecutor:
    """This rank's batches for a call of ``chunks`` chunks per destination and the group they run on; :meth:`run`
    issues them. ``batches``: None for the flat transport's (:func:`rs_batches`), else those of a two-level plan
    (:func:`node_partial_batches`)."""

    def __init__(self, rank: int, tp: int, chunks: int, group, batches: tuple[RsBatch, ...] | None = None,
                 sendrecv=None):
        self.rank = rank
        self.tp = tp
        self.chunks = chunks
        self.group = group
        self.batches = rs_batches(rank, tp, chunks) if batches is None else batches
        self.sendrecv = sendrecv if sendrecv is not None else for_group(group)

    def run(self, ready: Callable[[int, int], None], staged: Callable[[int, int], torch.Tensor],
            slot: Callable[[int, int], torch.Tensor], announce: Callable[[int, int], None]) -> None:
        """Issue every batch on the current stream. ``ready(d, c)``: hold the stream until our partial of chunk c
        of d's rows is complete (the kernel's count); ``staged(d, c)``: that partial (sent); ``slot(s, c)``: where
        s's partial of chunk c of our rows lands (received into); ``announce(s, c)``: set that chunk's flag, called
        once its receive completed (on the stream for NCCL: ``wait`` orders the current stream after the transfer;
        gloo's ``wait`` blocks)."""
        for b in self.batches:
            ready(b.dst, b.chunk)
            self.sendrecv.exchange([(staged(b.dst, b.chunk), b.dst)], [(slot(b.src, b.chunk), b.src)])
            announce(b.src, b.chunk)


__all__ = ["CAPTURE_REFUSAL", "RsBatch", "rs_batches", "node_partial_batches", "RsChunk", "chunk_rows",
           "full_width_chunks", "RsExecutor"]
