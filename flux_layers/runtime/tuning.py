"""Tuned data kept as JSON in ``configs/tuning/``: per-shape dispatch (fused vs sequential) and kernel choice.

A table file looks like::

    {"gpu": "NVIDIA H200", "entries": [
        {"op": "ag_gemm", "dtype": "bfloat16", "tp": 2, "m": 2048, "k": 4096, "n": 4096,
         "path": "sequential", "source": "benchmarks/results/ag_gemm_h200x2.json"}]}

Lookups match op, dtype, tp and GPU name exactly and take the entry with the nearest (m, k, n) in log space;
with no matching entry the fused path is used (the heuristic: fused kernels are built to win on large shapes).
"""
from __future__ import annotations

import functools
import glob
import json
import math
import os
from typing import NamedTuple

import torch

from flux_layers import _env
from flux_layers.runtime.schedules import DEFAULT_STREAM_K_FILL, TILE_CONFIGS

_TUNING_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "configs", "tuning")


@functools.lru_cache(maxsize=None)
def _load_tables(override: str) -> tuple[dict, ...]:
    paths = [override] if override else sorted(glob.glob(os.path.join(_TUNING_DIR, "*.json")))
    tables = []
    for path in paths:
        with open(path) as f:
            tables.append(json.load(f))
    return tuple(tables)


def reload() -> None:
    """Read the tables again at the next lookup (after FLUX_LAYERS_TUNING or a table file changed)."""
    _load_tables.cache_clear()


def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def dispatch_entry(op: str, *, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int]) -> dict | None:
    if min(mkn) <= 0:  # an empty problem (M = 0 is a valid no-op) has no nearest measured shape
        return None
    gpu = _gpu_name()
    dtype_name = str(dtype).replace("torch.", "")
    best, best_dist = None, math.inf
    for table in _load_tables(_env.get("TUNING")):
        if table.get("gpu") != gpu:
            continue
        for e in table.get("entries", []):
            if e.get("op") != op or e.get("dtype") != dtype_name or e.get("tp") != tp:
                continue
            d = sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(mkn, (e["m"], e["k"], e["n"])))
            if d < best_dist:
                best, best_dist = e, d
    # Only trust an entry for shapes close to a measured one (within a factor 2 in total).
    return best if best_dist <= 1.0 else None


# Defaults where no tuned entry applies, as measured (benchmarks/results/gemm_h200.json, ag_gemm_*, gemm_rs_*):
# 128 x 256 tiles visited in panels of 16 tiles along M are the fastest configuration of the plain GEMM on all 8
# measured shapes and of both fused operators on all 10 (the stream-K tail, FLUX_LAYERS_STREAM_K, is built for
# this tile shape only).
_DEFAULT_KERNEL = {"gemm": (1, 16), "ag_gemm": (1, 16), "gemm_rs": (1, 16)}


def kernel_config(op: str, *, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int]) -> tuple[int, int]:
    """(tile configuration id of flux::TileConfig, swizzle) for a call: a tuned entry's ``tile``/``swizzle``
    if one is close enough, else the measured default of the operator."""
    tile, swizzle = _DEFAULT_KERNEL[op]
    entry = dispatch_entry(op, dtype=dtype, tp=tp, mkn=mkn)
    if entry is not None:
        tile, swizzle = int(entry.get("tile", tile)), int(entry.get("swizzle", swizzle))
    return tile, swizzle


RS_TRANSPORTS = ("direct", "copy_engine")


def check_rs_transport(transport: str) -> str:
    """``transport`` if it names a GEMM+ReduceScatter transport or 'auto', else a ValueError."""
    if transport not in ("auto",) + RS_TRANSPORTS:
        raise ValueError(f"gemm_rs: transport must be 'auto', 'direct' or 'copy_engine', got {transport!r}")
    return transport


def rs_transport(*, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int], requested: str | None = None) -> str:
    """How a GEMM+ReduceScatter call moves its partial tiles: ``requested`` if given, else
    FLUX_LAYERS_RS_TRANSPORT; 'auto' takes the tuning table's measured choice for the nearest shape, else
    'direct'. Every rank resolves the same (same shape, same table), as both sides of a transfer must agree."""
    choice = _env.get("RS_TRANSPORT") if requested is None else check_rs_transport(requested)
    if choice != "auto":
        return choice
    entry = dispatch_entry("gemm_rs", dtype=dtype, tp=tp, mkn=mkn)
    return entry.get("transport", "direct") if entry is not None else "direct"


class KernelChoice(NamedTuple):
    tile: int           # flux::TileConfig id
    swizzle: int        # tiles along M visited together
    stream_k_fill: int  # split a last wave keeping at most this % of the grid busy along K (0: never split)
    sm_count: int       # SMs the persistent grid may hold (0: all)

    @property
    def stream_k(self) -> bool:
        return self.stream_k_fill > 0


def stream_k_fill(op: str, stream_k: bool | int | None) -> int:
    """The stream-K tail setting of a call as the kernel takes it (0: off). ``stream_k``: None follows
    FLUX_LAYERS_STREAM_K; True/False switch the tail on (at FLUX_LAYERS_STREAM_K_MAX_FILL) or off; an int 0-100
    is the fill limit itself (0: off)."""
    if stream_k is None:
        stream_k = _env.get("STREAM_K") == "1"
    if isinstance(stream_k, bool):
        if not stream_k:
            return 0
        stream_k = _env.get_int("STREAM_K_MAX_FILL")
    if not 0 <= int(stream_k) <= 100:
        raise ValueError(f"{op}: a stream-K fill limit must lie in [0, 100] (percent of the grid; 0: off), "
                         f"got {stream_k}")
    return int(stream_k)


def resolve_kernel(op: str, *, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int], tile: int | None = None,
                   swizzle: int | None = None, stream_k: bool | int | None = None, sm_count: int = 0
                   ) -> KernelChoice:
    """The kernel configuration of one call: what the caller asked for, else :func:`kernel_config` and
    ``FLUX_LAYERS_STREAM_K`` (see :func:`stream_k_fill`)."""
    if sm_count < 0:
        raise ValueError(f"{op}: sm_count must be >= 0 (0: all SMs), got {sm_count}")
    default_tile, default_swizzle = kernel_config(op, dtype=dtype, tp=tp, mkn=mkn)
    return KernelChoice(default_tile if tile is None else tile, default_swizzle if swizzle is None else swizzle,
                        stream_k_fill(op, stream_k), sm_count)


def kernel_name(choice: KernelChoice) -> str:
    """e.g. '128x256_swz16_sk' (stream-K tail at the default fill limit), '128x256_swz16_sk100' (another limit)
    or '256x128_swz8_dp' (whole tiles), as the benchmarks name them."""
    tile_m, tile_n = TILE_CONFIGS[choice.tile]
    fill = choice.stream_k_fill
    mode = "dp" if fill == 0 else "sk" if fill == DEFAULT_STREAM_K_FILL else f"sk{fill}"
    return f"{tile_m}x{tile_n}_swz{choice.swizzle}_{mode}"

