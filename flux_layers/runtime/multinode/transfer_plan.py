"""Transfer plans: which chunk moves from which rank to which, in which step, on which transport.

Plain Python, no CUDA and no torch.distributed: the plan is data that CPU tests check and that an executor
walks (flux_layers/runtime/multinode/nccl_transport.py runs plans whose transfers are all NCCL on GPUs, and hybrid plans,
NCCL between nodes and copy-engine pushes inside them, in its CPU tests; the copy-engine executor,
csrc/runtime/ag_gemm.cpp, runs its own mesh and ring inside one node). Topology detection that feeds it lives in
flux_layers/runtime/topology.py.

Vocabulary (csrc/runtime/ag_gemm.cpp): a group of ``tp`` ranks; rank g owns shard g of the all-gathered
operand; a shard is cut into ``chunks`` chunks; chunk (g, c) arriving at a rank is announced by one 32-bit flag.
Ranks live on nodes (``GroupLayout.node_of``); inside a node two ranks either map each other's memory (the
copy engine moves chunks, ``copy_engine``) or not (``nccl`` send/recv through the group's communicator, on its own
stream, each received chunk followed by its flag). Between nodes the transport is always ``nccl``.

A plan is a list of **steps**; each step a list of :class:`Transfer` that may run concurrently. A transfer
that forwards a chunk it did not own ``waits_on`` that chunk's :class:`Arrival` at its source, which must come
from an earlier step (so a step never waits on data of a later one). Within a step, transfers are listed in
issue order; a rank's GEMM walks shards in ``gemm_order[rank]``: own first (no wait), then the local node's
shards, then the remote ones, each part in arrival order.

All-gather orders (design.md §2), ``L`` ranks per node, ``h = L/2``:

| order | topology | steps | plan |
|---|---|---|---|
| ``mesh`` | one node, NVLink full mesh | 1 | every rank sends its chunks to every peer at once |
| ``ring`` | one node, PCIe | tp-1 | step s: rank r forwards shard r-s to r+1 (pipelined per chunk) |
| ``internode`` | nodes with NVLink inside | nnodes | step 0: the local shards' mesh exchange while each rank's NCCL send of its own shard to the rank with the same local index one node on is in flight; step k: that chunk, received in step k-1, is fanned out inside the node by the copy engine while the next node's NCCL transfer is in flight |
| ``numa2d`` | PCIe nodes with two NUMA domains | nnodes*(L-1) | per source node, a 2-D ring inside the node (below); the next node's shards cross the network (NCCL, one rank per local index) once the ring's cross-NUMA part is done |

NUMA-2D ring (after ByteDance Flux's ``Ring2D``, ``copy_ring_push_2d_pcie``): the node's ranks in ring order
``a0..a{h-1} b0..b{h-1}`` (NUMA 0, then NUMA 1). Steps 0..h-1 run the plain 1-D ring, whose two cross-NUMA
hops (a{h-1} -> b0, b{h-1} -> a0) carry each NUMA's h shards into the other domain once. From step h the
cross-NUMA senders close their own domain's ring instead (a{h-1} -> a0 with the shards a0 still lacks, which
a{h-1} already holds), so the other ranks' intra-NUMA forwarding continues with no traffic over the socket
link: each shard crosses between the NUMA domains once (L crossings per chunk per node against 2*(L-1) in the
1-D ring), still in L-1 steps.

GEMM+ReduceScatter across nodes (:class:`RsPlan`): rank (n, i) walks destination blocks of the other nodes
first (node n+1, n+2, ..., each from local index i+1 on, so that at every position the node's ranks write to
different collectors and the block it collects, (m, i), comes last), its own node's blocks last, its own block very
last. Inside node n, the intra-node fused reduce-scatter sums the L partials of block (m, j) at the collector
(n, j) (the rank with the block owner's local index), its own first, then its node peers' in local-index order:
the node partial. As soon as a node partial chunk is complete it goes by NCCL from (n, j) to the owner (m, j);
the owner sums its own node's partials the same way, then the other nodes' node partials in node order, so the
result does not depend on arrival order: bitwise-repeatable (``RsPlan.sum_order``; the kernel's order,
csrc/include/flux/workspace_layout.h ``RsTwoLevel``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

ORDERS = ("mesh", "ring", "internode", "numa2d")
TRANSPORTS = ("copy_engine", "nccl")
SINGLE_NODE_ORDERS = ("mesh", "ring")

Chunk = tuple[int, int]  # all-gather: (source shard g, chunk c); reduce-scatter: (destination block d, chunk c)


class PlanError(ValueError):
    """A transfer plan breaks one of the properties the executors rely on (the message lists which)."""


# ---------------------------------------------------------------------------------------------------------------
# Layout of a group
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupLayout:
    """Where the ranks of a TP group sit. Ranks of a node need not be contiguous; every node has the same size."""
    node_of: tuple[int, ...]                # node id of each rank, 0..nnodes-1
    numa_of: tuple[int, ...]                # NUMA node of each rank's GPU (-1: unknown)
    peer: tuple[tuple[bool, ...], ...]      # peer[a][b]: a's device can map b's memory (False across nodes)
    nvlink: bool = True                     # inside each node every pair is NVLink-connected (else PCIe)

    def __post_init__(self):
        tp = len(self.node_of)
        if tp < 1:
            raise ValueError("GroupLayout: node_of is empty")
        if len(self.numa_of) != tp:
            raise ValueError(f"GroupLayout: numa_of has {len(self.numa_of)} entries for {tp} ranks")
        if len(self.peer) != tp or any(len(row) != tp for row in self.peer):
            raise ValueError(f"GroupLayout: peer must be a {tp}x{tp} matrix")
        nodes = sorted(set(self.node_of))
        if nodes != list(range(len(nodes))):
            raise ValueError(f"GroupLayout: node ids must be 0..nnodes-1, got {nodes}")
        sizes = {n: self.node_of.count(n) for n in nodes}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"GroupLayout: nodes of different sizes {sizes}; every node needs the same number "
                             "of ranks")
        for a in range(tp):
            for b in range(tp):
                if self.peer[a][b] and self.node_of[a] != self.node_of[b]:
                    raise ValueError(f"GroupLayout: peer[{a}][{b}] is set but ranks {a} and {b} are on different "
                                     "nodes")

    @classmethod
    def uniform(cls, nnodes: int, node_size: int, *, numa: Sequence[int] | None = None,
                no_peer: Iterable[tuple[int, int]] = (), nvlink: bool = True) -> GroupLayout:
        """nnodes x node_size ranks, node-major (rank // node_size is the node); ``numa``: the NUMA node of each
        local rank, the same on every node; ``no_peer``: rank pairs (either direction) that cannot map each other's
        memory; every other intra-node pair can."""
        if nnodes < 1 or node_size < 1:
            raise ValueError(f"GroupLayout.uniform: nnodes={nnodes} and node_size={node_size} must be >= 1")
        tp = nnodes * node_size
        numa = tuple(numa) if numa is not None else (0,) * node_size
        if len(numa) != node_size:
            raise ValueError(f"GroupLayout.uniform: numa has {len(numa)} entries for {node_size} ranks per node")
        blocked = {frozenset(p) for p in no_peer}
        peer = tuple(tuple(a != b and a // node_size == b // node_size and frozenset((a, b)) not in blocked
                           for b in range(tp)) for a in range(tp))
        return cls(node_of=tuple(r // node_size for r in range(tp)), numa_of=numa * nnodes, peer=peer,
                   nvlink=nvlink)

    @property
    def tp(self) -> int:
        return len(self.node_of)

    @property
    def nnodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def node_size(self) -> int:
        return self.tp // self.nnodes

    def members(self, node: int) -> tuple[int, ...]:
        """Ranks of `node` in local-index order."""
        return tuple(r for r in range(self.tp) if self.node_of[r] == node)

    def local_index(self, rank: int) -> int:
        return self.members(self.node_of[rank]).index(rank)

    def rank_at(self, node: int, local: int) -> int:
        return self.members(node % self.nnodes)[local % self.node_size]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]

    def can_copy(self, a: int, b: int) -> bool:
        """The copy engine can move data between a and b (both map the other's memory: push and pull work)."""
        return self.peer[a][b] and self.peer[b][a]

    def numa_halves(self, node: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The node's ranks split by NUMA domain (lower id first), if there are exactly two domains of equal size."""
        ranks = self.members(node)
        domains = sorted({self.numa_of[r] for r in ranks})
        if len(domains) != 2 or min(domains) < 0:
            return None
        halves = tuple(tuple(r for r in ranks if self.numa_of[r] == d) for d in domains)
        return halves if len(halves[0]) == len(halves[1]) else None


# ---------------------------------------------------------------------------------------------------------------
# Choices
# ---------------------------------------------------------------------------------------------------------------

def choose_order(layout: GroupLayout, forced: str | None = None) -> str:
    """The all-gather order for `layout` (design.md §2's table), or `forced` after checking that it fits.

    One node: ``mesh`` with two ranks or an NVLink full mesh, else ``ring``. Several nodes: ``internode`` with
    NVLink (or one rank) inside each node, ``numa2d`` for PCIe nodes with two NUMA domains of equal size, else
    ``internode`` (its intra-node fan-out then runs over PCIe or NCCL)."""
    if forced not in (None, "auto"):
        if forced not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS} or 'auto', got {forced!r}")
        if forced in SINGLE_NODE_ORDERS and layout.nnodes > 1:
            raise ValueError(f"order {forced!r} is for a group inside one node; this group spans {layout.nnodes} "
                             "nodes (use 'internode' or 'numa2d')")
        if forced == "numa2d":
            bad = [n for n in range(layout.nnodes) if layout.numa_halves(n) is None]
            if bad:
                numa = [layout.numa_of[r] for r in layout.members(bad[0])]
                raise ValueError(f"order 'numa2d' needs two NUMA domains of equal size in every node; node {bad[0]} "
                                 f"has NUMA nodes {numa} (force them with FLUX_LAYERS_NUMA_MAP)")
        return forced
    all_peer = all(layout.can_copy(a, b) for a in range(layout.tp) for b in range(layout.tp)
                   if a != b and layout.same_node(a, b))
    if layout.nnodes == 1:
        return "mesh" if layout.tp <= 2 or (layout.nvlink and all_peer) else "ring"
    if layout.node_size == 1 or (layout.nvlink and all_peer):
        return "internode"
    if all(layout.numa_halves(n) is not None for n in range(layout.nnodes)):
        return "numa2d"
    return "internode"


def choose_transport(layout: GroupLayout, forced: str | None = None) -> tuple[tuple[str | None, ...], ...]:
    """transport[src][dst] for every pair (None on the diagonal): ``nccl`` across nodes and between ranks of a
    node that cannot map each other's memory, ``copy_engine`` elsewhere; ``forced='nccl'`` makes every pair NCCL,
    ``forced='copy_engine'`` requires every intra-node pair to be peer-mapped (between nodes NCCL stays)."""
    if forced not in (None, "auto") + TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} or 'auto', got {forced!r}")
    tp = layout.tp
    if forced == "copy_engine":
        missing = [(a, b) for a in range(tp) for b in range(a + 1, tp)
                   if layout.same_node(a, b) and not layout.can_copy(a, b)]
        if missing:
            raise ValueError(f"transport 'copy_engine' forced but ranks {missing[0]} (of {len(missing)} such pairs) "
                             "cannot map each other's memory")

    def pick(a: int, b: int) -> str | None:
        if a == b:
            return None
        if forced == "nccl" or not layout.same_node(a, b) or not layout.can_copy(a, b):
            return "nccl"
        return "copy_engine"

    return tuple(tuple(pick(a, b) for b in range(tp)) for a in range(tp))


# ---------------------------------------------------------------------------------------------------------------
# All-gather plan
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arrival:
    """Chunk `chunk` has arrived at `rank` (its flag is set there)."""
    chunk: Chunk
    rank: int


@dataclass(frozen=True)
class Transfer:
    chunk: Chunk                 # (source shard g, chunk c)
    src: int
    dst: int
    transport: str               # 'copy_engine' | 'nccl'
    waits_on: Arrival | None     # None: src owns the chunk; else the chunk's arrival at src


@dataclass(frozen=True)
class Op:
    """One rank's part of a transfer: ``copy`` (this rank drives a copy-engine transfer, then sets the chunk's flag
    at the destination), ``send`` or ``recv`` (NCCL; the receiver sets the chunk's flag after the receive)."""
    step: int
    action: str
    transfer: Transfer


@dataclass(frozen=True)
class AgPlan:
    layout: GroupLayout
    order: str
    chunks: int
    steps: tuple[tuple[Transfer, ...], ...]
    gemm_order: tuple[tuple[int, ...], ...]   # per rank: shards in the order its GEMM walks them

    def transfers(self) -> Iterable[tuple[int, Transfer]]:
        """(step, transfer) in issue order."""
        for s, step in enumerate(self.steps):
            for t in step:
                yield s, t

    def arrival_step(self, chunk: Chunk, rank: int) -> int | None:
        """Step in which `chunk` arrives at `rank` (-1: owned; None: never)."""
        if chunk[0] == rank:
            return -1
        for s, t in self.transfers():
            if t.chunk == chunk and t.dst == rank:
                return s
        return None

    def rank_ops(self, rank: int, mode: str = "push") -> tuple[Op, ...]:
        """What `rank` issues, step by step: copy-engine transfers are driven by the source in ``push`` mode and by
        the destination in ``pull`` mode; NCCL transfers appear as a send at the source and a receive at the
        destination, in the same order on both sides (NCCL matches them in order per pair; an executor groups a
        step's NCCL calls so that pairs exchanging both ways do not deadlock)."""
        if mode not in ("push", "pull"):
            raise ValueError(f"mode must be 'push' or 'pull', got {mode!r}")
        ops = []
        for s, t in self.transfers():
            if t.transport == "copy_engine":
                if rank == (t.src if mode == "push" else t.dst):
                    ops.append(Op(s, "copy", t))
            elif rank == t.src:
                ops.append(Op(s, "send", t))
            elif rank == t.dst:
                ops.append(Op(s, "recv", t))
        return tuple(ops)


def _waits(chunk: Chunk, src: int) -> Arrival | None:
    return None if chunk[0] == src else Arrival(chunk, src)


def _fan_out(layout: GroupLayout, node: int, holder_shard, transport, chunks: int) -> list[Transfer]:
    """Every rank of `node` receives, from each local peer p, the shard holder_shard(p) that p holds: all at once.
    Listed per destination, peers in rank-offset order (destination + 1, + 2, ...), as the mesh GEMM walks them."""
    out = []
    members = layout.members(node)
    size = len(members)
    for j, dst in enumerate(members):
        for o in range(1, size):
            src = members[(j + o) % size]
            g = holder_shard(src)
            for c in range(chunks):
                out.append(Transfer((g, c), src, dst, transport[src][dst], _waits((g, c), src)))
    return out


def _node_ring(layout: GroupLayout, node: int, holder_shard, transport, chunks: int, two_d: bool
               ) -> list[list[Transfer]]:
    """L-1 steps of a ring inside `node` that gives every rank the shard holder_shard(p) of every local peer p.
    two_d: the NUMA-2D ring (module docstring); else the 1-D ring r -> r+1 in local-index order."""
    if two_d:
        halves = layout.numa_halves(node)
        ring = halves[0] + halves[1]
        h = len(halves[0])
    else:
        ring = layout.members(node)
        h = len(ring)  # the 2-D switch at step h never comes
    size = len(ring)
    steps = []
    for s in range(size - 1):
        step = []
        for i, src in enumerate(ring):
            if s >= h and i % h == h - 1:  # cross-NUMA sender closes its own domain's ring
                dst, q = ring[i - (h - 1)], (i - s + h) % size
            else:
                dst, q = ring[(i + 1) % size], (i - s) % size
            g = holder_shard(ring[q])
            for c in range(chunks):
                step.append(Transfer((g, c), src, dst, transport[src][dst], _waits((g, c), src)))
        steps.append(step)
    return steps


def _network(layout: GroupLayout, node: int, phase: int, transport, chunks: int) -> list[Transfer]:
    """Phase `phase` >= 1 of the inter-node exchange, for the ranks of `node` as senders: each sends its own shard
    to the rank with the same local index `phase` nodes on (so it crosses the network once per node)."""
    out = []
    for j, src in enumerate(layout.members(node)):
        dst = layout.rank_at(node + phase, j)
        for c in range(chunks):
            out.append(Transfer((src, c), src, dst, transport[src][dst], None))
    return out


def _gemm_orders(layout: GroupLayout, steps: Sequence[Sequence[Transfer]]) -> tuple[tuple[int, ...], ...]:
    """Own shard first, then the local node's shards, then the remote ones, each part by the (step, issue
    position) at which a shard's last chunk arrives."""
    last: dict[tuple[int, int], tuple[int, int]] = {}
    pos = 0
    for s, step in enumerate(steps):
        for t in step:
            key = (t.chunk[0], t.dst)
            last[key] = max(last.get(key, (-1, -1)), (s, pos))
            pos += 1
    orders = []
    for r in range(layout.tp):
        others = sorted((g for g in range(layout.tp) if g != r),
                        key=lambda g: (not layout.same_node(g, r), last.get((g, r), (1 << 30, 0))))
        orders.append((r, *others))
    return tuple(orders)


def build_ag_plan(layout: GroupLayout, order: str | None = None, *, chunks: int = 1,
                  transport: str | None = None, validate: bool = True) -> AgPlan:
    """The all-gather plan for `layout`; `order`/`transport` None or 'auto': chosen from the layout
    (:func:`choose_order`, :func:`choose_transport`), else forced (and checked)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    order = choose_order(layout, order)
    tmat = choose_transport(layout, transport)
    nn, size = layout.nnodes, layout.node_size
    steps: list[list[Transfer]] = []

    def at(step: int) -> list[Transfer]:
        while len(steps) <= step:
            steps.append([])
        return steps[step]

    def phase_shard(node: int, phase: int):
        # Phase p: the ranks of `node` hold the shards of node - p, one per local index (p = 0: their own).
        return lambda holder: layout.rank_at(node - phase, layout.local_index(holder))

    if order in ("mesh", "internode"):
        # Step k: fan out the shards of node n-k inside node n (k = 0: the local ones), while each rank's own shard
        # crosses the network to node n+k+1.
        for k in range(nn):
            for n in range(nn):
                at(k).extend(_fan_out(layout, n, phase_shard(n, k), tmat, chunks))
            if k + 1 < nn:
                for n in range(nn):
                    at(k).extend(_network(layout, n, k + 1, tmat, chunks))
    else:
        two_d = order == "numa2d"
        per_phase = size - 1
        send_at = min(size // 2, per_phase - 1) if two_d else 0  # after the ring's cross-NUMA part
        for p in range(nn):
            for n in range(nn):
                for s, step in enumerate(_node_ring(layout, n, phase_shard(n, p), tmat, chunks, two_d)):
                    at(p * per_phase + s).extend(step)
            if p + 1 < nn:
                for n in range(nn):
                    at(p * per_phase + send_at).extend(_network(layout, n, p + 1, tmat, chunks))

    steps = [step for step in steps if step]
    plan = AgPlan(layout=layout, order=order, chunks=chunks, steps=tuple(tuple(s) for s in steps),
                  gemm_order=_gemm_orders(layout, steps))
    if validate:
        validate_ag_plan(plan)
    return plan


def ag_plan_problems(plan: AgPlan) -> list[str]:
    """Every way `plan` breaks the executors' assumptions (empty: none):
    every chunk reaches every rank but its owner exactly once; a transfer's source holds the chunk before the
    transfer's step (it owns it, or it arrived in an earlier step, which is then its ``waits_on``); each chunk
    crosses into every node but its owner's exactly once and into its owner's node never; transports fit the
    layout (NCCL across nodes, the copy engine only between peer-mapped ranks); each rank's GEMM order lists every
    shard once, its own first, the local node's before the remote ones, each part in arrival order."""
    lay, tp, chunks = plan.layout, plan.layout.tp, plan.chunks
    problems: list[str] = []
    if chunks < 1:
        return [f"chunks={chunks} must be >= 1"]
    arrivals: dict[tuple[Chunk, int], list[int]] = {}
    for s, t in plan.transfers():
        g, c = t.chunk
        if not (0 <= g < tp and 0 <= c < chunks and 0 <= t.src < tp and 0 <= t.dst < tp) or t.src == t.dst:
            problems.append(f"step {s}: {t} names a chunk or rank outside the group, or sends to itself")
            continue
        arrivals.setdefault((t.chunk, t.dst), []).append(s)
    for s, t in plan.transfers():
        g, c = t.chunk
        if (t.chunk, t.dst) not in arrivals:
            continue  # reported above
        where = f"step {s}: chunk {t.chunk} {t.src}->{t.dst}"
        if t.transport not in TRANSPORTS:
            problems.append(f"{where}: unknown transport {t.transport!r}")
        elif not lay.same_node(t.src, t.dst) and t.transport != "nccl":
            problems.append(f"{where}: crosses nodes on {t.transport!r}; only NCCL reaches another node")
        elif t.transport == "copy_engine" and not lay.can_copy(t.src, t.dst):
            problems.append(f"{where}: copy engine between ranks that cannot map each other's memory")
        if t.dst == g:
            problems.append(f"{where}: sends the chunk to its owner")
        if t.src == g:
            if t.waits_on is not None:
                problems.append(f"{where}: the source owns the chunk but waits on {t.waits_on}")
            continue
        got = arrivals.get((t.chunk, t.src))
        if not got or min(got) >= s:
            when = f"only in step {min(got)}" if got else "never"
            problems.append(f"{where}: forwards a chunk before it has it (it arrives at {t.src} {when})")
        if t.waits_on != Arrival(t.chunk, t.src):
            problems.append(f"{where}: waits on {t.waits_on}, not on the chunk's arrival at its source "
                            f"{Arrival(t.chunk, t.src)}")
    for g in range(tp):
        for c in range(chunks):
            for r in range(tp):
                if r == g:
                    continue
                n = len(arrivals.get(((g, c), r), []))
                if n != 1:
                    problems.append(f"chunk {(g, c)} reaches rank {r} {n} times, not once")
    crossings: dict[tuple[Chunk, int], int] = {}
    for s, t in plan.transfers():
        if 0 <= t.src < tp and 0 <= t.dst < tp and not lay.same_node(t.src, t.dst):
            key = (t.chunk, lay.node_of[t.dst])
            crossings[key] = crossings.get(key, 0) + 1
    for (chunk, node), n in sorted(crossings.items()):
        if node == lay.node_of[chunk[0]]:
            problems.append(f"chunk {chunk} crosses back into its owner's node {node} ({n} times)")
        elif n != 1:
            problems.append(f"chunk {chunk} crosses into node {node} {n} times, not once")
    if len(plan.gemm_order) != tp:
        problems.append(f"gemm_order has {len(plan.gemm_order)} entries for {tp} ranks")
        return problems
    for r, gorder in enumerate(plan.gemm_order):
        if sorted(gorder) != list(range(tp)) or not gorder or gorder[0] != r:
            problems.append(f"rank {r}: GEMM order {gorder} must list every shard once, its own ({r}) first")
            continue
        rest = gorder[1:]
        local = [g for g in rest if lay.same_node(g, r)]
        if list(rest[:len(local)]) != local:
            problems.append(f"rank {r}: GEMM order {gorder} visits a remote shard before a local one")
        for part in (local, rest[len(local):]):
            ready = [max(max(arrivals.get(((g, c), r), [-1])) for c in range(chunks)) for g in part]
            if ready != sorted(ready):
                problems.append(f"rank {r}: GEMM order {gorder} does not follow arrival (steps {ready})")
    return problems


def _raise_problems(what: str, layout: GroupLayout, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise PlanError(f"{what} for {layout.nnodes}x{layout.node_size} ranks: " + "; ".join(problems[:8]) + more)


def validate_ag_plan(plan: AgPlan) -> None:
    """Raise :class:`PlanError` listing the problems of `plan` (:func:`ag_plan_problems`), if any."""
    _raise_problems(f"all-gather plan '{plan.order}'", plan.layout, ag_plan_problems(plan))


# ---------------------------------------------------------------------------------------------------------------
# Reduce-scatter plan (the inter-node part)
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RsSend:
    chunk: Chunk                    # (destination block d, chunk c): a node partial of rows owned by rank d
    src: int                        # the collector of that node partial (same local index as d, another node)
    dst: int                        # d
    transport: str                  # always 'nccl' (between nodes)
    ready_after: tuple[int, int]    # (position in the sender node's GEMM sweep, chunk): when the partial is complete


@dataclass(frozen=True)
class RsPlan:
    layout: GroupLayout
    chunks: int
    gemm_order: tuple[tuple[int, ...], ...]      # per rank: destination blocks in the order its GEMM writes them
    steps: tuple[tuple[RsSend, ...], ...]        # inter-node sends of node partials
    # per block d: per node in summation order (d's own node first, then the others in node order) its ranks in
    # summation order (the node's rank with d's local index first, then the others in local order)
    sum_order: tuple[tuple[tuple[int, ...], ...], ...]

    def sends(self) -> Iterable[tuple[int, RsSend]]:
        for s, step in enumerate(self.steps):
            for t in step:
                yield s, t

    def rank_ops(self, rank: int) -> tuple[tuple[int, str, RsSend], ...]:
        """(step, 'send' | 'recv', send) for `rank`, in issue order (the same per pair on both sides)."""
        return tuple((s, "send" if t.src == rank else "recv", t) for s, t in self.sends() if rank in (t.src, t.dst))


def rs_gemm_order(layout: GroupLayout, rank: int) -> tuple[int, ...]:
    """Destination blocks in the order rank (n, i) writes them: node n+1's blocks from local index i+1 on (the one
    it collects, (n+1, i), last), then node n+2's, ..., its own node's, its own block last. Inside one node this is
    schedules.rs_shard_order; the kernel's is csrc/include/flux/workspace_layout.h ``RsTwoLevel``."""
    n, i, size = layout.node_of[rank], layout.local_index(rank), layout.node_size
    return tuple(layout.rank_at(n + k, i + s) for k in range(1, layout.nnodes + 1) for s in range(1, size + 1))


def _rs_ready(layout: GroupLayout, gemm_order, node: int, block: int) -> int:
    """Sweep position after which node `node`'s partial of `block` is complete (every local rank wrote it)."""
    return max(gemm_order[r].index(block) for r in layout.members(node))


def build_rs_plan(layout: GroupLayout, *, chunks: int = 1, validate: bool = True) -> RsPlan:
    """The inter-node part of GEMM+ReduceScatter: step t, collector (n, j) sends its node partial of block
    (n+t+1, j) chunk by chunk as the chunks complete; each owner receives from one node per step."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    nn = layout.nnodes
    gemm_order = tuple(rs_gemm_order(layout, r) for r in range(layout.tp))
    steps = []
    for t in range(nn - 1):
        step = []
        for src in range(layout.tp):
            n, j = layout.node_of[src], layout.local_index(src)
            d = layout.rank_at(n + t + 1, j)
            ready = _rs_ready(layout, gemm_order, n, d)
            step.extend(RsSend((d, c), src, d, "nccl", (ready, c)) for c in range(chunks))
        steps.append(tuple(step))
    def node_sum(node: int, d: int) -> tuple[int, ...]:  # the collector's own partial first
        first = layout.rank_at(node, layout.local_index(d))
        return (first,) + tuple(r for r in layout.members(node) if r != first)

    def nodes(d: int) -> list[int]:  # d's own node first
        return [layout.node_of[d]] + [o for o in range(nn) if o != layout.node_of[d]]

    sum_order = tuple(tuple(node_sum(node, d) for node in nodes(d)) for d in range(layout.tp))
    plan = RsPlan(layout=layout, chunks=chunks, gemm_order=gemm_order, steps=tuple(steps), sum_order=sum_order)
    if validate:
        validate_rs_plan(plan)
    return plan


def rs_plan_problems(plan: RsPlan) -> list[str]:
    """Every way `plan` breaks the executors' assumptions (empty: none): each rank's GEMM writes every block once,
    the other nodes' before its own node's, its own block last; each node partial chunk of block d goes from the
    collector of every other node (the rank with d's local index) to d exactly once, by NCCL, and no other sends
    happen; a sender sends in the order its node's partials complete, with ``ready_after`` as computed; each
    block's sum order names every node once and, in each, exactly that node's ranks once."""
    lay, tp, chunks = plan.layout, plan.layout.tp, plan.chunks
    problems: list[str] = []
    if len(plan.gemm_order) != tp:
        return [f"gemm_order has {len(plan.gemm_order)} entries for {tp} ranks"]
    for r, order in enumerate(plan.gemm_order):
        if sorted(order) != list(range(tp)) or order[-1] != r:
            problems.append(f"rank {r}: GEMM order {order} must write every block once, its own last")
        elif any(lay.same_node(d, r) for d in order[:tp - lay.node_size]):
            problems.append(f"rank {r}: GEMM order {order} writes its own node's blocks before another node's")
    if problems:
        return problems
    seen: dict[tuple[Chunk, int], int] = {}
    last_ready: dict[int, tuple[int, int]] = {}
    for s, t in plan.sends():
        d, c = t.chunk
        where = f"step {s}: node partial {t.chunk} {t.src}->{t.dst}"
        if not (0 <= d < tp and 0 <= c < chunks and 0 <= t.src < tp) or t.dst != d:
            problems.append(f"{where}: must go to the block's owner {d}, inside the group")
            continue
        if t.transport != "nccl" or lay.same_node(t.src, t.dst):
            problems.append(f"{where}: the inter-node plan moves partials between nodes by NCCL only")
            continue
        if lay.local_index(t.src) != lay.local_index(d):
            problems.append(f"{where}: the source is not its node's collector of block {d}")
        key = (t.chunk, lay.node_of[t.src])
        seen[key] = seen.get(key, 0) + 1
        ready = (_rs_ready(lay, plan.gemm_order, lay.node_of[t.src], d), c)
        if t.ready_after != ready:
            problems.append(f"{where}: ready_after {t.ready_after}, but the node partial is complete at {ready}")
        if ready < last_ready.get(t.src, (-1, -1)):
            problems.append(f"{where}: sent after a partial that completes later ({last_ready[t.src]})")
        last_ready[t.src] = max(ready, last_ready.get(t.src, (-1, -1)))
    for d in range(tp):
        for c in range(chunks):
            for n in range(lay.nnodes):
                if n != lay.node_of[d] and seen.get(((d, c), n), 0) != 1:
                    problems.append(f"node {n}'s partial of {(d, c)} reaches {d} {seen.get(((d, c), n), 0)} times")
    if len(plan.sum_order) != tp:
        problems.append(f"sum_order has {len(plan.sum_order)} entries for {tp} blocks")
    else:
        for d, nodes in enumerate(plan.sum_order):
            node_ids = [lay.node_of[ranks[0]] if ranks else -1 for ranks in nodes]
            ok = sorted(node_ids) == list(range(lay.nnodes)) and all(
                sorted(ranks) == sorted(lay.members(n)) and len(set(ranks)) == len(ranks)
                for n, ranks in zip(node_ids, nodes))
            if not ok:
                problems.append(f"block {d}: sum order {nodes} must name every node once, each with its own ranks")
    return problems


def validate_rs_plan(plan: RsPlan) -> None:
    """Raise :class:`PlanError` listing the problems of `plan` (:func:`rs_plan_problems`), if any."""
    _raise_problems("reduce-scatter plan", plan.layout, rs_plan_problems(plan))


__all__ = ["ORDERS", "TRANSPORTS", "PlanError", "GroupLayout", "choose_order", "choose_transport", "Arrival",
           "Transfer", "Op", "AgPlan", "build_ag_plan", "ag_plan_problems", "validate_ag_plan", "RsSend", "RsPlan",
           "rs_gemm_order", "build_rs_plan", "rs_plan_problems", "validate_rs_plan"]
