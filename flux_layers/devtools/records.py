"""The record every result JSON of the project's benchmarks and examples carries: the commit, the command, the GPU
and its count, the software, the date and the settings in force; and how it is written."""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys

import torch


def commit() -> str:
    env = os.environ.get("FLUX_LAYERS_COMMIT")
    if env:
        return env
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        sha = subprocess.check_output(["git", "-C", root, "rev-parse", "HEAD"], text=True,
                                      stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                        text=True, stderr=subprocess.DEVNULL).strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def environment(gpu_count: int) -> dict:
    return {
        "commit": commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "gpu_count": gpu_count,
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("FLUX_LAYERS_", "NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_DEVICE_MAX"))},
    }


def write_json(path: str, payload: dict, announce: bool = True) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    if announce:
        print(f"wrote {path}", flush=True)
