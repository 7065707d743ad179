"""How one fused call runs, as registered with its workspace: the Python mirror of the native workspace's
``add_ag_plan`` / ``add_rs_plan`` (csrc/bindings/ops.cpp, ``flux::CallPlan``).

A plan is filled by name: its fields are the native methods' argument names (a CPU test compares them with the
library's schemas), the enumerated ones carry the names the library knows (``_library.codes()``), and
:meth:`Workspace.plan_index` registers a plan once per workspace by passing its fields as keywords, which the library
rejects if one is unknown or missing. The plan a call ran is also what ``ops.decide(...).plan`` reports.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class _KernelFields:
    tile: int           # flux::TileConfig id (schedules.TILE_CONFIGS)
    swizzle: int        # tiles along M visited together
    stream_k_fill: int  # split a last wave keeping at most this % of the grid busy along K (0: never)
    sm_count: int       # SMs the persistent grid may hold (0: all)

    def native_fields(self) -> dict:
        """The keywords of the native registration."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


@dataclass(frozen=True)
class AgCallPlan(_KernelFields):
    """An all-gather call: ``mode`` 'push' | 'pull' (the copy engine's direction) or 'external' (the caller moves the
    chunks: the NCCL transport), ``order`` 'mesh' | 'ring', ``rows_per_chunk`` rows per chunk of a shard, and
    ``shard_order``, the GEMM's shard order where the caller's transfers fix it (external), else empty."""
    mode: str
    order: str
    rows_per_chunk: int
    shard_order: tuple[int, ...] = ()
    accumulation: str = "split"  # FP8 operands: 'split' (promoted to fp32 every 256 deep) or 'fast'

    native_method = "add_ag_plan"


@dataclass(frozen=True)
class RsCallPlan(_KernelFields):
    """A reduce-scatter call: ``transport`` 'epilogue' (its stores into the peers' slots), 'copy_engine',
    'external' (the caller moves the staged partials: the NCCL transport) or 'hybrid' (two-level: the epilogue's
    stores inside the node, the caller's transfers of the node partials between nodes, ``node_size`` ranks per node;
    csrc/include/flux/workspace_layout.h RsTwoLevel), ``chunk_cols`` columns per copy-engine chunk (0: the default;
    external and hybrid: N, whole rows)."""
    transport: str
    chunk_cols: int
    node_size: int = 0
    accumulation: str = "split"  # FP8 operands: 'split' or 'fast'

    native_method = "add_rs_plan"
