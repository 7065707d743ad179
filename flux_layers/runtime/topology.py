"""Which all-gather order fits the GPUs of a TP group (design.md §2):

| link | order |
|---|---|
| every pair of GPUs peer-accessible over NVLink (NVSwitch or full NV# mesh) | ``mesh``: all peers at once |
| PCIe only, or not every pair linked | ``ring``: each step forwards one shard to the next rank |

Detection uses NVML (``nvidia-ml-py``) when present and falls back to CUDA peer-access queries; the result is
overridden by ``FLUX_LAYERS_AG_ORDER=mesh|ring``. Multi-node orders are not implemented: the fused path is
for a TP group inside one node.
"""
from __future__ import annotations

import functools

import torch

from flux_layers import _env


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


def _all_peer_access(devices: list[int]) -> bool:
    return all(torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b)


@functools.lru_cache(maxsize=None)
def detect_order(devices: tuple[int, ...]) -> str:
    """'mesh' or 'ring' for GPUs `devices` of this node (no override applied)."""
    if len(devices) <= 2:
        return "mesh"  # with two ranks both orders move the same bytes once; mesh needs no forwarding
    nvlink = _nvlink_pairs(list(devices))
    if nvlink is None:
        nvlink = _all_peer_access(list(devices))
    return "mesh" if nvlink else "ring"


def ag_order(group_devices: tuple[int, ...]) -> str:
    forced = _env.get("AG_ORDER")
    if forced != "auto":
        return forced
    return detect_order(group_devices)
