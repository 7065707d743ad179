"""Finding and loading the compiled op library (``flux_layers/_C*.so``).

The library registers its operators with ``TORCH_LIBRARY(flux_layers, ...)``, and is also the Python module
``flux_layers._C`` whose functions call the fused ops without torch's op dispatch (csrc/bindings/fastcall.cpp,
:func:`direct_calls`). It uses only the stable Python ABI, so one build serves every Python version (3.10 on) of the
same torch. It is optional: without it only the reference backend
(torch.distributed collectives + matmul) is available, and asking for a fused operator raises
:class:`FusedOpsUnavailable` saying why.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import threading

import torch

from flux_layers import _env

_lock = threading.Lock()
_state: dict = {"loaded": False, "path": None, "error": None, "tried": False, "direct": None, "direct_error": None,
                "codes": None}

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
            _load_direct_calls(path)
            return True
        _state["error"] = "; ".join(errors)
        return False


def _load_direct_calls(path: str) -> None:
    """Import the loaded library as the module flux_layers._C (the same file: the loader reuses it) for its direct
    calls, unless FLUX_LAYERS_DIRECT_CALLS=0. A module without them (its import-time check of torch's tensor object
    layout failed) or an import error leaves the registered ops as the only path."""
    if _env.get("DIRECT_CALLS") != "1":
        _state["direct_error"] = "FLUX_LAYERS_DIRECT_CALLS=0"
        return
    try:
        spec = importlib.util.spec_from_file_location("flux_layers._C", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # not importable as a module (e.g. an older build): the registered ops serve
        _state["direct_error"] = f"{type(exc).__name__}: {exc}"
        return
    if not hasattr(module, "ag_gemm"):
        _state["direct_error"] = "the library found torch's tensor objects laid out otherwise than it reads them"
        return
    from flux_layers.runtime.workspace import NoGraphTwin, WorkspaceError
    module._set_error_types(WorkspaceError, NoGraphTwin)  # the direct calls raise them (csrc/bindings/fastcall.cpp)
    _state["direct"] = module


def direct_calls():
    """The module whose ``ag_gemm`` / ``gemm_rs`` make the registered ops' calls, their arguments in the order a
    decision binds them (csrc/bindings/fastcall.cpp), or return ``NotImplemented`` where an argument is not a plain
    tensor, a torch-function or dispatch mode is active, or an input requires grad under grad mode (then call the op);
    None where there are none (:func:`direct_calls_unavailable_reason` says why)."""
    load()
    return _state["direct"]


def codes() -> dict[str, dict[str, int]]:
    """The op library's codes by kind and name, e.g. ``codes()["ag_mode"]["push"]`` (csrc/bindings/ops.cpp, the one
    table of them): Python passes the names and keeps no copy of a code."""
    if _state.get("codes") is None:
        require_library()
        table: dict[str, dict[str, int]] = {}
        for dotted, code in torch.ops.flux_layers.codes().items():
            kind, name = dotted.split(".", 1)
            table.setdefault(kind, {})[name] = code
        _state["codes"] = table
    return _state["codes"]


def require_library() -> None:
    """Raise :class:`FusedOpsUnavailable` unless the op library is loaded (what runs without a GPU: its layouts and
    codes)."""
    if not load():
        raise FusedOpsUnavailable(f"flux_layers op library is unavailable: {_state['error']}. {_INSTALL_HINT}")


def direct_calls_unavailable_reason() -> str | None:
    load()
    if _state["direct"] is not None:
        return None
    return _state["direct_error"] or unavailable_reason() or "the op library is not loaded"


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
