"""The NCCL transports' send/recv primitive (flux_layers/runtime/multinode/sendrecv.py) on CPU, gloo across processes:
which primitive a group gets (the host-staged stand-in only where ranks share one GPU), the stand-in's exchanges
(dtypes, a tensor sent to several peers, empty tensors, the bytes it accounts), its failures (a receive buffer reads
NaN until a receive fills it, a dead peer raises at once, a peer that never exchanges raises after the timeout, later
exchanges raise, the group's cached NCCL-transport workspaces are failed and released) and the dispatcher's choice
and reason where it runs the NCCL transports. The executors through the stand-in:
tests/cpu/multinode/test_nccl_transport.py and test_nccl_rs_transport.py."""
from __future__ import annotations

import os
import time
import types

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed
from flux_layers.runtime.multinode import sendrecv


def _selection(rank, tp):
    group = dist.group.WORLD
    os.environ.pop("FLUX_LAYERS_TEST_SHARED_GPU", None)
    assert not sendrecv.stands_in(group)
    assert isinstance(sendrecv.for_group(group), sendrecv.GroupSendRecv)
    os.environ["FLUX_LAYERS_TEST_SHARED_GPU"] = "1"
    assert sendrecv.stands_in(group)
    first = sendrecv.for_group(group)
    assert isinstance(first, sendrecv.HostStagedSendRecv) and sendrecv.for_group(group) is first  # one per group
    real = dist.get_backend
    dist.get_backend = lambda g=None: "nccl"  # an NCCL group runs NCCL, shared GPU or not
    assert not sendrecv.stands_in(group) and isinstance(sendrecv.for_group(group), sendrecv.GroupSendRecv)
    dist.get_backend = real


def test_stand_in_only_for_ranks_sharing_a_gpu():
    run_distributed(_selection, 2)


def _exchanges(rank, tp):
    s = sendrecv.HostStagedSendRecv(dist.group.WORLD, timeout_s=30)
    right, left = (rank + 1) % tp, (rank - 1) % tp
    for i, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float64)):
        mine = (torch.arange(24) + 100 * rank + i).to(dtype).view(4, 6)
        # one tensor to every peer (staged once), a strided view, and an empty tensor (no message)
        sends = [(mine, q) for q in range(tp) if q != rank] + [(mine[:, ::2], right), (mine[:0], left)]
        got = {q: torch.empty(4, 6, dtype=dtype) for q in range(tp) if q != rank}
        strided = torch.full((4, 3), -1).to(dtype)
        s.exchange(sends, [(t, q) for q, t in got.items()] + [(strided, left), (torch.empty(0, 6, dtype=dtype),
                                                                                right)])
        for q, t in got.items():
            assert torch.equal(t, (torch.arange(24) + 100 * q + i).to(dtype).view(4, 6)), (rank, q, dtype)
        assert torch.equal(strided, (torch.arange(24) + 100 * left + i).to(dtype).view(4, 6)[:, ::2]), (rank, dtype)
    assert s.exchanges == 5 and s.failure is None
    itemsizes = sum(torch.tensor([], dtype=d).element_size() for d in (torch.bfloat16, torch.float16, torch.float32,
                                                                      torch.int32, torch.float64))
    want = {q: 24 * itemsizes + (12 * itemsizes if q == left else 0) for q in range(tp) if q != rank}
    assert dict(s.received_bytes) == want, (rank, dict(s.received_bytes), want)
    s.exchange([], [])  # nothing to move: no exchange
    assert s.exchanges == 5


def test_stand_in_moves_every_tensor_it_is_given():
    run_distributed(_exchanges, 3)


def _freed_by_the_caller(rank, tp):
    import threading
    import weakref
    freed_on = []

    class Job(sendrecv._Job):
        def __init__(self, *args):
            super().__init__(*args)
            weakref.finalize(self, lambda: freed_on.append(threading.current_thread().name))

    sendrecv._Job = Job
    s = sendrecv.HostStagedSendRecv(dist.group.WORLD, timeout_s=30)
    peer = 1 - rank
    for i in range(6):
        got = torch.empty(64)
        s.exchange([(torch.full((64,), float(10 * rank + i)), peer)], [(got, peer)])
        assert torch.equal(got, torch.full((64,), float(10 * peer + i))), (rank, i)
        time.sleep(0.01)  # the thread has retired the job by now, and holds none of it
    assert len(freed_on) >= 4, freed_on
    main = threading.main_thread().name
    # The thread makes no CUDA call, and freeing a job's pinned buffers makes some (sendrecv.py's NOTE)
    assert set(freed_on) == {main}, f"rank {rank}: jobs freed on {freed_on}, not all on the caller's thread"


def test_the_stand_ins_thread_frees_no_job():
    run_distributed(_freed_by_the_caller, 2)


def _traced(rank, tp):
    s = sendrecv.HostStagedSendRecv(dist.group.WORLD, timeout_s=30)
    peer = 1 - rank
    got = torch.empty(16)
    s.exchange([(torch.full((16,), float(rank)), peer)], [(got, peer)])
    assert torch.equal(got, torch.full((16,), float(peer)))


def test_stand_in_traces_each_step_of_each_exchange(monkeypatch, capfd):
    monkeypatch.setenv("FLUX_LAYERS_TEST_STAND_IN_TRACE", "1")
    run_distributed(_traced, 2)
    err = capfd.readouterr().err
    for rank in (0, 1):
        steps = [line.split("] ")[1].split()[0] for line in err.splitlines() if f"[stand-in rank {rank} " in line]
        assert steps == ["enqueued", "taken", "staged", "moved", "stored"], err[-2000:]
        assert f"enqueued 1 to {1 - rank}:64B from {1 - rank}:64B" in err, err[-2000:]


class _Native:
    def __init__(self):
        self.failed = None

    def mark_failed(self, message):
        self.failed = self.failed or message


def _dead_peer(rank, tp):
    from flux_layers.runtime import workspace
    s = sendrecv.HostStagedSendRecv(dist.group.WORLD, timeout_s=60)
    x = torch.full((64,), float(rank))
    ys = {q: torch.empty(64) for q in range(tp) if q != rank}
    s.exchange([(x, q) for q in ys], list((t, q) for q, t in ys.items()))
    assert all(torch.equal(t, torch.full((64,), float(q))) for q, t in ys.items())
    # A cached workspace of the NCCL transport on this group, and one peer-mapped (which the stand-in leaves alone).
    # (no release attribute: the stand-in only marks a workspace failed, its native watchdog releases it)
    stand_ins = [types.SimpleNamespace(peer_mapped=peer_mapped, group=dist.group.WORLD, native=_Native())
                 for peer_mapped in (False, True)]
    workspace._cache.update({f"stand-in {i}": ws for i, ws in enumerate(stand_ins)})
    dist.barrier()
    if rank == tp - 1:
        os._exit(0)  # gone between exchanges, sockets closed
    began = time.monotonic()
    with pytest.raises(sendrecv.HostStagedTransferError, match=rf"rank {rank}: the host-staged stand-in .* exchange 2 "
                       rf"\(sends to ranks .*{tp - 1}.*receives from ranks .*{tp - 1}"):
        s.exchange([(x, q) for q in ys], list((t, q) for q, t in ys.items()))
    elapsed = time.monotonic() - began
    assert elapsed < 10, f"rank {rank}: the dead peer took {elapsed:.1f} s to show (the watcher's 60 s?)"
    with pytest.raises(sendrecv.HostStagedTransferError):  # every later exchange, at once
        s.exchange([(x, 0)], [])
    nccl_ws, peer_ws = stand_ins
    assert nccl_ws.native.failed == s.failure, "the NCCL-transport workspace was not failed"
    assert peer_ws.native.failed is None
    os._exit(0)  # the peer is gone: no collective shutdown


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_a_receive_buffer_reads_nan_until_a_receive_fills_it(dtype):
    """What a receive released by a failure hands on (the GPU's copy out of the buffer runs then): NaN, not the bytes
    an earlier exchange left in recycled host memory."""
    like = torch.empty(7, 33, dtype=dtype)
    buffer = sendrecv._receive_buffer(like, pinned=False)
    assert buffer.shape == like.shape and buffer.dtype == dtype
    assert torch.isnan(buffer.float()).all()


def test_dead_peer_raises_at_once_and_fails_the_groups_nccl_workspaces():
    run_distributed(_dead_peer, 3, timeout_s=120)


def _absent_peer(rank, tp, done):
    s = sendrecv.HostStagedSendRecv(dist.group.WORLD, timeout_s=1.0)
    if rank == 1:  # alive, never exchanges: rank 0's receive stays posted until the watcher gives up
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    began = time.monotonic()
    with pytest.raises(sendrecv.HostStagedTransferError, match=r"not complete after 1 s .*FLUX_LAYERS_TIMEOUT_S"):
        s.exchange([], [(torch.empty(8), 1)])
    elapsed = time.monotonic() - began
    assert 1.0 <= elapsed < 5, f"the watcher gave up after {elapsed:.1f} s, not the timeout"
    open(done, "w").close()
    os._exit(0)


def test_absent_peer_raises_after_the_timeout(tmp_path):
    run_distributed(_absent_peer, 2, str(tmp_path / "done"), timeout_s=120)


def _dispatcher(rank, tp):
    """backend.choose on a gloo group of processes standing for ranks sharing one GPU (the op library and the GPUs
    stood in): the NCCL transports are blocked on a gloo group, and taken, saying so, where the stand-in runs them."""
    from flux_layers import _library
    from flux_layers.ops import backend
    from flux_layers.runtime import topology
    _library.unavailable_reason = lambda: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    group, cuda = dist.group.WORLD, torch.device("cuda", 0)
    os.environ["FLUX_LAYERS_DISPATCH"] = "always"  # no tuning-table choice for the made-up shape
    os.environ["FLUX_LAYERS_NODE_SIZE"] = "1"  # every peer on another node: the all-gather takes NCCL by itself
    topology.peer_access_matrix.cache_clear()

    def choose(op, **kw):
        return backend.choose(op, device=cuda, dtype=torch.bfloat16, mkn=(256, 64, 64), group=group, **kw)

    os.environ.pop("FLUX_LAYERS_TEST_SHARED_GPU", None)
    c = choose("ag_gemm")
    assert c.path == "reference" and "backend is gloo" in c.reason, c
    os.environ["FLUX_LAYERS_TEST_SHARED_GPU"] = "1"
    for requested, start in ((None, "auto"), ("fused", "requested")):
        c = choose("ag_gemm", backend=requested)
        assert c.path == "fused" and c.reason.startswith(start) and sendrecv.STAND_IN_NOTE in c.reason, c
    c = choose("gemm_rs")  # the reduce-scatter takes NCCL only when forced, stand-in or not
    assert c.path == "reference" and "FLUX_LAYERS_TRANSPORT=nccl" in c.reason, c
    os.environ["FLUX_LAYERS_TRANSPORT"] = "nccl"
    c = choose("gemm_rs")
    assert c.path == "fused" and "not yet run on GPUs" in c.reason and sendrecv.STAND_IN_NOTE in c.reason, c
    os.environ["FLUX_LAYERS_NODE_SIZE"] = "0"  # one node, NCCL forced: the stand-in still runs it
    c = choose("ag_gemm")
    assert c.path == "fused" and sendrecv.STAND_IN_NOTE in c.reason, c
    os.environ["FLUX_LAYERS_TRANSPORT"] = "auto"  # one node, copy engine: no stand-in
    c = choose("ag_gemm")
    assert c.path == "fused" and sendrecv.STAND_IN_NOTE not in c.reason, c


def test_dispatcher_takes_the_nccl_transports_on_the_stand_in_and_says_so():
    run_distributed(_dispatcher, 2)
