"""The one place that decides which implementation an operator call uses.

``fused``     : the op library's CUDA kernels (tile-level overlap); raises if they cannot run here.
``reference`` : torch.distributed collective + torch matmul (the sequential NCCL path; also the CPU path).
``auto``      : fused where it can run and the tuning table does not say the sequential path is faster for
                this shape; otherwise reference. A plain GEMM of FP8 operands (no communication to fuse) takes
                cuBLASLt (``torch._scaled_mm``, the reference path on CUDA) unless the table measured the op
                library's FP8 kernel faster for the nearest shape (:func:`fp8_gemm_choice`). The returned
                :class:`Choice` says which and why, so layers and benchmarks can report the path that actually ran.

The request comes from the call's ``backend=`` argument, else ``FLUX_LAYERS_BACKEND`` (default ``auto``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flux_layers import _env, _library
from flux_layers.ops._checks import FUSED_DTYPES
from flux_layers.ops.fp8 import FP8_DTYPES

BACKENDS = ("auto", "fused", "reference")


@dataclass(frozen=True)
class Choice:
    path: str      # "fused" or "reference"
    reason: str    # why, in words (shown in benchmark JSON and layer reports)


def _group_devices(tp: int) -> tuple[int, ...]:
    """The GPUs a group of ``tp`` ranks is taken to run on, for the peer-access check: the first ``tp`` visible
    GPUs (nodes are taken to be alike), or this process's GPU ``tp`` times where fewer are visible (ranks sharing
    one GPU)."""
    visible = torch.cuda.device_count()
    return tuple(range(tp)) if visible >= tp else (torch.cuda.current_device(),) * tp


def ag_transport(group) -> str:
    """How the fused all-gather of ``group`` moves its chunks, 'copy_engine', 'nccl' or 'hybrid' (topology.ag_transport:
    FLUX_LAYERS_TRANSPORT, else NCCL where the group spans nodes or its GPUs cannot map each other's memory).
    Every rank resolves the same (same settings, same node layout, nodes alike)."""
    from flux_layers.runtime import topology
    tp = dist.get_world_size(group)
    return topology.ag_transport(_group_devices(tp), topology.group_node_ids(group))


def over_nccl(op: str, group) -> bool:
    """Whether a fused ``op`` of ``group`` moves data between ranks by NCCL, through workspaces that not every peer
    maps (the all-gather's :func:`ag_transport` 'nccl', local memory, or 'hybrid', mapped inside the node; the
    reduce-scatter's only where forced, :func:`rs_host_transport`), rather than through peer-mapped memory alone.
    Every rank resolves the same."""
    if op == "ag_gemm":
        return ag_transport(group) in ("nccl", "hybrid")
    return rs_host_transport(group) is not None


def rs_host_transport(group) -> str | None:
    """The fused reduce-scatter's transport of ``group`` where the host drives transfers: 'nccl'
    (FLUX_LAYERS_TRANSPORT=nccl, topology.rs_over_nccl), 'hybrid' (FLUX_LAYERS_TRANSPORT=hybrid and the group spans
    nodes: the two-level plan, topology.rs_two_level), else None (the peer-mapped transports). Every rank resolves
    the same."""
    from flux_layers.runtime import topology
    if topology.rs_over_nccl():
        return "nccl"
    if _env.get("TRANSPORT") != "hybrid":  # the nodes asked for only where they matter
        return None
    return "hybrid" if topology.rs_two_level(topology.group_node_ids(group)) else None


def choose(op: str, *, device: torch.device, dtype: torch.dtype, mkn: tuple[int, int, int], group,
           backend: str | None = None, fast_accum: bool = False, w_dtype: torch.dtype | None = None) -> Choice:
    """The path of a call of ``op`` (x's ``dtype``; ``mkn`` its per-rank GEMM, runtime/tuning.py's key); ``fast_accum``
    and ``w_dtype`` (the weight's format) the FP8 call's, which the plain FP8 GEMM's choice depends on."""
    requested = backend if backend is not None else _env.get("BACKEND")
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "reference":
        return Choice("reference", "requested")

    blockers = []
    reason = _library.unavailable_reason()
    if reason is not None:
        blockers.append(reason)
    if device.type != "cuda":
        blockers.append(f"x and weight are on {device}, the fused kernels need CUDA tensors")
    if dtype not in FUSED_DTYPES + FP8_DTYPES:
        blockers.append(f"x and weight have dtype {dtype}, the fused kernels need bfloat16, float16 or FP8")
    # Any process-group backend serves the fused path: its group only exchanges the workspaces' addresses when
    # they are made (the transfers are the op library's own), so gloo works too, e.g. for ranks sharing one GPU.
    nccl, stand_in = False, ""
    if op != "gemm" and not blockers and group is not None:
        from flux_layers.runtime import topology
        from flux_layers.runtime.multinode import sendrecv
        tp = dist.get_world_size(group)
        reason = None
        if tp > 1:
            reason = topology.fused_path_blocker(_group_devices(tp), topology.group_node_ids(group), op=op)
            nccl = reason is None and over_nccl(op, group)
        if reason is not None:
            blockers.append(reason)
        elif nccl and sendrecv.stands_in(group):  # ranks sharing one GPU: NCCL's send/recv stood in
            stand_in = "; " + sendrecv.STAND_IN_NOTE
        elif nccl and dist.get_backend(group) != "nccl":
            why = ("the GPUs cannot map each other's memory, the group spans nodes, or FLUX_LAYERS_TRANSPORT=nccl"
                   if op == "ag_gemm" else "FLUX_LAYERS_TRANSPORT=nccl")
            blockers.append(f"{op}'s transport is NCCL ({why}) but the group's backend is {dist.get_backend(group)}")
    if nccl and torch.cuda.is_current_stream_capturing():
        from flux_layers.runtime.multinode import nccl_rs_transport, nccl_transport
        blockers.append((nccl_transport if op == "ag_gemm" else nccl_rs_transport).CAPTURE_REFUSAL)
    elif op != "gemm" and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        from flux_layers.runtime import workspace
        if not workspace.cuda_graphs_enabled():
            # Captured calls need the workspaces' CUDA-graph twins, which are created (collectively) with the
            # workspaces, before the capture.
            blockers.append("the stream is being captured into a CUDA graph and CUDA graphs were not enabled "
                            "before the warm-up (FLUX_LAYERS_CUDA_GRAPHS=1 or "
                            "flux_layers.runtime.workspace.enable_cuda_graphs())")

    # NOTE: the reduce-scatter's NCCL transport and the hybrid all-gather are taken only when forced and have not
    # run on GPUs: say so.
    untried = " (over NCCL, FLUX_LAYERS_TRANSPORT=nccl: not yet run on GPUs)" if nccl and op == "gemm_rs" else ""
    if nccl and (ag_transport(group) if op == "ag_gemm" else rs_host_transport(group)) == "hybrid":
        untried = " (hybrid transport, FLUX_LAYERS_TRANSPORT=hybrid: not yet run on GPUs)"
    untried += stand_in
    if requested == "fused":
        if blockers:
            raise _library.FusedOpsUnavailable(f"{op}: fused backend requested but " + "; ".join(blockers))
        return Choice("fused", "requested" + untried)
    if blockers:
        return Choice("reference", blockers[0])
    return auto_choice(op, dtype=dtype, tp=dist.get_world_size(group) if group is not None else 1, mkn=mkn,
                       untried=untried, fast_accum=fast_accum, w_dtype=w_dtype)


def auto_choice(op: str, *, dtype: torch.dtype, tp: int, mkn: tuple[int, int, int], untried: str = "",
                fast_accum: bool = False, w_dtype: torch.dtype | None = None) -> Choice:
    """The ``auto`` path of a call that nothing blocks: the reference path where FLUX_LAYERS_DISPATCH=table and the
    tuning table measured the sequential path faster for the nearest shape, else fused; a plain FP8 GEMM's is
    :func:`fp8_gemm_choice`. ``mkn`` is the call's per-rank GEMM (runtime/tuning.py's key convention), as
    :func:`choose` gets it."""
    if op == "gemm" and dtype in FP8_DTYPES:
        return fp8_gemm_choice(dtype=dtype, w_dtype=w_dtype, mkn=mkn, fast_accum=fast_accum)
    if _env.get("DISPATCH") == "table":
        from flux_layers.runtime import tuning
        entry = tuning.dispatch_entry(op, dtype=dtype, tp=tp, mkn=mkn)
        if entry is not None and entry.get("path") == "sequential":
            return Choice("reference", f"tuning table: sequential path measured faster ({entry.get('source', '?')})")
    return Choice("fused", "auto" + untried)


# Where the op library's FP8 GEMM and cuBLASLt were both measured (benchmarks/results/gemm_fp8_h200.json, one H200,
# 11 shapes, K 2048-28672): cuBLASLt was faster on every shape with split accumulation (the op library's best
# configuration 0.81-0.97x) and on all but K = 28672 with fast accumulation. So a plain FP8 GEMM, which has no
# communication to overlap, takes cuBLASLt unless the tuning table measured the op library's kernel faster.
FP8_GEMM_DEFAULT = ("plain FP8 GEMMs take cuBLASLt (torch._scaled_mm), measured faster than the op library's FP8 "
                    "GEMM (benchmarks/results/gemm_fp8_h200.json); backend='fused' or FLUX_LAYERS_DISPATCH=always "
                    "runs the op library's")


def fp8_gemm_choice(*, dtype: torch.dtype, w_dtype: torch.dtype | None, mkn: tuple[int, int, int],
                    fast_accum: bool) -> Choice:
    """The ``auto`` path of a plain GEMM of FP8 operands that nothing blocks: fused where FLUX_LAYERS_DISPATCH=always
    or the tuning table's nearest entry for the operands' formats and the accumulation says the op library's kernel
    was faster, else the reference path (cuBLASLt)."""
    if _env.get("DISPATCH") == "always":
        return Choice("fused", "auto (FLUX_LAYERS_DISPATCH=always)")
    from flux_layers.runtime import tuning
    entry = tuning.dispatch_entry("gemm", dtype=dtype, tp=1, mkn=mkn, accum="fast" if fast_accum else "split",
                                  w_dtype=w_dtype)
    if entry is None:
        return Choice("reference", "auto: " + FP8_GEMM_DEFAULT)
    source = entry.get("source", "?")
    if entry.get("path") == "fused":
        return Choice("fused", f"tuning table: the op library's FP8 GEMM measured faster than cuBLASLt ({source})")
    return Choice("reference", f"tuning table: cuBLASLt (torch._scaled_mm) measured faster ({source})")
