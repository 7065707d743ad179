"""The ranks of a TP group that share this rank's node, and their own process group: what the hybrid all-gather's
workspace maps its symmetric memory over (CUDA IPC reaches the GPUs of one host only, so a rendezvous over a group
that spans nodes cannot succeed).

Members are group ranks (0..tp-1), in group order; the node group holds their global ranks. torch.distributed
numbers a new group's ranks in ascending global-rank order, so member i is rank i of the node group exactly when
the TP group's global ranks ascend with its group ranks (Megatron's TP groups do); :func:`node_group` checks it.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch.distributed as dist

_groups: dict[tuple[int, tuple[int, ...]], object] = {}  # by the world group's identity and the global ranks
_lock = threading.Lock()


def node_members(node_of: Sequence[int], rank: int) -> tuple[int, ...]:
    """The group ranks on ``rank``'s node (``node_of[r]``: the node of group rank r), in group order."""
    if not 0 <= rank < len(node_of):
        raise ValueError(f"node_members: rank {rank} outside [0, {len(node_of)})")
    return tuple(r for r, node in enumerate(node_of) if node == node_of[rank])


def mapped_pointers(tp: int, members: Sequence[int], node_pointers: Sequence[int], offset: int) -> list[int]:
    """A pointer per group rank into the allocation mapped over the node group: member i's is
    ``node_pointers[i] + offset`` (the node group's buffer pointers, in its rank order), every other rank's is 0
    (not mapped: its chunks come by NCCL)."""
    if len(node_pointers) != len(members):
        raise ValueError(f"mapped_pointers: {len(node_pointers)} node-group pointers for {len(members)} members")
    if any(not 0 <= m < tp for m in members) or len(set(members)) != len(members):
        raise ValueError(f"mapped_pointers: members {tuple(members)} are not distinct ranks of a group of {tp}")
    pointers = [0] * tp
    for member, base in zip(members, node_pointers):
        pointers[member] = base + offset
    return pointers


def node_group(group, members: Sequence[int]):
    """The process group of ``members`` (group ranks of ``group`` on one node, this rank among them), made once and
    cached: only the members take part (``use_local_synchronization``), so each node makes its own at the same
    time; it uses ``group``'s backend."""
    members = tuple(members)
    group = group if group is not None else dist.group.WORLD
    me = dist.get_rank(group)
    if me not in members:
        raise ValueError(f"node_group: rank {me} is not among the members {members}")
    ranks = dist.get_process_group_ranks(group)
    global_ranks = tuple(ranks[m] for m in members)
    if list(global_ranks) != sorted(global_ranks):
        raise ValueError(f"node_group: the members {members} have global ranks {global_ranks}, not ascending; a node "
                         "group's ranks would not follow the TP group's order")
    key = (id(dist.group.WORLD), global_ranks)  # a world set up again makes its node groups again
    with _lock:
        found = _groups.get(key)
        if found is None:
            found = _groups[key] = dist.new_group(list(global_ranks), backend=dist.get_backend(group),
                                                  use_local_synchronization=True)
    if dist.get_rank(found) != members.index(me):
        raise AssertionError(f"node_group: rank {me} is rank {dist.get_rank(found)} of its node group, expected "
                             f"{members.index(me)}")
    return found


__all__ = ["node_members", "mapped_pointers", "node_group"]
