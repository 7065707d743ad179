"""The NCCL transport of the fused all-gather: a host-driven executor of a transfer plan's NCCL steps.

Where the GPUs of a group cannot map each other's memory (other nodes, or no peer access inside a node), chunks
move by NCCL send/recv through the TP group's own process group (torch.distributed, the NCCL torch ships; no
network code of our own). The fused op is then split between two streams of this rank, with nothing shared
across ranks but NCCL's messages:

* the **compute stream** runs the persistent GEMM in external-transfer mode (csrc/runtime/ag_gemm.cpp,
  ``AgMode::kExternal``): own shard from x at once, every other tile after the 32-bit flag of the chunk its A tile
  reads, in this rank's gathered buffer and flag words, both in *local* memory (no peer mapping, no handshake);
* the **transfer stream** (forked from the compute stream before the GEMM is enqueued, so it never waits on the
  GEMM it feeds) walks this rank's part of the plan (:func:`rank_batches`): per batch one group of NCCL
  send/recv calls (``dist.batch_isend_irecv``, so pairs that exchange both ways cannot deadlock), then, for each
  chunk it received, the chunk's flag set to the call's epoch (``cuStreamWriteValue32``, no kernel) once the
  receive has completed on the stream; forwarded chunks (ring-like plans) are sent from the buffer they arrived
  in, which the stream order makes safe. The compute stream joins the transfer stream at the end of the call.

Back-to-back calls need no handshake: the next call's receives are queued behind this call's GEMM (the fork), and
a sender's source is its own x or its own buffer. The GEMM must leave SMs to NCCL's kernels: the call plan's
``sm_count`` holds back ``FLUX_LAYERS_NCCL_SMS`` SMs (a persistent grid on every SM would spin on flags that
NCCL cannot deliver).

Batches. A plan step may hold several chunks; a batch is this rank's transfers of one (step, chunk index), in plan
order, so the GEMM sees chunk 0 of every shard of a step before chunk 1. Every rank cuts the same global plan by
the same keys and issues its batches in key order, and a transfer's send and receive carry the same key: a
batch's partners are all in their own batch of that key, so by induction every batch completes (NCCL matches a
pair's calls in issue order, which is the plan order on both sides).

The executor is generic over how a chunk's flag is set and which tensors hold the buffers (``AgExecutor.run``
takes callables), so the CPU tests run this very code with gloo and CPU tensors
(tests/cpu/multinode/test_nccl_transport.py), and over the send/recv primitive under each batch
(flux_layers/runtime/multinode/sendrecv.py): torch.distributed's, or, for ranks sharing one GPU
(FLUX_LAYERS_TEST_SHARED_GPU=1, where NCCL cannot run), a host-staged stand-in with NCCL's stream semantics, so that
emulated nodes on one GPU run every other line of this path.

Plans across nodes whose ranks inside a node can map each other's memory (``hybrid_plan``: NCCL between nodes, the
copy engine inside them) also have copy-engine transfers: a node's own shards, and each chunk that crossed the
network, fanned out to the node's other ranks. With ``copy_engine=True`` the executor drives those of its rank as
pushes (``run``'s ``push`` callable: copy the chunk into the peer's buffer, then set the peer's flag), after the
NCCL part of their batch, so a chunk received here by NCCL is forwarded only once it arrived. A chunk that a
local peer pushed here (a ring inside the node, NUMA-2D) and that this rank forwards, by NCCL or by a push, is
waited for first (``wait_arrival``: on GPUs a stream wait on this rank's flag of the chunk); the plan has it
arrive in an earlier step, so every batch of every rank completes (by induction on the batch keys). The CPU tests
run that too, with shared-memory tensors standing in for peer-mapped buffers. On GPUs such plans run as the
``hybrid`` transport (flux_layers/ops/fused_ag_gemm.py): a workspace mapped inside the node and local across, and a
done handshake with the node's peers before a push into their buffers (:func:`node_pushes` says whom). It has not
run over NCCL yet (on one GPU, 2 x 2 emulated nodes over the host-staged stand-in pass its GPU tests): unless
FLUX_LAYERS_TRANSPORT=hybrid, the fused op runs all-NCCL plans (``nccl_plan``) for groups that span nodes.

CUDA graphs: not supported; a captured call is refused (:data:`CAPTURE_REFUSAL`). NCCL calls can be captured, but
the executor's batches are host-driven and untested under capture; the copy-engine transport serves captured
calls.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from flux_layers import _env
from flux_layers.runtime.multinode.sendrecv import for_group
from flux_layers.runtime.multinode.transfer_plan import AgPlan, Chunk, GroupLayout, Transfer, build_ag_plan

# What carries a chunk: its rows, or a tuple of its rows and the scales that travel with them (AgExecutor.run).
ChunkData = torch.Tensor | tuple[torch.Tensor, ...]

CAPTURE_REFUSAL = ("the NCCL transport of the fused all-gather cannot run under CUDA-graph capture (its transfers "
                   "are driven from the host per call); capture with the copy-engine transport (peer-mapped GPUs) "
                   "or keep these calls out of the graph")


@dataclass(frozen=True)
class Batch:
    """One group of a rank's transfers with one key: its NCCL sends and receives, then the copy-engine pushes it
    drives (hybrid plans only)."""
    key: tuple[int, int]            # (plan step, chunk index)
    sends: tuple[Transfer, ...]     # in plan order
    recvs: tuple[Transfer, ...]     # in plan order
    copies: tuple[Transfer, ...] = ()  # copy-engine transfers from this rank, in plan order
    waits: tuple[Chunk, ...] = ()      # chunks pushed here by a peer that this batch forwards: wait for them first


def rank_batches(plan: AgPlan, rank: int, copy_engine: bool = False) -> tuple[Batch, ...]:
    """What `rank` issues, grouped into batches in key order (module docstring). Without ``copy_engine`` every
    transfer the rank takes part in must be an NCCL one; with it, the copy-engine transfers from this rank are its
    pushes (a copy-engine transfer into this rank needs nothing from it: its sender sets the flag)."""
    by_key: dict[tuple[int, int], tuple[list, list, list]] = {}
    nccl_received = {t.chunk for _, t in plan.transfers() if t.dst == rank and t.transport != "copy_engine"}
    for step, t in plan.transfers():
        if rank not in (t.src, t.dst):
            continue
        if t.transport != "nccl" and not copy_engine:
            raise ValueError(f"rank {rank}: step {step} moves chunk {t.chunk} {t.src}->{t.dst} by {t.transport!r}; "
                             "the NCCL executor runs plans whose transfers are all NCCL (copy_engine=False)")
        sends, recvs, copies = by_key.setdefault((step, t.chunk[1]), ([], [], []))
        if t.transport == "copy_engine":
            if t.src == rank:
                copies.append(t)
        else:
            (sends if t.src == rank else recvs).append(t)
    batches, awaited = [], set()
    for key, (s, r, c) in sorted(by_key.items()):
        if not (s or r or c):
            continue
        forwarded = [t.chunk for t in s + c if t.chunk[0] != rank and t.chunk not in nccl_received]
        waits = tuple(dict.fromkeys(ch for ch in forwarded if ch not in awaited))
        awaited.update(waits)
        batches.append(Batch(key, tuple(s), tuple(r), tuple(c), waits))
    return tuple(batches)


@functools.lru_cache(maxsize=None)
def nccl_plan(layout: GroupLayout, chunks: int, order: str | None = None) -> AgPlan:
    """The all-gather plan with every transfer on NCCL (validated): ``order`` None or 'auto' takes
    transfer_plan.choose_order's (one node: mesh or ring; several: internode, or numa2d for PCIe nodes)."""
    return build_ag_plan(layout, order, chunks=chunks, transport="nccl")


@functools.lru_cache(maxsize=None)
def hybrid_plan(layout: GroupLayout, chunks: int, order: str | None = None) -> AgPlan:
    """The all-gather plan with NCCL between nodes (and between ranks of a node without peer access) and the copy
    engine inside nodes (validated): each chunk crosses the network once and is fanned out inside the node."""
    return build_ag_plan(layout, order, chunks=chunks)


@dataclass(frozen=True)
class NodePushes:
    """A rank's side of a hybrid plan's copy-engine pushes inside its node: the peers it pushes into
    (``targets``), the node's other ranks (``peers``) and the chunks pushed into it (``arriving``, in plan order)."""
    targets: tuple[int, ...]
    peers: tuple[int, ...]
    arriving: tuple[Chunk, ...]


def node_pushes(plan: AgPlan, rank: int) -> NodePushes:
    """``rank``'s :class:`NodePushes` in ``plan`` (every copy-engine transfer stays inside a node: validated plans)."""
    copies = [t for _, t in plan.transfers() if t.transport == "copy_engine" and rank in (t.src, t.dst)]
    members = plan.layout.members(plan.layout.node_of[rank])
    return NodePushes(targets=tuple(sorted({t.dst for t in copies if t.src == rank})),
                      peers=tuple(q for q in members if q != rank),
                      arriving=tuple(dict.fromkeys(t.chunk for t in copies if t.dst == rank)))


def gemm_sms_beside_nccl(device: torch.device) -> int:
    """SMs the persistent GEMM may hold while NCCL's kernels run beside it (either operator's NCCL transport): all
    but FLUX_LAYERS_NCCL_SMS, even (the GEMM's clusters pair SMs). A grid on every SM would spin on flags that NCCL
    could never deliver."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    keep = _env.get_int("NCCL_SMS")
    if not 0 < keep < total - 1:
        raise ValueError(f"FLUX_LAYERS_NCCL_SMS={keep} must leave NCCL 1 to {total - 2} of the {total} SMs")
    return (total - keep) // 2 * 2


class AgExecutor:
    """This rank's batches of one plan and the group they run on; :meth:`run` issues them through ``sendrecv``, the
    group's send/recv primitive (None: :func:`flux_layers.runtime.multinode.sendrecv.for_group`'s)."""

    def __init__(self, plan: AgPlan, rank: int, group, copy_engine: bool = False, sendrecv=None):
        self.plan = plan
        self.rank = rank
        self.group = group
        self.batches = rank_batches(plan, rank, copy_engine)
        self.sendrecv = sendrecv if sendrecv is not None else for_group(group)

    @property
    def gemm_order(self) -> tuple[int, ...]:
        """The shards in the order this rank's GEMM walks them (own first, then arrival order)."""
        return self.plan.gemm_order[self.rank]

    def run(self, own: Callable[[int], ChunkData], region: Callable[[int, int], ChunkData],
            announce: Callable[[int, int], None],
            push: Callable[[int, int, int, ChunkData], None] | None = None,
            wait_arrival: Callable[[int, int], None] | None = None) -> None:
        """Issue every batch on the current stream. ``own(c)``: chunk c of this rank's shard (what it sends of its
        own); ``region(g, c)``: where chunk c of shard g sits in this rank's gathered buffer (received into, and
        forwarded from); ``announce(g, c)``: set that chunk's flag, called once its receive completed (on the
        stream for NCCL: ``wait`` orders the current stream after the transfer; gloo's ``wait`` blocks);
        ``push(dst, g, c, data)``: the copy-engine transfers (copy ``data`` into chunk c of shard g in rank dst's
        buffer, then set its flag there), issued after the batch's NCCL part; ``wait_arrival(g, c)``: wait until a
        local peer's push of that chunk here has landed (its flag), before the batch that forwards it.

        A chunk is a tensor, or a tuple of the tensors that carry it (FP8 rows and their scales): ``own(c)`` and
        ``region(g, c)`` give the same parts in the same order for a chunk on every rank, and each part moves as
        its own send and receive in the chunk's batch (NCCL matches a pair's calls in issue order)."""
        if push is None and any(batch.copies for batch in self.batches):
            raise ValueError(f"rank {self.rank}: the plan has copy-engine transfers and no push was given")
        if wait_arrival is None and any(batch.waits for batch in self.batches):
            raise ValueError(f"rank {self.rank}: the plan forwards chunks pushed here and no wait_arrival was given")

        def source(chunk: Chunk) -> ChunkData:
            return own(chunk[1]) if chunk[0] == self.rank else region(*chunk)

        for batch in self.batches:
            for chunk in batch.waits:
                wait_arrival(*chunk)
            if batch.sends or batch.recvs:
                self.sendrecv.exchange([(part, t.dst) for t in batch.sends for part in parts(source(t.chunk))],
                                       [(part, t.src) for t in batch.recvs for part in parts(region(*t.chunk))])
            for t in batch.recvs:
                announce(*t.chunk)
            for t in batch.copies:
                push(t.dst, *t.chunk, source(t.chunk))


def parts(chunk: ChunkData) -> tuple[torch.Tensor, ...]:
    """The tensors that carry a chunk, in order."""
    return chunk if isinstance(chunk, tuple) else (chunk,)


__all__ = ["ChunkData", "parts", "CAPTURE_REFUSAL", "Batch", "rank_batches", "nccl_plan", "hybrid_plan", "NodePushes",
           "node_pushes", "gemm_sms_beside_nccl", "AgExecutor"]
