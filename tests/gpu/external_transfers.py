"""Shared pieces of the GPU tests of the host-driven transports (NCCL, hybrid): the layout settings, the all-gather's
case matrix, what the host-staged stand-in received against what the plan says, and the survivors' side of a peer
death."""
from __future__ import annotations

import collections
import os
import time

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import shared_gpu
from tests.gpu.gpu_support import ag_gemm_checked, lean, poison_outputs


def set_layout(transport: str, node_size: str, order: str, numa: str) -> None:
    """The transport and (FLUX_LAYERS_NODE_SIZE, FLUX_LAYERS_AG_ORDER, FLUX_LAYERS_NUMA_MAP) of the next calls."""
    os.environ["FLUX_LAYERS_TRANSPORT"] = transport
    os.environ["FLUX_LAYERS_NODE_SIZE"] = node_size
    os.environ["FLUX_LAYERS_AG_ORDER"] = order
    os.environ["FLUX_LAYERS_NUMA_MAP"] = numa


def node_size_under_test(tp: int, default_nodes: int) -> int:
    """Ranks per emulated node: TP / FLUX_LAYERS_TEST_NODES, or TP / ``default_nodes`` where that is 0."""
    from flux_layers import _env
    nodes = _env.get_int("TEST_NODES") or default_nodes
    if nodes < 2 or tp % nodes:
        raise ValueError(f"FLUX_LAYERS_TEST_NODES={nodes} must split FLUX_LAYERS_TEST_TP={tp} into 2 or more nodes")
    return tp // nodes


def layout_name() -> str:
    return f"node_size={os.environ['FLUX_LAYERS_NODE_SIZE']} order={os.environ['FLUX_LAYERS_AG_ORDER']}"


def ag_cases(layouts, tp: int) -> list:
    """(layout, dtype, weight layout, (M, K, N), chunk rows): every combination, or where lean each layout's
    shapes and chunkings, dtype and weight layout varied across them."""
    # per-rank share a multiple of the tile, and one that is not a multiple of 128
    shapes = ((1024 * tp, 1024, 384 * tp), (1000 * tp, 520, 136 * tp))
    cases = []
    for layout in layouts:
        for i, (shape, chunk_rows) in enumerate((s, c) for s in shapes for c in (0, 128)):
            if lean():
                cases.append((layout, (torch.bfloat16, torch.float16)[(i // 2) ^ (i % 2)], ("nt", "nn")[i // 2],
                              shape, chunk_rows))
            else:
                cases += [(layout, dtype, w, shape, chunk_rows) for dtype in (torch.bfloat16, torch.float16)
                          for w in ("nt", "nn")]
    return cases


def ag_matrix(rank: int, tp: int, seed: int, transport: str, layouts, check_plan) -> None:
    """Every case of :func:`ag_cases` on ``transport``, each output and gathered input checked
    (gpu_support.ag_gemm_checked), then ``check_plan(rank, tp, m, k, n_local, dtype, chunk_rows, received_before)``
    on what the call ran."""
    poison_outputs()
    for i, (layout, dtype, weight_layout, (m, k, n), chunk_rows) in enumerate(ag_cases(layouts, tp)):
        set_layout(transport, *layout)
        before = received_bytes()
        ag_gemm_checked(rank, tp, seed + i, m, k, n, dtype, weight_layout, transport=transport, chunk_rows=chunk_rows,
                        what=f"{transport} ag_gemm {layout_name()}")
        check_plan(rank, tp, m, k, n // tp, dtype, chunk_rows, before)
    torch.cuda.synchronize()


def received_bytes() -> collections.Counter:
    """What the stand-in received so far, by peer (empty off the stand-in), once this rank's work is done."""
    from flux_layers.runtime.multinode import sendrecv
    torch.cuda.synchronize()
    if not shared_gpu():
        return collections.Counter()
    return collections.Counter(sendrecv.stand_in(dist.group.WORLD).received_bytes)


def check_received(call, m: int, tp: int, k: int, dtype: torch.dtype, before: collections.Counter,
                   what: str) -> collections.Counter:
    """On the stand-in, the all-gather ``call`` (fused_ag_gemm.NcclCall) just made received exactly its batches'
    NCCL chunks, no more; returns what it received, by peer (empty off the stand-in)."""
    if not shared_gpu():
        return collections.Counter()
    rows, rpc = m // tp, call.rows_per_chunk
    want: collections.Counter = collections.Counter()
    for batch in call.executor.batches:
        for t in batch.recvs:
            want[t.src] += min(rpc, rows - t.chunk[1] * rpc) * k * dtype.itemsize
    got = received_bytes() - before
    assert got == want, f"{what}: the stand-in received {dict(got)} bytes by peer, the plan {dict(want)}"
    return got


def survive_peer_death(rank: int, calls, timeout_s: float) -> None:
    """The survivors' side of a peer death (the peer left after a barrier): ``calls`` (no collective in them) until
    one raises WorkspaceError, at most three rounds; the device must drain within the timeout, and each call must
    then refuse, naming the failure: the stand-in's, a timed-out wait's, or (a survivor inside a node whose other rank
    learnt of the death first and was released, its enqueued calls then running through) that rank running ahead
    after a failure. Ends the process (the peer is gone: no collective shutdown)."""
    from flux_layers.runtime.workspace import WorkspaceError
    began = time.monotonic()
    for _ in range(3):
        try:
            for call in calls:
                call()
        except WorkspaceError:
            break
    torch.cuda.synchronize()  # returns: the stand-in and the kernels' waits gave up
    elapsed = time.monotonic() - began
    assert elapsed < timeout_s + 10, f"rank {rank}: the device drained only after {elapsed:.1f} s"
    for call in calls:  # the workspaces refuse, naming the failure
        with pytest.raises(WorkspaceError, match="host-staged stand-in|timed out after|failed .* and was released"):
            call()
    os._exit(0)
