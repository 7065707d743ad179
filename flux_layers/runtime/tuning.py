"""Tuned data kept as JSON in ``flux_layers/tuning_tables/``: per-shape dispatch (fused vs sequential) and kernel
choice. The tables are package data of flux_layers (setup.py), found through the package wherever it is
installed; ``FLUX_LAYERS_TUNING`` names one file to read instead.

A table file looks like::

    {"gpu": "NVIDIA H200", "key": TABLE_KEY, "entries": [
        {"op": "ag_gemm", "dtype": "bfloat16", "tp": 2, "m": 2048, "k": 4096, "n": 2048,
         "path": "sequential", "source": "benchmarks/results/ag_gemm_h200x2.json @ <commit>"}]}

Key convention (the table's ``key`` field, :data:`TABLE_KEY`): an entry's (m, k, n) is the per-rank GEMM, the
problem one rank's kernel runs (:func:`table_key`): ag_gemm (M gathered rows, K, N/tp: this rank's output
columns), gemm_rs (M rows, K/tp: this rank's shard of the reduction, N). Every lookup (``ops.backend.choose``, the
ops' call plans, the layers' decisions, ``ops.plan``) passes the sizes of the tensors this rank holds, which are
exactly these; the benchmarks name shapes by their global M x K x N, and tools/make_dispatch_table.py
converts. Lookups match op, dtype, tp and GPU name exactly and take the entry with the nearest (m, k, n) in log
space, within :data:`NEAREST_LOG2_DISTANCE`; with no matching entry the fused path is used (the heuristic: fused
kernels are built to win on large shapes).
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import math
from typing import NamedTuple

import torch

from flux_layers import _env
from flux_layers.runtime.schedules import DEFAULT_STREAM_K_FILL, TILE_CONFIGS

_TUNING_DIR = importlib.resources.files("flux_layers") / "tuning_tables"


def _table_paths(override: str) -> tuple[str, ...]:
    if override:
        return (override,)
    if not _TUNING_DIR.is_dir():  # the package ships it: without it every shape would fall back to the defaults
        raise FileNotFoundError(f"flux_layers' tuning tables are missing ({_TUNING_DIR} is not a folder): the "
                                f"package is incompletely installed")
    return tuple(sorted(str(p) for p in _TUNING_DIR.iterdir() if p.name.endswith(".json")))


def table_paths() -> tuple[str, ...]:
    """The tuning tables that lookups read: ``FLUX_LAYERS_TUNING``'s file if set, else the packaged ones."""
    return _table_paths(_env.get("TUNING"))


@functools.lru_cache(maxsize=None)
def _load_tables(override: str) -> tuple[dict, ...]:
    tables = []
    for path in _table_paths(override):
        with open(path) as f:
            tables.append(json.load(f))
    return tuple(tables)


def reload() -> None:
    """Read the tables again at the next lookup (after FLUX_LAYERS_TUNING or a table file changed)."""
    _load_tables.cache_clear()


def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


TABLE_KEY = ("per-rank GEMM (flux_layers.runtime.tuning.table_key): ag_gemm m x k x n = gathered M x K x N/tp, "
             "gemm_rs m x k x n = M x K/tp x N")


def table_key(op: str, rows: int, k: int, n: int, tp: int) -> tuple[int, int, int]:
    """The (M, K, N) under which a call of ``op`` is looked up: the per-rank GEMM. ``rows``, ``k``, ``n`` are the
    call's sizes as this rank holds its tensors (x [rows, K], weight K -> N; ``ops._checks.check_matmul_args``):
    ag_gemm gathers ``tp`` shards of rows (M = rows * tp, N = this rank's output columns), gemm_rs multiplies its
    x [M, K/tp] as held; a plain gemm is its own shape."""
    return (rows * tp, k, n) if op == "ag_gemm" else (rows, k, n)


# The measured shapes lie a factor 2 or more apart in some dimension, so an entry is taken for a call whose shape
# is nearer to it than half that spacing: sum |log2(call / entry)| over M, K, N at most 0.5 (a factor sqrt 2 in
# total). A shape a whole factor 2 away is another measurement's business, and keys mixed up between per-rank and
# global sizes (a factor tp in K or N, log2(tp) >= 1) never match.
NEAREST_LOG2_DISTANCE = 0.5


def dispatch_entry(op: str, *, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int],
                   accum: str | None = None, w_dtype: torch.dtype | None = None) -> dict | None:
    """The table entry for a call of ``op`` whose per-rank GEMM is ``mkn`` (:func:`table_key`), or None.
    ``accum`` ('split' | 'fast'): only entries measured with that FP8 accumulation count, before the nearest is
    chosen (a nearer entry of the other accumulation would otherwise hide a matching one); None: any. An entry that
    names the weight's format (``w_dtype``: FP8 entries, whose kernel configurations exist per pair of formats)
    counts only for a call with that weight format."""
    if min(mkn) <= 0:  # an empty problem (M = 0 is a valid no-op) has no nearest measured shape
        return None
    gpu = _gpu_name()
    dtype_name = str(dtype).replace("torch.", "")
    w_dtype_name = None if w_dtype is None else str(w_dtype).replace("torch.", "")
    best, best_dist = None, math.inf
    for table in _load_tables(_env.get("TUNING")):
        if table.get("gpu") != gpu:
            continue
        for e in table.get("entries", []):
            if e.get("op") != op or e.get("dtype") != dtype_name or e.get("tp") != tp:
                continue
            if accum is not None and e.get("accum") != accum:
                continue
            if "w_dtype" in e and e["w_dtype"] != w_dtype_name:
                continue
            d = sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(mkn, (e["m"], e["k"], e["n"])))
            if d < best_dist:
                best, best_dist = e, d
    return best if best_dist <= NEAREST_LOG2_DISTANCE else None


# Defaults where no tuned entry applies, as measured (benchmarks/results/gemm_h200.json, ag_gemm_*, gemm_rs_*):
# 128 x 256 tiles visited in panels of 16 tiles along M are the fastest configuration of the plain GEMM on all 8
# measured shapes and of both fused operators on all 10 (the stream-K tail, FLUX_LAYERS_STREAM_K, is built for
# this tile shape only).
_DEFAULT_KERNEL = {"gemm": (1, 16), "ag_gemm": (1, 16), "gemm_rs": (1, 16)}
# FP8 operands: split accumulation holds a second accumulator fragment, which only 128 x 128 tiles (id 2) leave
# registers for; fast accumulation takes 128 x 256 tiles like the 16-bit GEMMs.
_DEFAULT_KERNEL_FP8 = {"split": (2, 16), "fast": (1, 16)}


def _kernel_entry(op: str, *, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int], fast_accum: bool | None,
                  w_dtype: torch.dtype | None) -> tuple[tuple[int, int], dict | None]:
    """:func:`kernel_config`'s (tile, swizzle), and the table entry it came from (None: the operator's default)."""
    accum = None if fast_accum is None else "fast" if fast_accum else "split"
    tile, swizzle = _DEFAULT_KERNEL[op] if accum is None else _DEFAULT_KERNEL_FP8[accum]
    entry = dispatch_entry(op, dtype=dtype, tp=tp, mkn=mkn, accum=accum, w_dtype=w_dtype)
    if entry is not None:
        tile, swizzle = int(entry.get("tile", tile)), int(entry.get("swizzle", swizzle))
    return (tile, swizzle), entry


def kernel_config(op: str, *, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int],
                  fast_accum: bool | None = None, w_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(tile configuration id of flux::TileConfig, swizzle) for a call: a tuned entry's ``tile``/``swizzle``
    if one is close enough, else the measured default of the operator. ``fast_accum``: None for 16-bit operands,
    else the FP8 accumulation (entries are keyed by x's dtype and, for FP8, 'accum' and the weight's format)."""
    return _kernel_entry(op, dtype=dtype, tp=tp, mkn=mkn, fast_accum=fast_accum, w_dtype=w_dtype)[0]


# The peer-mapped GEMM+ReduceScatter transports: the epilogue's stores straight into the owner's receive slot, or the
# copy engine from a local staging area (the NCCL transport is chosen apart: topology.rs_over_nccl).
RS_TRANSPORTS = ("epilogue", "copy_engine")
# Former names of RS_TRANSPORTS: a setting that still uses one fails naming its transport; benchmark records of
# earlier runs (benchmarks/results) keep them.
RS_TRANSPORT_FORMER_NAMES = {"direct": "epilogue"}


def check_rs_transport(transport: str, setting: str = "gemm_rs: transport") -> str:
    """``transport`` if it names a GEMM+ReduceScatter transport or 'auto', else a ValueError (``setting``: what named
    it, for the message)."""
    if transport in RS_TRANSPORT_FORMER_NAMES:
        raise ValueError(f"{setting}={transport!r}: that transport is called "
                         f"{RS_TRANSPORT_FORMER_NAMES[transport]!r}")
    if transport not in ("auto",) + RS_TRANSPORTS:
        raise ValueError(f"{setting} must be 'auto', 'epilogue' or 'copy_engine', got {transport!r}")
    return transport


def rs_transport(*, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int], requested: str | None = None) -> str:
    """How a GEMM+ReduceScatter call moves its partial tiles: ``requested`` if given, else
    FLUX_LAYERS_RS_TRANSPORT (both checked by :func:`check_rs_transport`); 'auto' takes the tuning table's measured
    choice for the nearest shape, else 'epilogue'. Every rank resolves the same (same shape, same table), as both
    sides of a transfer must agree."""
    choice = (check_rs_transport(_env.get("RS_TRANSPORT"), "FLUX_LAYERS_RS_TRANSPORT") if requested is None
              else check_rs_transport(requested))
    if choice != "auto":
        return choice
    entry = dispatch_entry("gemm_rs", dtype=dtype, tp=tp, mkn=mkn)
    return entry.get("transport", "epilogue") if entry is not None else "epilogue"


class KernelChoice(NamedTuple):
    tile: int           # flux::TileConfig id
    swizzle: int        # tiles along M visited together
    stream_k_fill: int  # split a last wave keeping at most this % of the grid busy along K (0: never split)
    sm_count: int       # SMs the persistent grid may hold (0: all)

    @property
    def stream_k(self) -> bool:
        return self.stream_k_fill > 0


def stream_k_fill(op: str, stream_k: bool | int | None, entry: dict | None = None) -> int:
    """The stream-K tail setting of a call as the kernel takes it (0: off). ``stream_k``: None follows
    FLUX_LAYERS_STREAM_K (``auto``: the tail unless ``entry``, the call's tuning-table entry, records that its
    measured configuration ran whole tiles, ``"stream_k": false``); True/False switch the tail on (at
    FLUX_LAYERS_STREAM_K_MAX_FILL) or off; an int 0-100 is the fill limit itself (0: off)."""
    if stream_k is None:
        setting = _env.get("STREAM_K")
        measured_whole = entry is not None and entry.get("stream_k", True) is False  # the table ran whole tiles
        stream_k = setting == "1" or (setting == "auto" and not measured_whole)
    if isinstance(stream_k, bool):
        if not stream_k:
            return 0
        stream_k = _env.get_int("STREAM_K_MAX_FILL")
    if not 0 <= int(stream_k) <= 100:
        raise ValueError(f"{op}: a stream-K fill limit must lie in [0, 100] (percent of the grid; 0: off), "
                         f"got {stream_k}")
    return int(stream_k)


def resolve_kernel(op: str, *, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int], tile: int | None = None,
                   swizzle: int | None = None, stream_k: bool | int | None = None, sm_count: int = 0,
                   fast_accum: bool | None = None, w_dtype: torch.dtype | None = None) -> KernelChoice:
    """The kernel configuration of one call: what the caller asked for, else :func:`kernel_config` and
    ``FLUX_LAYERS_STREAM_K`` with the same table entry (see :func:`stream_k_fill`)."""
    if sm_count < 0:
        raise ValueError(f"{op}: sm_count must be >= 0 (0: all SMs), got {sm_count}")
    (default_tile, default_swizzle), entry = _kernel_entry(op, dtype=dtype, tp=tp, mkn=mkn, fast_accum=fast_accum,
                                                           w_dtype=w_dtype)
    return KernelChoice(default_tile if tile is None else tile, default_swizzle if swizzle is None else swizzle,
                        stream_k_fill(op, stream_k, entry if tile is None and swizzle is None else None), sm_count)


def kernel_name(choice: KernelChoice) -> str:
    """e.g. '128x256_swz16_sk' (stream-K tail at the default fill limit), '128x256_swz16_sk100' (another limit)
    or '256x128_swz8_dp' (whole tiles), as the benchmarks name them."""
    tile_m, tile_n = TILE_CONFIGS[choice.tile]
    fill = choice.stream_k_fill
    mode = "dp" if fill == 0 else "sk" if fill == DEFAULT_STREAM_K_FILL else f"sk{fill}"
    return f"{tile_m}x{tile_n}_swz{choice.swizzle}_{mode}"

