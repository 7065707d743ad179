"""The send/recv primitive of the NCCL transports, and its host-staged stand-in for ranks sharing one GPU.

Both executors (flux_layers/runtime/multinode/nccl_transport.py ``AgExecutor``, nccl_rs_transport.py ``RsExecutor``)
issue each batch of their plan as one :meth:`exchange`: its sends and receives issued together (pairs that exchange
both ways cannot deadlock), after which the current stream is ordered after their completion. Everything else on those
paths (the plans and batches, the flags, the kernels' external mode, the workspaces) is the same whichever primitive
runs below it.

* :class:`GroupSendRecv`: torch.distributed's ``batch_isend_irecv`` on the group, then ``wait`` on each work. NCCL on
  GPUs (the wait orders the current stream after NCCL's; the host does not block); gloo on CPU tensors in the CPU
  tests (the wait blocks).
* :class:`HostStagedSendRecv`: the stand-in where NCCL cannot run, ranks as processes sharing one GPU
  (FLUX_LAYERS_TEST_SHARED_GPU=1: NCCL refuses two ranks on one GPU, so their group is gloo, which moves host memory).
  It is taken there only (:func:`stands_in`), and ``ops.plan`` / ``ops.decide(...).reason`` say so
  (:data:`STAND_IN_NOTE`). Emulated nodes (FLUX_LAYERS_NODE_SIZE) on one GPU thus run the NCCL transports' real path.

The stand-in: one per group, with its own thread and CUDA stream. Exchange number j is enqueued by the caller without
any host wait:

1. the stand-in's stream waits for the current stream, copies each distinct tensor to send into pinned host memory
   and then stores j into the host word ``staged`` (``torch.ops.flux_layers.write_flag``: cuStreamWriteValue32 on
   mapped host memory, ordered after the copies);
2. the job (j, the pinned sends, pinned receive buffers) goes to the stand-in's thread;
3. the stand-in's stream waits until the host word ``arrived`` holds >= j (``torch.ops.flux_layers.wait_flag``:
   cuStreamWaitValue32 on mapped host memory), copies each receive buffer into its tensor; the current stream waits
   for the stand-in's stream, as it waits for NCCL's stream.

The thread, job by job in order: waits until ``staged`` holds >= j, issues a gloo isend / irecv for every send and
receive of the job (tag :data:`TAG`), waits for them and stores ``arrived = j``. NOTE: the GPU waits on a host store,
never on work enqueued after its wait: with one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) a stream wait holds
every later operation of every stream, so a flag that later GPU work would write never comes. One thread and one
stream per group keep the exchanges of every executor on the group in issue order, as NCCL's calls on one
communicator are; every rank issues the same exchanges in the same order, so each pair's messages match in order.

NOTE: the thread makes no CUDA call at all (it reads and stores the two words through plain host loads and stores,
never frees a job's pinned buffers: the caller's next exchange does, and on a failure only marks workspaces failed:
their native watchdog releases them). A caller may sit in a CUDA call that waits for the device while holding the
driver's locks (a library's first load, cublasCreate's cuLibraryLoadData, was one), and the device waits for this
thread's store: a CUDA call here (an event query, or the pinned allocator's event record when a buffer is freed)
would block on those locks for good.

On CPU tensors (the CPU tests) the same thread, staging and word run; the caller waits for ``arrived`` itself.

Failure. A peer process that died closes its sockets and gloo raises in the thread; a job not done ``timeout_s``
(FLUX_LAYERS_TIMEOUT_S when the stand-in is made) after the thread took it is taken as hung by a watcher thread.
Either way the stand-in records the failure, stores ``arrived`` = 2^31 - 1 (every stream wait returns; the receive
copies then move what their buffers hold, NaN where nothing came: each receive buffer starts as 0xFF bytes, so the
GEMM's tiles and the hybrid transport's forwards to node peers read NaN instead of an earlier exchange's numbers)
and marks the group's cached NCCL-transport workspaces failed, which their watchdog releases within its poll (their
GEMMs' waits return, and the GEMMs of calls already enqueued yield NaN for every tile whose mainloop ends from then
on): those calls' outputs are invalid, the workspace's next call or ``check()`` raises WorkspaceError naming the
failure, and every later exchange raises :class:`HostStagedTransferError` at once. A workspace made outside the
cache learns of it from its next exchange or its own kernels' timeouts. As with NCCL, the group's transfers do not
recover: a receive that hung stays posted (its buffer is kept).
"""
from __future__ import annotations

import collections
import ctypes
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from flux_layers import _env
from flux_layers.runtime.workspace import WorkspaceError

TAG = 0x464C  # the stand-in's gloo messages ("FL"): apart from any other point-to-point traffic on the group
_RELEASED = 2**31 - 1  # ``arrived`` after a failure: every wait on it returns
_POLL_S = 50e-6  # the thread's poll of a staging copy's event

STAND_IN_NOTE = ("NCCL's send/recv run by the host-staged stand-in (ranks sharing one GPU, "
                 "FLUX_LAYERS_TEST_SHARED_GPU=1: gloo through pinned host memory, runtime/multinode/sendrecv.py)")

Transfer = tuple[torch.Tensor, int]  # (tensor, the peer's rank in the group)


class HostStagedTransferError(WorkspaceError):
    """The host-staged stand-in's transfers failed (a peer died or stopped exchanging); the group's NCCL-transport
    workspaces cannot be used any more."""


class GroupSendRecv:
    """torch.distributed's send/recv on ``group``: NCCL on GPUs, gloo on CPU tensors."""
    name = "torch.distributed"

    def __init__(self, group):
        self.group = group

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        """Issue ``sends`` and ``recvs`` as one group of point-to-point calls and wait for them (on the stream for
        NCCL)."""
        isend, irecv = dist.isend, dist.irecv
        ops = [dist.P2POp(isend, t, group=self.group, group_peer=peer) for t, peer in sends]
        ops += [dist.P2POp(irecv, t, group=self.group, group_peer=peer) for t, peer in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


@dataclass
class _Job:
    seq: int
    sends: list[Transfer]  # staged host tensors (as bytes) and their peers
    recvs: list[Transfer]  # host receive buffers (as bytes) and their peers
    on_device: bool  # its sends are staged by the device: the thread waits for the word ``staged`` to reach seq


class _MappedWord:
    """``__cuda_array_interface__`` of pinned host memory, which under unified addressing has one address on the host
    and the device: the CUDA tensor torch makes of it is what the op library's stream waits take."""

    def __init__(self, host: torch.Tensor):
        self._host = host  # kept alive by the tensor made from this object
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i4", "version": 3,
                                         "data": (host.data_ptr(), False), "strides": None}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _receive_buffer(like: torch.Tensor, pinned: bool) -> torch.Tensor:
    """Host memory for a receive into ``like``, every byte 0xFF until the receive fills it: NaN in each floating type
    the transports carry (bfloat16, float16, float32, both FP8 formats), so a receive released by a failure hands on
    NaN, not the bytes of an earlier exchange (module docstring, Failure)."""
    buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
    _as_bytes(buffer).fill_(0xFF)
    return buffer


class HostStagedSendRecv:
    """The stand-in for NCCL's send/recv on ``group`` (module docstring); :func:`stand_in` gives a group's one."""
    name = "host-staged stand-in"

    def __init__(self, group, timeout_s: float | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout_s = _env.get_float("TIMEOUT_S") if timeout_s is None else float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"HostStagedSendRecv: timeout_s must be positive, got {self.timeout_s:g}")
        # What the completed exchanges moved, by peer (bytes), and how many exchanges completed.
        self.sent_bytes: collections.Counter = collections.Counter()
        self.received_bytes: collections.Counter = collections.Counter()
        self.exchanges = 0
        self._trace = _env.get("TEST_STAND_IN_TRACE") == "1"
        self._began = time.monotonic()
        self._cuda = torch.cuda.is_available()
        # The host words [arrived, staged]: the GPU waits on the first and stores the second (module docstring).
        self._words = torch.zeros(2, dtype=torch.int32, pin_memory=self._cuda)
        self._arrived = ctypes.c_int32.from_address(self._words.data_ptr())
        self._staged = ctypes.c_int32.from_address(self._words.data_ptr() + 4)
        self._arrived_seq = 0  # arrived's value, for the host side
        self._words_on_device: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._seq = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._current: tuple[_Job, float] | None = None  # the thread's job and when it took it
        self._failure: str | None = None
        self._abandoned: list = []  # a failed job's buffers: a receive still posted may write into them
        # Jobs the thread is done with, freed by the caller (the thread frees nothing: module docstring's NOTE);
        # those up to _retired_seq the thread holds no reference to any more.
        self._retired: collections.deque = collections.deque()
        self._retired_seq = 0
        for target, what in ((self._serve, "transfers"), (self._watch, "watcher")):
            threading.Thread(target=target, name=f"flux-host-staged-{what}-rank{self.rank}", daemon=True).start()

    # ---------------------------------------------------------------- the caller's side

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        """Enqueue ``sends`` and ``recvs`` (module docstring); on CUDA tensors the current stream then waits for
        them, on CPU tensors this call does. Raises :class:`HostStagedTransferError` once the stand-in failed."""
        self.raise_if_failed()
        self._free_retired()
        sends = [(t, p) for t, p in sends if t.numel() > 0]  # both sides of a transfer see the same shape
        recvs = [(t, p) for t, p in recvs if t.numel() > 0]
        if not sends and not recvs:
            return
        self._seq += 1
        if self._seq >= _RELEASED:
            raise HostStagedTransferError(f"rank {self.rank}: the host-staged stand-in's exchange counter is spent")
        self._log("enqueued", self._seq, sends, recvs)
        if any(t.is_cuda for t, _ in (*sends, *recvs)):
            self._exchange_cuda(self._seq, sends, recvs)
        else:
            self._exchange_host(self._seq, sends, recvs)

    def _exchange_cuda(self, seq: int, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        current = torch.cuda.current_stream()
        stream = self._stream_on(current.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            staged_sends = self._stage(sends, pinned=True)
            if staged_sends:
                torch.ops.flux_layers.write_flag.default(self._words_on_device, 1, seq)
            buffers = [(_receive_buffer(t, pinned=True), t, peer) for t, peer in recvs]
            self._jobs.put(_Job(seq, staged_sends, [(_as_bytes(b), peer) for b, _, peer in buffers],
                                bool(staged_sends)))
            if buffers:
                torch.ops.flux_layers.wait_flag.default(self._words_on_device, 0, seq)
                for b, t, _ in buffers:
                    t.copy_(b, non_blocking=True)
        current.wait_stream(stream)

    def _exchange_host(self, seq: int, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        buffers = [(_receive_buffer(t, pinned=False), t, peer) for t, peer in recvs]
        self._jobs.put(_Job(seq, self._stage(sends, pinned=False), [(_as_bytes(b), p) for b, _, p in buffers], False))
        with self._cond:
            while self._arrived_seq < seq:
                self._cond.wait()
        self.raise_if_failed()
        for b, t, _ in buffers:
            t.copy_(b)

    @staticmethod
    def _stage(sends: Sequence[Transfer], pinned: bool) -> list[Transfer]:
        """Host copies of the tensors to send (each distinct tensor once: a mesh sends one chunk to every peer), as
        bytes, with their peers; on the current stream where ``pinned``."""
        copies: dict[tuple, torch.Tensor] = {}
        staged = []
        for t, peer in sends:
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            host = copies.get(key)
            if host is None:
                host = copies[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
                host.copy_(t, non_blocking=pinned)
            staged.append((_as_bytes(host), peer))
        return staged

    def _stream_on(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            from flux_layers import _library
            _library.require_library()  # the stream wait is the op library's (not loaded by importing this module)
            self._stream = torch.cuda.Stream(device=device, priority=-1)
            self._words_on_device = torch.as_tensor(_MappedWord(self._words), device=device)
            if not (self._words_on_device.is_cuda and self._words_on_device.data_ptr() == self._words.data_ptr()):
                raise RuntimeError(f"rank {self.rank}: the host-staged stand-in's host words are not mapped in place "
                                   f"on {device} (a copy would never see the host's stores)")
        elif self._stream.device != device:
            raise ValueError(f"rank {self.rank}: the host-staged stand-in serves {self._stream.device}, got tensors "
                             f"on {device}")
        return self._stream

    def _free_retired(self) -> None:
        """Drop the jobs the thread is done with, on the caller's thread (the pinned allocator's free makes CUDA
        calls)."""
        done = self._retired_seq
        while self._retired and self._retired[0].seq <= done:
            self._retired.popleft()

    # ---------------------------------------------------------------- failures

    @property
    def failure(self) -> str | None:
        return self._failure

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise HostStagedTransferError(self._failure)

    def _fail(self, message: str, job: _Job | None) -> None:
        """Record the first failure, release every wait on ``arrived``, and fail the group's cached NCCL-transport
        workspaces (module docstring)."""
        with self._cond:
            if self._failure is not None:
                return
            self._failure = message
            if job is not None:
                self._abandoned.append(job)
            self._arrived.value = _RELEASED
            self._arrived_seq = _RELEASED
            self._cond.notify_all()
        from flux_layers.runtime import workspace
        name = self._group_name(self.group)
        for ws in list(workspace._cache.values()):  # a snapshot: the caller's thread may add to the cache
            if not ws.peer_mapped and self._group_name(ws.group) == name:
                ws.native.mark_failed(message)  # its watchdog releases it (no CUDA call on this thread)

    @staticmethod
    def _group_name(group) -> str:
        return (group if group is not None else dist.group.WORLD).group_name

    def _describe(self, job: _Job) -> str:
        to = sorted({p for _, p in job.sends})
        frm = sorted({p for _, p in job.recvs})
        return (f"rank {self.rank}: the host-staged stand-in for NCCL's send/recv failed in exchange {job.seq} "
                f"(sends to ranks {to}, receives from ranks {frm})")

    # ---------------------------------------------------------------- the threads

    def _serve(self) -> None:
        """The transfers: one job at a time, in order. No CUDA call here (module docstring's NOTE)."""
        while True:
            job = self._jobs.get()
            self._transfer(job)
            self._retired.append(job)
            seq = job.seq
            del job  # the thread's last reference: the caller frees the job's buffers
            self._retired_seq = seq

    def _transfer(self, job: _Job) -> None:
        with self._cond:
            if self._failure is not None:
                return  # released: its waits returned with the failure
            self._current = (job, time.monotonic())
            self._cond.notify_all()
        self._log("taken", job.seq, job.sends, job.recvs)
        try:
            while job.on_device and self._staged.value < job.seq:
                if self._failure is not None:  # the watcher gave up on it
                    break
                time.sleep(_POLL_S)
            if self._failure is not None:
                return
            self._log("staged", job.seq)
            works = [dist.isend(t, group=self.group, group_dst=peer, tag=TAG) for t, peer in job.sends]
            works += [dist.irecv(t, group=self.group, group_src=peer, tag=TAG) for t, peer in job.recvs]
            for work in works:
                work.wait()
            self._log("moved", job.seq)
        except Exception as exc:  # a peer that died closes its sockets: gloo raises here
            self._fail(f"{self._describe(job)}: {type(exc).__name__}: {exc}", job)
            return
        with self._cond:
            self._current = None
            if self._failure is not None:
                return
            for t, peer in job.sends:
                self.sent_bytes[peer] += t.numel()
            for t, peer in job.recvs:
                self.received_bytes[peer] += t.numel()
            self.exchanges += 1
            self._arrived.value = job.seq  # NOTE: after the receives completed: the GPU's wait sees the data
            self._arrived_seq = job.seq
            self._log("stored", job.seq)  # before a host caller wakes up (and may end its process)
            self._cond.notify_all()

    def _log(self, step: str, seq: int, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> None:
        """One line of FLUX_LAYERS_TEST_STAND_IN_TRACE: this rank, the time since the stand-in was made, the step,
        the exchange's number and (where given) its peers and bytes."""
        if not self._trace:
            return
        moves = "".join(f" {kind} {peer}:{t.numel() * t.element_size()}B" for kind, transfers in
                        (("to", sends), ("from", recvs)) for t, peer in transfers)
        sys.stderr.write(f"[stand-in rank {self.rank} {time.monotonic() - self._began:9.4f}s] {step} {seq}{moves}\n")
        sys.stderr.flush()

    def _watch(self) -> None:
        """The bound on a job: taken as hung ``timeout_s`` after the transfer thread took it."""
        with self._cond:
            while self._failure is None:
                if self._current is None:
                    self._cond.wait()
                    continue
                left = self._current[1] + self.timeout_s - time.monotonic()
                if left > 0:  # NOTE: holding no reference to the job meanwhile (the caller frees it)
                    self._cond.wait(left)
                    continue
                job = self._current[0]
                break
            else:
                return
        self._fail(f"{self._describe(job)}: not complete after {self.timeout_s:g} s (FLUX_LAYERS_TIMEOUT_S); a peer "
                   "did not make the exchange, crashed, or is slower than the timeout allows", job)


_stand_ins: dict[str, HostStagedSendRecv] = {}
_stand_ins_lock = threading.Lock()


def stands_in(group) -> bool:
    """Whether the NCCL transports of ``group`` run on the host-staged stand-in: ranks sharing one GPU
    (FLUX_LAYERS_TEST_SHARED_GPU=1) on a group whose backend is not NCCL. Nowhere else."""
    return _env.get("TEST_SHARED_GPU") == "1" and dist.get_backend(group) != "nccl"


def stand_in(group) -> HostStagedSendRecv:
    """The group's one stand-in (made at its first use: every executor on the group shares its order)."""
    name = HostStagedSendRecv._group_name(group)
    with _stand_ins_lock:
        found = _stand_ins.get(name)
        if found is None:
            found = _stand_ins[name] = HostStagedSendRecv(group)
        return found


def for_group(group) -> GroupSendRecv | HostStagedSendRecv:
    """The primitive the NCCL transports of ``group`` use: the stand-in where :func:`stands_in`, else
    torch.distributed's."""
    return stand_in(group) if stands_in(group) else GroupSendRecv(group)


__all__ = ["TAG", "STAND_IN_NOTE", "HostStagedTransferError", "GroupSendRecv", "HostStagedSendRecv", "stands_in",
           "stand_in", "for_group"]
