"""Where the GPUs of a TP group sit, and which all-gather order fits them (design.md §2):

| link | order |
|---|---|
| one node, every pair of GPUs peer-accessible over NVLink (NVSwitch or full NV# mesh) | ``mesh``: all peers at once |
| one node, PCIe only, or not every pair linked | ``ring``: each step forwards one shard to the next rank |
| several nodes, NVLink inside each | ``internode``: inter-node chunks (NCCL) overlapped with the intra-node exchange |
| several nodes, PCIe inside each, two NUMA domains per node | ``numa2d``: inter-NUMA first, then intra-NUMA |

Transports (:func:`ag_transport`): the copy engine between peer-mapped GPUs of one node (orders ``mesh`` and
``ring``; csrc/runtime/ag_gemm.cpp), and NCCL send/recv through the group's process group for a group that spans
nodes or whose GPUs cannot map each other's memory, or when ``FLUX_LAYERS_TRANSPORT=nccl`` (every order of
transfer_plan.py, every transfer on NCCL; flux_layers/runtime/multinode/nccl_transport.py). Forced
``FLUX_LAYERS_TRANSPORT=hybrid`` (not yet run on GPUs, so never chosen by itself), a group over several nodes with
peer access inside each moves its chunks by NCCL between nodes and by host-driven copy-engine pushes inside them
(``nccl_transport.hybrid_plan``; the workspace mapped inside the node). The reduce-scatter
(:func:`rs_over_nccl`) moves its partials by the epilogue's stores or the copy engine between peer-mapped GPUs of
one node, and by NCCL (flux_layers/runtime/multinode/nccl_rs_transport.py) only when ``FLUX_LAYERS_TRANSPORT=nccl``:
that path has not run on GPUs yet, so a group that spans nodes or lacks peer access keeps the reference path for it
unless NCCL is forced. :func:`fused_path_blocker` names what keeps the fused kernels from serving a group.

Inputs, each detected unless given or forced (``FLUX_LAYERS_*``, flux_layers/_env.py):
- node boundaries (:func:`declared_node_size`): ``FLUX_LAYERS_NODE_SIZE=N`` (rank // N is the node; emulates
  nodes on one machine), else torchrun's ``LOCAL_WORLD_SIZE`` where the job spans nodes, else one node;
  :func:`gather_hostnames` gives the ranks sharing a hostname where a caller wants that instead (a collective);
- peer access: ``torch.cuda.can_device_access_peer`` per pair of a node; NVLink: NVML (``nvidia-ml-py``) when
  present, else peer access stands for it (as before);
- NUMA node of each GPU: ``FLUX_LAYERS_NUMA_MAP`` (one id per local rank), else NVML's
  ``nvmlDeviceGetNumaNodeId``, else ``/sys/bus/pci/devices/<bus id>/numa_node``;
- order: ``FLUX_LAYERS_AG_ORDER``; transport: ``FLUX_LAYERS_TRANSPORT``.
NOTE: peer access, NVLink and NUMA are queried on this host for the devices of every node, by device index: the
nodes of a group are assumed alike (every rank of a real multi-node job sees only its own node).
Every function takes explicit arguments so that CPU tests need no GPU.
"""
from __future__ import annotations

import functools
import os
import socket
from typing import Sequence

import torch

from flux_layers import _env
from flux_layers.runtime.multinode.transfer_plan import GroupLayout, choose_order, choose_transport

# Orders the copy-engine all-gather executes (csrc/runtime/ag_gemm.cpp); the NCCL transport executes every order
# of transfer_plan.py (flux_layers/runtime/multinode/nccl_transport.py).
BUILT_ORDERS = ("mesh", "ring")


def _nvlink_pairs(devices: list[int]) -> bool | None:
    """True if every pair of devices has an active NVLink between them; None if NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(d) for d in devices]
        for i, a in enumerate(handles):
            for b in handles[i + 1:]:
                status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                if status != pynvml.NVML_P2P_STATUS_OK:
                    return False
        return True
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def peer_access_matrix(devices: tuple[int, ...]) -> tuple[tuple[bool, ...], ...]:
    """m[a][b]: device devices[a] can map devices[b]'s memory (the diagonal is True). Cached: call
    ``peer_access_matrix.cache_clear()`` after changing what torch.cuda reports (tests)."""
    return tuple(tuple(a == b or torch.cuda.can_device_access_peer(a, b) for b in devices) for a in devices)


def _all_peer_access(devices: list[int]) -> bool:
    m = peer_access_matrix(tuple(devices))
    return all(all(row) for row in m)


@functools.lru_cache(maxsize=None)
def detect_order(devices: tuple[int, ...]) -> str:
    """'mesh' or 'ring' for GPUs `devices` of this node (no override applied)."""
    if len(devices) <= 2:
        return "mesh"  # with two ranks both orders move the same bytes once; mesh needs no forwarding
    nvlink = _nvlink_pairs(list(devices))
    if nvlink is None:
        nvlink = _all_peer_access(list(devices))
    return "mesh" if nvlink else "ring"


def _sysfs_bus_id(bus_id: str) -> str:
    """'00000000:18:00.0' (NVML) or '0000:18:00.0' -> sysfs' '0000:18:00.0' (4-digit domain, lower case)."""
    domain, rest = bus_id.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def numa_node(device: int, sysfs_root: str = "/sys/bus/pci/devices") -> int:
    """NUMA node of CUDA device `device`: NVML when it knows, else sysfs by the PCI bus id; -1 if unknown."""
    bus_id = None
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        if hasattr(pynvml, "nvmlDeviceGetNumaNodeId"):
            node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
            if node >= 0:
                return node
        bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
        bus_id = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    except Exception:
        pass
    if bus_id is None:
        try:
            p = torch.cuda.get_device_properties(device)
            bus_id = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        except Exception:
            return -1
    try:
        with open(os.path.join(sysfs_root, _sysfs_bus_id(bus_id), "numa_node")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def parse_numa_map(raw: str, node_size: int) -> tuple[int, ...] | None:
    """FLUX_LAYERS_NUMA_MAP's value: one NUMA id per local rank (None when empty)."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        ids = tuple(int(v) for v in raw.split(","))
    except ValueError:
        raise ValueError(f"FLUX_LAYERS_NUMA_MAP={raw!r} must be comma-separated integers (one per local "
                         "rank)") from None
    if len(ids) != node_size:
        raise ValueError(f"FLUX_LAYERS_NUMA_MAP={raw!r} names {len(ids)} NUMA nodes for {node_size} ranks per node")
    return ids


def node_ids(tp: int, hostnames: Sequence[str] | None = None, node_size: int | None = None,
             ranks: Sequence[int] | None = None) -> tuple[int, ...]:
    """Node id of each of the `tp` ranks of a group, numbered 0.. by first appearance. ``node_size`` (None:
    :func:`declared_node_size`; 0: detect) > 0: global rank // node_size is the node (``ranks``: the members' global
    ranks, default 0..tp-1, so a group smaller than a node sits in one); else ranks sharing a hostname form one
    node; else every rank is on node 0."""
    size = declared_node_size() if node_size is None else node_size
    if size < 0:
        raise ValueError(f"FLUX_LAYERS_NODE_SIZE={size} must be 0 (detect) or a positive number of ranks per node")
    if size > 0:
        ranks = tuple(ranks) if ranks is not None else tuple(range(tp))
        if len(ranks) != tp:
            raise ValueError(f"node_ids: {len(ranks)} global ranks for {tp} ranks")
        keys = [r // size for r in ranks]
    elif hostnames is not None:
        if len(hostnames) != tp:
            raise ValueError(f"node_ids: {len(hostnames)} hostnames for {tp} ranks")
        keys = list(hostnames)
    else:
        return (0,) * tp
    first: dict = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


_node_ids = node_ids  # fused_path_blocker's argument shadows the name


def declared_node_size() -> int:
    """Ranks per node as declared, without a collective: FLUX_LAYERS_NODE_SIZE when set (> 0); else torchrun's
    LOCAL_WORLD_SIZE where it is smaller than its WORLD_SIZE (a job over several nodes; torchrun numbers the
    ranks node by node); else 0 (nothing declared)."""
    size = _env.get_int("NODE_SIZE")
    if size != 0:
        return size
    try:
        local, world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")), int(os.environ.get("WORLD_SIZE", "0"))
    except ValueError:
        return 0
    return local if 0 < local < world and world % local == 0 else 0


def group_node_ids(group) -> tuple[int, ...]:
    """Node id of each rank of `group` from the declared node size (:func:`declared_node_size`) and the members'
    global ranks; every rank on node 0 where nothing is declared."""
    import torch.distributed as dist
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return node_ids(len(ranks), ranks=ranks)


def gather_hostnames(group) -> tuple[str, ...]:
    """Every rank's hostname (a collective over `group`); feed it to :func:`node_ids`."""
    import torch.distributed as dist
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return tuple(names)


def group_layout(devices: Sequence[int], node_of: Sequence[int] | None = None, *,
                 numa_of: Sequence[int] | None = None, peer: Sequence[Sequence[bool]] | None = None,
                 nvlink: bool | None = None) -> GroupLayout:
    """The GroupLayout of a group whose rank r runs on CUDA device devices[r]; what is not given is detected
    (node_of: :func:`node_ids` without hostnames; numa_of: FLUX_LAYERS_NUMA_MAP, else :func:`numa_node`; peer:
    :func:`peer_access_matrix` per node; nvlink: NVML, else every intra-node pair peer-mapped)."""
    devices = tuple(devices)
    tp = len(devices)
    node_of = tuple(node_of) if node_of is not None else node_ids(tp)
    if len(node_of) != tp:
        raise ValueError(f"group_layout: {len(node_of)} node ids for {tp} ranks")
    nodes = sorted(set(node_of))
    members = {n: [r for r in range(tp) if node_of[r] == n] for n in nodes}
    if peer is None:
        rows = [[False] * tp for _ in range(tp)]
        for ranks in members.values():
            m = peer_access_matrix(tuple(devices[r] for r in ranks))
            for i, a in enumerate(ranks):
                for j, b in enumerate(ranks):
                    rows[a][b] = a != b and m[i][j]
        peer = rows
    peer = tuple(tuple(bool(v) for v in row) for row in peer)
    if numa_of is None:
        size = tp // len(nodes) if tp % len(nodes) == 0 else 0
        forced = parse_numa_map(_env.get("NUMA_MAP"), size)
        if forced is not None:
            numa_of = [0] * tp
            for ranks in members.values():
                for i, r in enumerate(ranks):
                    numa_of[r] = forced[i]
        else:
            numa_of = [numa_node(d) for d in devices]
    if nvlink is None:
        first = [devices[r] for r in members[nodes[0]]]
        nvlink = _nvlink_pairs(first) if len(first) > 1 else True
        if nvlink is None:
            nvlink = all(peer[a][b] for ranks in members.values() for a in ranks for b in ranks if a != b)
    return GroupLayout(node_of=node_of, numa_of=tuple(numa_of), peer=peer, nvlink=nvlink)


def ag_order(group_devices: tuple[int, ...], node_of: Sequence[int] | None = None) -> str:
    """FLUX_LAYERS_AG_ORDER when forced; else, for a group inside one node (`node_of` None or one node, after
    FLUX_LAYERS_NODE_SIZE), :func:`detect_order` as before; for several nodes, transfer_plan.choose_order."""
    forced = _env.get("AG_ORDER")
    if forced != "auto":
        return forced
    if node_of is None and declared_node_size() > 0:
        node_of = node_ids(len(group_devices))
    if node_of is None or len(set(node_of)) <= 1:
        return detect_order(group_devices)
    return choose_order(group_layout(group_devices, node_of))


def transport_matrix(layout: GroupLayout) -> tuple[tuple[str | None, ...], ...]:
    """transport[src][dst] with FLUX_LAYERS_TRANSPORT applied (transfer_plan.choose_transport; ``hybrid`` is what
    ``auto`` picks per pair)."""
    forced = _env.get("TRANSPORT")
    return choose_transport(layout, "auto" if forced == "hybrid" else forced)


def ag_transport(devices: Sequence[int], node_ids: Sequence[int] | None = None) -> str:
    """How the fused all-gather of a group on CUDA devices `devices` (rank r on devices[r]) moves its chunks:
    FLUX_LAYERS_TRANSPORT when forced (``hybrid``: NCCL between nodes, the copy engine inside them), else ``nccl``
    where the group spans nodes (``node_ids``; None: :func:`node_ids` of ranks 0..tp-1) or two of its GPUs cannot
    map each other's memory, else ``copy_engine``. (A forced ``copy_engine`` or ``hybrid`` that cannot run is
    :func:`fused_path_blocker`'s to report.)"""
    # NOTE: groups that span nodes take ``nccl`` unless ``hybrid`` is forced, until the hybrid transport has run on
    # GPUs (tests/gpu/test_hybrid_transport_gpu.py).
    forced = _env.get("TRANSPORT")
    if forced != "auto":
        return forced
    devices = tuple(devices)
    if node_ids is None and len(devices) > 1:
        node_ids = _node_ids(len(devices))
    if node_ids is not None and len(set(node_ids)) > 1:
        return "nccl"
    m = peer_access_matrix(devices)
    return "copy_engine" if all(all(row) for row in m) else "nccl"


# Why a group without peer mapping (or across nodes) keeps the reference path for the reduce-scatter by default.
RS_NCCL_UNTRIED = ("its NCCL transport has not run on GPUs yet, so it is taken only when forced "
                   "(FLUX_LAYERS_TRANSPORT=nccl)")


def rs_over_nccl() -> bool:
    """Whether the fused GEMM+ReduceScatter moves its partials by NCCL: only where FLUX_LAYERS_TRANSPORT=nccl forces
    it; else through peer-mapped memory, by the epilogue or the copy engine (tuning.rs_transport's choice per shape),
    or, where FLUX_LAYERS_TRANSPORT=hybrid forces it for a group over several nodes (:func:`rs_two_level`), by both.
    Not chosen from the topology: where peer-mapped memory cannot serve the group, :func:`fused_path_blocker` sends
    the call to the reference path (:data:`RS_NCCL_UNTRIED`)."""
    return _env.get("TRANSPORT") == "nccl"


def rs_two_level(node_ids: Sequence[int] | None) -> bool:
    """Whether the fused GEMM+ReduceScatter of a group on nodes ``node_ids`` (None: one node) runs its two-level plan
    on the hybrid transport: the epilogue's stores inside each node, the node partials by NCCL between them
    (flux_layers/ops/fused_gemm_rs.py). Only where FLUX_LAYERS_TRANSPORT=hybrid forces it (not yet run on GPUs) and
    the group spans nodes; inside one node the peer-mapped transports serve it."""
    return _env.get("TRANSPORT") == "hybrid" and node_ids is not None and len(set(node_ids)) > 1


def _hybrid_blocker(devices: tuple[int, ...], node_ids: tuple[int, ...] | None, op: str) -> str | None:
    """Why ``op``'s hybrid transport cannot serve a group, or None: its workspace maps the memory of every node's
    ranks (runtime/workspace.py), so every pair inside a node needs peer access; the reduce-scatter's two-level plan
    also needs nodes of consecutive group ranks, alike in size."""
    node_of = node_ids if node_ids is not None else (0,) * len(devices)
    what = "all-gather" if op == "ag_gemm" else "reduce-scatter"
    if op == "gemm_rs":  # RsTwoLevel: rank = node * node_size + local
        size = len(node_of) // len(set(node_of))
        runs = [tuple(node_of[r:r + size]) for r in range(0, len(node_of), size)]
        if any(len(set(run)) != 1 or len(run) != size for run in runs) or len({run[0] for run in runs}) != len(runs):
            return (f"the group's nodes {tuple(node_of)} are not runs of consecutive ranks alike in size; the hybrid "
                    "reduce-scatter's two-level plan needs them (FLUX_LAYERS_TRANSPORT=nccl serves such groups)")
    for node in sorted(set(node_of)):
        ranks = [r for r in range(len(devices)) if node_of[r] == node]
        m = peer_access_matrix(tuple(devices[r] for r in ranks))
        for i, a in enumerate(ranks):
            for j, b in enumerate(ranks):
                if i != j and not (m[i][j] and m[j][i]):
                    return (f"GPUs {devices[a]} and {devices[b]} (ranks {a} and {b}, node {node}) cannot map each "
                            f"other's memory; the hybrid {what} (FLUX_LAYERS_TRANSPORT=hybrid) maps every pair "
                            "inside a node (FLUX_LAYERS_TRANSPORT=nccl serves such groups)")
    return None


def fused_path_blocker(devices: tuple[int, ...], node_ids: tuple[int, ...] | None = None, op: str = "ag_gemm"
                       ) -> str | None:
    """Why the fused kernels cannot serve `op` ('ag_gemm' or 'gemm_rs') for a group on CUDA devices `devices`
    (rank r on devices[r]), or None.

    The all-gather runs on the copy engine (one node, every pair peer-mapped, order 'mesh' or 'ring'), on NCCL
    (:func:`ag_transport`: any group, every order of transfer_plan.py, all transfers by NCCL) or, forced, on the
    hybrid transport (every pair inside a node peer-mapped). The reduce-scatter
    runs on NCCL for any group where FLUX_LAYERS_TRANSPORT=nccl (:func:`rs_over_nccl`), on the hybrid transport for
    a group over several nodes where FLUX_LAYERS_TRANSPORT=hybrid (:func:`rs_two_level`: every pair inside a node
    peer-mapped, nodes of consecutive ranks), else it needs the copy engine's conditions (:data:`RS_NCCL_UNTRIED`).
    Pass ``node_ids`` from :func:`node_ids` with the members' global ranks or :func:`gather_hostnames`; without them the
    declared node size (:func:`declared_node_size`) is applied to the group ranks 0..tp-1 (right for Megatron's aligned
    TP groups). Cheap after the first call for a group (the peer-access matrix is cached)."""
    devices = tuple(devices)
    if node_ids is None and len(devices) > 1:
        node_ids = _node_ids(len(devices))
    if node_ids is not None and len(node_ids) != len(devices):
        raise ValueError(f"fused_path_blocker: {len(node_ids)} node ids for {len(devices)} devices")
    if op == "ag_gemm":
        transport = ag_transport(devices, node_ids)
        if transport == "nccl":
            return None
        if transport == "hybrid":
            return _hybrid_blocker(devices, node_ids, op)
        order = _env.get("AG_ORDER")
        if order not in ("auto",) + BUILT_ORDERS:
            return (f"FLUX_LAYERS_AG_ORDER={order}: the copy-engine all-gather runs the orders {BUILT_ORDERS}; "
                    f"'{order}' runs on the NCCL transport (FLUX_LAYERS_TRANSPORT=nccl)")
    elif rs_over_nccl():
        return None
    elif rs_two_level(node_ids):
        return _hybrid_blocker(devices, node_ids, op)
    forced = " (FLUX_LAYERS_TRANSPORT=copy_engine)" if op == "ag_gemm" else f"; {RS_NCCL_UNTRIED}"
    nnodes = len(set(node_ids)) if node_ids is not None else 1
    if nnodes > 1:
        return (f"the TP group spans {nnodes} nodes ({len(devices) // nnodes} ranks each); {op}'s peer-mapped "
                "transports cannot cross nodes" + forced)
    m = peer_access_matrix(devices)
    for a in range(len(devices)):
        for b in range(len(devices)):
            if a != b and not (m[a][b] and m[b][a]):
                return (f"GPUs {devices[a]} and {devices[b]} (ranks {a} and {b}) cannot map each other's memory; "
                        f"{op}'s copy-engine and epilogue transports need peer access between every pair" + forced)
    return None
