"""Finding and loading the compiled op library (``flux_layers/_C*.so``).

The library registers its operators with ``TORCH_LIBRARY(flux_layers, ...)`` and uses no Python C API, so one
build serves every Python version of the same torch. It is optional: without it only the reference backend
(torch.distributed collectives + matmul) is available, and asking for a fused operator raises
:class:`FusedOpsUnavailable` saying why.
"""
from __future__ import annotations

import glob
import os
import threading

import torch

from flux_layers import _env

_lock = threading.Lock()
_state: dict = {"loaded": False, "path": None, "error": None, "tried": False}

_INSTALL_HINT = (
    "Build it on a machine with the CUDA toolkit (nvcc >= 12.3) and the nvidia-cutlass package: "
    "`pip install nvidia-cutlass==4.2.0.0 && pip install --no-build-isolation -e .` "
    "(or `python setup.py build_ext --inplace`), or point FLUX_LAYERS_OPS_LIB at a prebuilt library."
)


class FusedOpsUnavailable(RuntimeError):
    """The fused (CUDA) operators cannot run here; the message says why and what to install."""


def _candidates() -> list[str]:
    override = _env.get("OPS_LIB")
    if override:
        return [override]
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(glob.glob(os.path.join(here, "_C*.so")))


def load() -> bool:
    """Load the op library once; returns whether it is loaded. Never raises."""
    if _state["tried"]:  # no lock once decided: this runs on every fused call (and under tracing)
        return _state["loaded"]
    with _lock:
        if _state["tried"]:
            return _state["loaded"]
        _state["tried"] = True
        paths = _candidates()
        if not paths:
            _state["error"] = "the op library was not built (no flux_layers/_C*.so next to the package)"
            return False
        errors = []
        for path in paths:
            if not os.path.exists(path):
                errors.append(f"{path}: no such file")
                continue
            try:
                torch.ops.load_library(path)
            except Exception as exc:  # a library built for another torch, a missing CUDA driver, ...
                errors.append(f"{path}: {exc}")
                continue
            _state.update(loaded=True, path=path, error=None)
            return True
        _state["error"] = "; ".join(errors)
        return False


def path() -> str | None:
    """The loaded library's file (None if none is loaded); for diagnostics (.ci/run, scripts/gpu_check.sh)."""
    load()
    return _state["path"]


def unavailable_reason() -> str | None:
    """Why fused ops cannot run in this process (None if they can)."""
    if not load():
        return f"{_state['error']}. {_INSTALL_HINT}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to this process"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return (f"the fused kernels target sm_90a (H100/H200); this device is sm_{major}{minor} "
                f"({torch.cuda.get_device_name()})")
    return None


def require() -> None:
    """Raise :class:`FusedOpsUnavailable` unless the fused ops can run here."""
    reason = unavailable_reason()
    if reason is not None:
        raise FusedOpsUnavailable(f"flux_layers fused operators are unavailable: {reason}")
