"""Long-lived workspaces of the fused operators: symmetric buffers, epoch flags, streams, error record.

One workspace per (TP group, operator, dtype, inner size); created once (a collective: every rank of the
group must create it in the same order) and reused by every call. M may change from call to call up to the
workspace's ``max_m``; nothing is allocated or exchanged per call.

Symmetric memory comes from ``torch.distributed._symmetric_memory`` (IPC mapping and pointer exchange).
Each workspace makes one symmetric allocation holding its data buffer and its 32-bit flag words, so the
offsets of both are identical on every rank. A workspace of the NCCL transport (GPUs that cannot map each other's
memory, other nodes, or FLUX_LAYERS_TRANSPORT=nccl) makes one local allocation instead: its peers' pointers are
null, NCCL moves the all-gather's chunks (flux_layers/runtime/multinode/nccl_transport.py) or the reduce-scatter's
partials (flux_layers/runtime/multinode/nccl_rs_transport.py), and it has no CUDA-graph twin.

Each workspace owns one long-lived native workspace, ``Workspace.native``
(``torch.classes.flux_layers.NativeWorkspace``, csrc/bindings/ops.cpp, around the runtime's ``flux::WorkspaceState``,
csrc/include/flux/workspace_state.h): the peers' buffer and flag pointers, the communication streams, the events of
a call, the error record, the flag protocol, the epoch counter and the call plans registered for the shapes seen so
far. A call passes its tensors, a plan index and that object's handle; the op checks everything before the
epoch advances, so a rejected call leaves the ranks in step. Settings (FLUX_LAYERS_TIMEOUT_S,
FLUX_LAYERS_POISON_OUTPUTS) are read when the workspace is made.

Flags are epoch-valued (a flag is set for call ``e`` when it holds a value >= e): they are never cleared,
which removes the reset race between back-to-back calls. Every cross-rank wait is bounded: a waiter that
times out writes {code, rank, index, epoch} into a host-mapped record, and the next call (or
:meth:`Workspace.check`) raises a :class:`WorkspaceError` that says who waited for what. Each call also carries
its signature (op, M, N or K, layout, transport, epoch) to the peers it sends to, and their kernels compare it with
their own (csrc/include/flux/gemm_params.h): ranks whose calls went out of step raise, naming both calls.

CUDA graphs. A captured call replays with the values it was captured with, so a host-side epoch cannot order
replays. Calls made while the current stream is being captured therefore use the workspace's *graph twin*:
a second workspace of the same size whose flags follow the CUDA-graph protocol (a set flag holds 1 and is
cleared by the rank that waits on it before that rank releases the producer; csrc/include/flux/fused_ops.h
FlagProtocol). Eager calls and replays never share memory, so neither can overwrite what the other still
reads. Twins are created with their workspaces (a collective, which cannot run under capture) once CUDA graphs
are enabled: ``FLUX_LAYERS_CUDA_GRAPHS=1``, :func:`enable_cuda_graphs` (the layers call it when megatron's
config asks for CUDA graphs) or :func:`prepare_cuda_graphs` after the warm-up step.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flux_layers import _env, _library
from flux_layers.runtime import topology
from flux_layers.runtime.call_plan import AgCallPlan, RsCallPlan
from flux_layers.runtime.schedules import ERROR_RECORD_WORDS, MAX_TP


class WorkspaceError(RuntimeError):
    """A bounded wait inside a fused operator timed out, or the ranks' calls went out of step; the workspace cannot be
    used any more. The op library's direct calls raise it themselves; a registered op's call raises
    torch.distributed.DistError, which flux_layers/ops/_opcalls.py turns into it."""


class NoGraphTwin(RuntimeError):
    """A fused call made while its stream is being captured into a CUDA graph, on a workspace without a CUDA-graph
    twin (one made before CUDA graphs were enabled, or of the NCCL transport, which refuses captured calls)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name the op library knows a dtype by (its torch name: 'bfloat16', 'float8_e4m3fn', ...)."""
    return str(dtype).removeprefix("torch.")


def _align(n: int, a: int = 256) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class _Key:
    group_name: str
    op: str
    dtype: torch.dtype
    inner: int  # K for all-gather, N for reduce-scatter


class Workspace:
    """Common part: one symmetric allocation (data + flags), streams, epoch counter, error record. ``sizes``: what the
    op library's layout says one rank holds (``ag_workspace_layout`` / ``rs_workspace_layout``)."""

    def __init__(self, group, *, kind: str, sizes: dict, num_comm_streams: int, what: str, graph_protocol: bool,
                 dtype: torch.dtype, max_m: int, inner: int, peer_mapped: bool = True,
                 node_members: tuple[int, ...] | None = None):
        _library.require()  # the native workspace below is the op library's class
        if not dist.is_initialized():
            raise RuntimeError(f"{what}: torch.distributed is not initialised")
        self.group = group
        self.rank = dist.get_rank(group)
        self.tp = dist.get_world_size(group)
        if not 2 <= self.tp <= MAX_TP:
            raise ValueError(f"{what}: the fused path supports TP groups of 2 to {MAX_TP} ranks, got {self.tp}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        # The group ranks whose memory this rank maps: every rank, this node's (``node_members``: the hybrid
        # all-gather, mapped over the node's own process group) or none but itself (local memory).
        if node_members is not None:
            if self.rank not in node_members:
                raise ValueError(f"{what}: rank {self.rank} is not among the node members {node_members}")
            self.mapped = tuple(node_members)
        else:
            self.mapped = tuple(range(self.tp)) if peer_mapped else (self.rank,)
        self.peer_mapped = len(self.mapped) == self.tp
        symmetric = len(self.mapped) > 1

        flag_words = sizes["flag_words"]
        self._data_offset = 0
        self._flag_offset = _align(sizes["data_bytes"])
        total = self._flag_offset + _align(flag_words * 4)
        if symmetric:
            import torch.distributed._symmetric_memory as symm_mem
            self._storage = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        else:  # local memory: the NCCL transport moves the chunks (no peer mapping, null peer pointers below)
            self._storage = torch.empty(total, dtype=torch.uint8, device=self.device)
        self._storage[self._flag_offset:].zero_()
        self.graph_protocol = graph_protocol
        if graph_protocol:  # the handshake words start set: "the previous call finished"
            begin = sizes["handshake_begin"]
            self._storage[self._flag_offset:].view(torch.int32)[begin:begin + sizes["handshake_words"]] = 1
        torch.cuda.current_stream().synchronize()
        self._handle = None
        self._peer_storage: dict[int, torch.Tensor] = {}  # mapped peers' allocations, as this rank sees them
        if symmetric:
            map_group = self.group
            if not self.peer_mapped:
                from flux_layers.runtime.multinode import node_group
                map_group = node_group.node_group(self.group, self.mapped)
            handle = symm_mem.rendezvous(self._storage, map_group)
            offset = self._storage.data_ptr() - handle.buffer_ptrs[self.mapped.index(self.rank)]
            offsets = [None] * len(self.mapped)
            dist.all_gather_object(offsets, offset, group=map_group)
            if len(set(offsets)) != 1:
                raise RuntimeError(f"{what}: symmetric allocations are not at the same offset on every rank "
                                   f"({offsets}); create workspaces in the same order on every rank")
            self._handle = handle
            from flux_layers.runtime.multinode.node_group import mapped_pointers
            self.base_ptrs = mapped_pointers(self.tp, self.mapped, list(handle.buffer_ptrs), offset)
            self._peer_storage = {q: handle.get_buffer(i, (total,), torch.uint8, storage_offset=offset)
                                  for i, q in enumerate(self.mapped) if q != self.rank}
        else:
            self.base_ptrs = [self._storage.data_ptr() if q == self.rank else 0 for q in range(self.tp)]
        self.data_ptrs = [p + self._data_offset if p else 0 for p in self.base_ptrs]
        self.flag_ptrs = [p + self._flag_offset if p else 0 for p in self.base_ptrs]
        self.flags = self._storage[self._flag_offset:self._flag_offset + flag_words * 4].view(torch.int32)
        self._peer_flags = {q: t[self._flag_offset:self._flag_offset + flag_words * 4].view(torch.int32)
                            for q, t in self._peer_storage.items()}
        self.comm_streams = [torch.cuda.Stream(device=self.device, priority=-1) for _ in range(num_comm_streams)]
        self.error_record = torch.zeros(ERROR_RECORD_WORDS, dtype=torch.int32, pin_memory=True)
        self.error_claim = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._timeout_s = _env.get_float("TIMEOUT_S")
        if not self._timeout_s > 0:
            raise ValueError(f"FLUX_LAYERS_TIMEOUT_S must be positive, got {self._timeout_s:g}")
        self.what = what + (" (CUDA-graph twin)" if graph_protocol else "")
        self.graph_twin: Workspace | None = None
        self.retired = False  # replaced by a larger workspace (the calls decided on this one were dropped)
        self._plans: dict[AgCallPlan | RsCallPlan, int] = {}
        self._plans_lock = threading.Lock()
        self.native = torch.classes.flux_layers.NativeWorkspace(
            kind=kind, dtype=dtype_name(dtype), rank=self.rank, device=self.device.index, max_m=max_m, inner=inner,
            capacity=sizes["capacity"], data_ptrs=self.data_ptrs, flag_ptrs=self.flag_ptrs,
            comm_streams=[s.cuda_stream for s in self.comm_streams],
            error_ptrs=[self.error_record.data_ptr(), self.error_claim.data_ptr()], graph_protocol=graph_protocol,
            timeout_s=self._timeout_s, poison_outputs=_env.get("POISON_OUTPUTS") == "1", what=self.what)
        self.handle = self.native.handle()  # what the ops take (the object lives as long as this workspace)
        # The native state outlives nothing it points into (a release of its flags may still be in flight when Python
        # drops this workspace, attributes in any order).
        self.native.keep_memory([self._storage, self.error_record, self.error_claim])
        # The native state is freed by close() or, at the latest, when this object goes: never by the native
        # object's destructor, which Python would run holding the GIL through the device synchronization of that
        # free, while the GPU may wait on a Python thread (the host-staged stand-in).
        self._closer = weakref.finalize(self, self.native.close)
        dist.barrier(group=self.group)  # every rank's flags are zero before anyone signals

    def close(self) -> None:
        """Free the native state (and the twin's) now; its memory goes with this object. Only once no call on it is
        in flight on any rank (:func:`reset` closes the workspaces it forgets after its barrier; an outgrown one
        closes when its last reference goes). Its handle is unknown to the ops afterwards."""
        self._closer()
        if self.graph_twin is not None:
            self.graph_twin.close()

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    @property
    def over_nccl(self) -> bool:
        """Whether chunks move over NCCL: the workspace is not mapped by every peer (local memory: both ops' NCCL
        transports; mapped inside the node only: the hybrid all-gather; topology.rs_over_nccl and backend.over_nccl
        decide it)."""
        return not self.peer_mapped

    def peer_flags(self, q: int) -> torch.Tensor:
        """Mapped peer ``q``'s flag words as this rank sees them (where the host writes them: the hybrid
        all-gather)."""
        return self._peer_flags[q]

    def new_graph_twin(self) -> Workspace:
        """A workspace of the same size under the CUDA-graph flag protocol (a collective; see the module
        docstring)."""
        raise NotImplementedError

    # ---- plans and flags
    def plan_index(self, plan: AgCallPlan | RsCallPlan) -> int:
        """The index of ``plan`` in this workspace, registered (by name) once (and with the CUDA-graph twin, which
        runs every plan of the workspace under the same index)."""
        index = self._plans.get(plan)
        if index is None:
            with self._plans_lock:
                index = self._plans.get(plan)
                if index is None:
                    add = getattr(self.native, plan.native_method)
                    index = self._plans[plan] = add(**plan.native_fields())
        return index

    def flag_index(self, region: str, rank: int, chunk: int = 0) -> int:
        """Index in :attr:`flags` of one word of a region of this rank's flags, as the op library lays them out:
        all-gather 'chunk' / 'avail' (``rank``: the shard), 'done' / 'signature' (the peer); reduce-scatter 'flag'
        (the source), 'count' (the destination), 'consumed' / 'signature' (the peer)."""
        return self.native.flag_index(region=region, rank=rank, chunk=chunk)

    @property
    def epoch(self) -> int:
        """The epoch of the last call (the number of calls under the epoch protocol)."""
        return self.native.epoch()

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        """Bound of this workspace's waits from the next call on."""
        self.native.set_timeout(float(seconds))
        self._timeout_s = float(seconds)

    # ---- errors
    def _describe(self) -> str | None:
        return self.native.failure() or None

    def raise_if_failed(self) -> None:
        """Raise WorkspaceError if any earlier call recorded a timeout (reads host memory; no sync)."""
        failed = self._describe()
        if failed is not None:
            raise WorkspaceError(failed)

    def check(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) for the work queued so far on the current stream; raise if a wait timed out.

        Unlike torch.cuda.synchronize(), this never hangs on a peer that does not come: it polls, and after
        a timeout it releases this rank's stream waits so the device can drain, then raises.
        """
        limit = self.timeout_s * 2 + 5 if timeout_s is None else timeout_s
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + limit
        while not done.query():
            if self._describe() is not None or time.monotonic() > deadline:
                self.release()
                break
            time.sleep(1e-3)
        self.raise_if_failed()
        if not done.query():
            raise WorkspaceError(f"{self.what}: work did not finish within {limit:g} s on rank {self.rank} "
                                 f"(epoch {self.epoch}); waits were released and the workspace is unusable")

    def release(self) -> None:
        """Refuse further calls (after a failure); the native watchdog then releases this rank's waits at its next
        poll (20 ms): the error claim set, so that the kernels of the calls already enqueued yield NaN, then every
        flag of this rank at its maximum, so that the stream waits on them return. No CUDA call here."""
        self.native.mark_failed(f"{self.what}: released after a failed or abandoned call")


AG_TRANSPORTS = ("copy_engine", "nccl", "hybrid")  # what moves the all-gather's chunks (topology.ag_transport)


class AgWorkspace(Workspace):
    """AllGather+GEMM: a gathered-input buffer [max_m, k] per rank + chunk/avail/done flags (AgFlagLayout).

    ``transport``: 'copy_engine' (symmetric memory, the op's copy-engine transfers), 'nccl' (local memory; the
    chunks arrive by NCCL, flux_layers/runtime/multinode/nccl_transport.py, driven from :attr:`transfer_stream`) or
    'hybrid' (symmetric memory mapped inside this rank's node only: NCCL between nodes and host-driven copy-engine
    pushes inside the node, both from :attr:`transfer_stream`; the node members are fixed here, from the declared
    node size)."""

    def __init__(self, group, dtype: torch.dtype, max_m: int, k: int, *, chunk_capacity: int = 16,
                 graph_protocol: bool = False, transport: str = "copy_engine"):
        tp = dist.get_world_size(group)
        if max_m <= 0 or max_m % tp != 0:
            raise ValueError(f"AgWorkspace: max_m={max_m} must be a positive multiple of the group size {tp}")
        if transport not in AG_TRANSPORTS:
            raise ValueError(f"AgWorkspace: transport must be one of {AG_TRANSPORTS}, got {transport!r}")
        if transport != "copy_engine" and graph_protocol:
            raise ValueError(f"AgWorkspace: the {transport} transport has no CUDA-graph twin (captured calls are "
                             "refused)")
        self.dtype, self.max_m, self.k, self.chunk_capacity = dtype, max_m, k, chunk_capacity
        self.transport = transport
        external = transport != "copy_engine"  # the chunks are moved from the host, the GEMM in external mode
        members = None
        if transport == "hybrid":
            from flux_layers.runtime.multinode.node_group import node_members
            members = node_members(topology.group_node_ids(group), dist.get_rank(group))
        _library.require()
        sizes = torch.ops.flux_layers.ag_workspace_layout(tp=tp, max_m=max_m, k=k, chunk_capacity=chunk_capacity,
                                                          dtype=dtype_name(dtype))
        super().__init__(group, kind="ag_gemm", sizes=sizes, num_comm_streams=1 if external else tp, what="ag_gemm",
                         graph_protocol=graph_protocol, dtype=dtype, max_m=max_m, inner=k,
                         peer_mapped=transport == "copy_engine", node_members=members)
        elem = torch.tensor([], dtype=dtype).element_size()
        self.buffer = self._storage[:max_m * k * elem].view(dtype).view(max_m, k)
        # Each mapped peer's gathered buffer as this rank sees it (what the hybrid transport's pushes write into).
        self.peer_buffers = {q: t[:max_m * k * elem].view(dtype).view(max_m, k) for q, t in self._peer_storage.items()}
        # FP8 rows: the scale region (the op library's, from scale_offset to the end of the data; a call's scales at
        # scale_index), this rank's and each mapped peer's as this rank sees it; None and {} for 16-bit rows.
        def scale_region(storage: torch.Tensor) -> torch.Tensor:
            return storage[sizes["scale_offset"]:sizes["data_bytes"]].view(torch.float32)
        fp8_rows = sizes["scale_offset"] > 0
        self.scales = scale_region(self._storage) if fp8_rows else None
        self.peer_scales = {q: scale_region(t) for q, t in self._peer_storage.items()} if fp8_rows else {}
        # The host-driven transfers' stream: forked from the compute stream before each call's GEMM, joined after.
        self.transfer_stream = torch.cuda.Stream(device=self.device, priority=-1) if external else None
        devices = [None] * self.tp
        dist.all_gather_object(devices, torch.cuda.current_device(), group=self.group)
        self.devices = tuple(devices)
        self._layouts: dict[tuple[int, str], object] = {}

    def scale_index(self, epoch: int, shard: int, per_shard: int) -> int:
        """FP8 rows: where shard ``shard``'s scales of the call of ``epoch`` start in :attr:`scales` (and in a peer's
        :attr:`peer_scales`) for calls of ``per_shard`` scales per shard (1, or the shard's rows): the op library's
        layout."""
        return self.native.scale_index(epoch=epoch, shard=shard, per_shard=per_shard)

    @property
    def layout(self):
        """The group's transfer_plan.GroupLayout (nodes from the declared node size and the members' global ranks,
        peer access and NUMA nodes from this host, by device index; nodes are taken to be alike), for the node size
        and NUMA map set now (FLUX_LAYERS_NODE_SIZE, FLUX_LAYERS_NUMA_MAP: a change counts from the next call)."""
        key = (topology.declared_node_size(), _env.get("NUMA_MAP"))
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = topology.group_layout(self.devices, topology.group_node_ids(self.group))
        return found

    @property
    def order(self) -> str:
        """'mesh' or 'ring': detected from the topology unless FLUX_LAYERS_AG_ORDER forces one."""
        return topology.ag_order(self.devices)

    def input_buffer(self, m: int) -> torch.Tensor:
        """This rank's rows [m/tp, k] of the gathered buffer: write x here and the op skips its staging copy."""
        if m % self.tp != 0 or m > self.max_m:
            raise ValueError(f"input_buffer: m={m} must be a multiple of {self.tp} and at most {self.max_m}")
        rows = m // self.tp
        return self.buffer[self.rank * rows:(self.rank + 1) * rows]

    def new_graph_twin(self) -> AgWorkspace | None:
        if self.transport != "copy_engine":
            return None  # captured calls are refused (nccl_transport.CAPTURE_REFUSAL)
        return AgWorkspace(self.group, self.dtype, self.max_m, self.k, chunk_capacity=self.chunk_capacity,
                           graph_protocol=True)


class RsWorkspace(Workspace):
    """GEMM+ReduceScatter: receive slots [tp][max_m/tp][n] per rank + per-chunk flags, consumed flags and the
    copy-engine transport's chunk counts (csrc/runtime/gemm_rs.cpp); one comm stream per peer and, once the
    copy-engine transport is used, a local staging area of one slot per peer.

    ``over_nccl``: the NCCL transport's workspace (flux_layers/runtime/multinode/nccl_rs_transport.py): local memory,
    the staging area at once, and one stream, :attr:`transfer_stream`, on which the partials move (the op forks it).
    ``hybrid``: the hybrid transport's (two-level, the node partials: flux_layers/ops/fused_gemm_rs.py): as the NCCL
    one, but mapped inside this rank's node (the node members fixed here, from the declared node size).
    (Both workspaces answer :attr:`Workspace.over_nccl`; an AgWorkspace's follows its ``transport``, since it serves
    one, where the reduce-scatter's peer-mapped one serves both the epilogue and the copy-engine transports.)"""

    def __init__(self, group, dtype: torch.dtype, max_m: int, n: int, *, min_tile: int = 128,
                 graph_protocol: bool = False, over_nccl: bool = False, hybrid: bool = False):
        tp = dist.get_world_size(group)
        if max_m <= 0 or max_m % tp != 0:
            raise ValueError(f"RsWorkspace: max_m={max_m} must be a positive multiple of the group size {tp}")
        if over_nccl and hybrid:
            raise ValueError("RsWorkspace: over_nccl and hybrid are two transports; ask for one")
        if (over_nccl or hybrid) and graph_protocol:
            raise ValueError("RsWorkspace: the NCCL and hybrid transports have no CUDA-graph twin (captured calls are "
                             "refused)")
        members = None
        if hybrid:
            from flux_layers.runtime.multinode.node_group import node_members
            members = node_members(topology.group_node_ids(group), dist.get_rank(group))
        self.dtype, self.max_m, self.n, self.min_tile = dtype, max_m, n, min_tile
        _library.require()
        # Enough tile flags for the smallest tile in either dimension (the op library's layout).
        sizes = torch.ops.flux_layers.rs_workspace_layout(tp=tp, max_m=max_m, n=n, min_tile=min_tile,
                                                          dtype=dtype_name(dtype))
        self.slot_rows, self.flags_per_source = sizes["slot_rows"], sizes["capacity"]
        self._stage_bytes = sizes["stage_bytes"]
        external = over_nccl or hybrid  # the op forks the caller's transfer stream
        super().__init__(group, kind="gemm_rs", sizes=sizes, num_comm_streams=1 if external else tp - 1,
                         what="gemm_rs", graph_protocol=graph_protocol, dtype=dtype, max_m=max_m, inner=n,
                         peer_mapped=not external, node_members=members)
        self.hybrid = hybrid
        # This rank's receive slots: slot s holds source s's partial of our rows.
        self.recv = self._storage[:sizes["data_bytes"]].view(dtype).view(tp, self.slot_rows, n)
        self._stage: torch.Tensor | None = None
        self._stage_slots: dict[int, torch.Tensor] = {}
        # The NCCL transfers' stream (comm stream 0): the op forks it from the compute stream, the caller joins it.
        self.transfer_stream = self.comm_streams[0] if external else None
        if external:
            self.stage_buffer()

    def count_index(self, dst: int, chunk: int) -> int:
        """Index in :attr:`flags` of this rank's count of its tiles of chunk ``chunk`` of ``dst``'s rows."""
        return self.flag_index("count", dst, chunk)

    def partial_flag_index(self, src: int, chunk: int) -> int:
        """Index in :attr:`flags` of the flag of ``src``'s partial of chunk ``chunk`` of this rank's rows."""
        return self.flag_index("flag", src, chunk)

    def stage_slot(self, dst: int) -> torch.Tensor:
        """The staging slot [max_m/tp, n] of this rank's partial of ``dst``'s rows (slots in the kernel's
        destination order, rank+1 first: the op library's layout)."""
        if not self._stage_slots:
            stage = self.stage_buffer().view(self.tp - 1, self.slot_rows, self.n)
            self._stage_slots = {d: stage[self.native.stage_slot(dst=d)] for d in range(self.tp) if d != self.rank}
        return self._stage_slots[dst]

    def stage_buffer(self) -> torch.Tensor:
        """Local staging area of the copy-engine transport, [(tp - 1) * max_m/tp * n] (a slot per peer, in the
        kernel's destination order), allocated on first use."""
        if self._stage is None:
            self._stage = torch.empty(self._stage_bytes, dtype=torch.uint8, device=self.device).view(self.dtype)
            self.native.set_stage(self._stage.data_ptr())
            self.native.keep_memory([self._stage])
        return self._stage

    def new_graph_twin(self) -> RsWorkspace | None:
        if self.over_nccl:
            return None  # captured calls are refused (nccl_rs_transport.CAPTURE_REFUSAL)
        twin = RsWorkspace(self.group, self.dtype, self.max_m, self.n, min_tile=self.min_tile, graph_protocol=True)
        twin.stage_buffer()  # now, not from a graph's memory pool during capture
        return twin


_cache: dict[_Key, Workspace] = {}
_retired: list[Workspace] = []  # outgrown workspaces with CUDA-graph twins (graphs may replay on them)
_cache_lock = threading.Lock()
_cuda_graphs = False  # enable_cuda_graphs() was called


def cuda_graphs_enabled() -> bool:
    """Whether workspaces are created with a CUDA-graph twin (FLUX_LAYERS_CUDA_GRAPHS=1 or enable_cuda_graphs())."""
    return _cuda_graphs or _env.get("CUDA_GRAPHS") == "1"


def enable_cuda_graphs() -> None:
    """Create every workspace from now on with its CUDA-graph twin (see the module docstring). Call it on every
    rank, before the warm-up step that creates the workspaces."""
    global _cuda_graphs
    _cuda_graphs = True


def _make_twin(ws: Workspace) -> None:
    ws.graph_twin = ws.new_graph_twin()
    if ws.graph_twin is not None:  # None: the workspace's transport refuses captured calls
        ws.native.set_twin(ws.graph_twin.native)  # the op takes the twin's state while the stream is being captured


def prepare_cuda_graphs() -> None:
    """Enable CUDA graphs and give every cached workspace its twin now (a collective: call it on every rank,
    outside capture, e.g. between the warm-up step and the capture)."""
    _refuse_under_capture("prepare_cuda_graphs")
    enable_cuda_graphs()
    with _cache_lock:
        for ws in _cache.values():  # insertion order: the same on every rank
            if ws.graph_twin is None:
                _make_twin(ws)


def _refuse_under_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: a fused operator's workspace (symmetric memory, a collective) cannot be "
                           "created while a CUDA graph is being captured; run the captured step once eagerly "
                           "first (warm-up) with CUDA graphs enabled (FLUX_LAYERS_CUDA_GRAPHS=1 or "
                           "flux_layers.runtime.workspace.enable_cuda_graphs())")


def for_current_stream(ws: Workspace) -> Workspace:
    """The workspace a call on the current stream uses: ``ws``, or its CUDA-graph twin while capturing."""
    if ws.graph_protocol or not torch.cuda.is_current_stream_capturing():
        return ws
    if ws.graph_twin is None:
        _refuse_under_capture(f"{ws.what} (max_m={ws.max_m}) has no CUDA-graph twin:")
    return ws.graph_twin


def _group_name(group) -> str:
    return group.group_name if group is not None else dist.group.WORLD.group_name


GROWTH = 1.5  # an outgrown workspace is replaced by one this much larger (at least the call's M)
GROWTH_ALIGN = 128  # rows per rank the new size is rounded up to (the tile height)
_on_retire: list = []  # on_retire's callbacks


def on_retire(callback) -> None:
    """Call ``callback(ws)`` whenever a cached workspace is retired (replaced by a larger one, or forgotten by
    :func:`reset`), so that what was decided on it can be dropped (flux_layers.ops does). Once per callback."""
    if callback not in _on_retire:
        _on_retire.append(callback)


def grown_max_m(m: int, old_max_m: int, tp: int) -> int:
    """The max_m of the workspace that replaces one of ``old_max_m`` rows for a call of ``m``: ``GROWTH`` times
    larger and at least ``m``, rounded up to ``GROWTH_ALIGN`` rows per rank (fewer re-creations as M creeps up)."""
    want = max(m, int(old_max_m * GROWTH)) if old_max_m else m
    step = GROWTH_ALIGN * tp
    return -(-want // step) * step


def _check_cap(what: str, max_m: int, row_bytes: int) -> None:
    cap_gib = _env.get_float("WORKSPACE_MAX_GIB")
    need_gib = max_m * row_bytes / 2**30
    if cap_gib > 0 and need_gib > cap_gib:
        raise RuntimeError(f"{what}: a workspace for M={max_m} needs {need_gib:.2f} GiB of symmetric memory, over "
                           f"FLUX_LAYERS_WORKSPACE_MAX_GIB={cap_gib:g}; raise the cap or call with fewer rows")


def _cached(op: str, group, dtype: torch.dtype, inner: int, m: int, make, tp: int = 1) -> Workspace:
    """The cached workspace for (group, op, dtype, inner), re-created (collectively) larger if ``m`` exceeds it
    (:func:`grown_max_m`); every rank sees the same M, so every rank re-creates it in the same call.

    The outgrown workspace is freed once no stream uses it: this rank synchronizes its device first, and the new
    workspace's creation ends with a barrier, so every rank is past its calls on the old one (its peers' writes
    into this rank's buffer included). One with a CUDA-graph twin is kept: captured graphs may still replay on it.
    """
    key = _Key(_group_name(group), op, dtype, inner)
    with _cache_lock:
        ws = _cache.get(key)
        if ws is None or ws.max_m < m:
            _refuse_under_capture(f"{op} workspace for M={m}")
            max_m = grown_max_m(m, ws.max_m if ws is not None else 0, tp)
            _check_cap(f"{op} (K or N = {inner}, {dtype})", max_m, inner * torch.tensor([], dtype=dtype).element_size())
            old = ws
            if old is not None and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            ws = make(max_m)
            if cuda_graphs_enabled():
                _make_twin(ws)
            _cache[key] = ws
            if old is not None:
                old.retired = True
                if old.graph_twin is not None:
                    _retired.append(old)
                for callback in _on_retire:
                    callback(old)
        return ws


def get_ag_workspace(group, dtype: torch.dtype, m: int, k: int, transport: str = "copy_engine") -> AgWorkspace:
    """The cached all-gather workspace for (group, dtype, k, transport), grown if m exceeds it (M = 0 gets the
    smallest)."""
    tp = dist.get_world_size(group)
    op = "ag" if transport == "copy_engine" else f"ag_{transport}"
    return _cached(op, group, dtype, k, max(m, tp),
                   lambda max_m: AgWorkspace(group, dtype, max_m, k, transport=transport), tp)


def get_rs_workspace(group, dtype: torch.dtype, m: int, n: int, over_nccl: bool = False,
                     hybrid: bool = False) -> RsWorkspace:
    """The cached reduce-scatter workspace for (group, dtype, n), grown if m exceeds it (M = 0 gets the smallest);
    ``over_nccl``: the NCCL transport's (local memory), ``hybrid``: the hybrid transport's (mapped inside the node),
    each cached apart."""
    tp = dist.get_world_size(group)
    return _cached("rs_hybrid" if hybrid else "rs_nccl" if over_nccl else "rs", group, dtype, n, max(m, tp),
                   lambda max_m: RsWorkspace(group, dtype, max_m, n, over_nccl=over_nccl, hybrid=hybrid), tp)


def check_graph_replays() -> None:
    """Raise :class:`WorkspaceError` if a CUDA-graph twin recorded a failure during a replay (a wait that timed out,
    a peer's call out of step). Replays run no host code, so this (a read of host memory, no synchronization; e.g.
    once per step after the replays) and the next eager call on the workspace are where such a failure surfaces; the
    twin's later replays run through (the watchdog keeps it released) and their outputs are NaN."""
    for ws in list(_cache.values()) + _retired:
        if ws.graph_twin is not None:
            ws.graph_twin.raise_if_failed()


def reset() -> None:
    """The collective reset after a :class:`WorkspaceError` (a peer that stopped calling for longer than the timeout,
    ranks whose calls went out of step): every rank of every group with a cached workspace calls it, outside capture.

    Each cached workspace (its CUDA-graph twin, and outgrown workspaces kept for graphs, too) releases this rank's
    stream waits, so that the device drains; the device is synchronized; the workspaces and the calls decided on them
    are forgotten; then a barrier per group makes sure that no peer still writes into them before they are freed. The
    next fused calls create fresh workspaces (collectively, as the first ones). CUDA graphs captured on the old
    workspaces must be captured again. A reset cannot recover from a dead peer (the barrier needs every rank): restart
    the job then.
    """
    _refuse_under_capture("reset")
    with _cache_lock:
        old = list(_cache.values()) + _retired
        groups: list = []
        for ws in old:
            for w in (ws, ws.graph_twin):
                if w is not None:
                    w.release()
            if not any(ws.group is g for g in groups):
                groups.append(ws.group)
        if old:
            torch.cuda.synchronize()
        _cache.clear()
        _retired.clear()
    for ws in old:
        ws.retired = True
        for callback in _on_retire:
            callback(ws)
    for group in groups:  # every peer is past its calls on the old workspaces before they are freed
        dist.barrier(group=group)
    for ws in old:
        ws.close()


def clear_cache() -> None:
    """Forget the cached workspaces (the caller guarantees no call on them is in flight on any rank)."""
    with _cache_lock:
        _cache.clear()
        _retired.clear()
