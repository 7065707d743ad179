"""The NCCL transport's all-gather over the host-staged stand-in under one hardware queue, with one thing changed at a
time: which change lets the forwarding exchange run beside the GEMM.

Why: under CUDA_DEVICE_MAX_CONNECTIONS=1 the all-gather of 4 ranks as 2 x 2 emulated nodes (internode plan) leaves
output elements unwritten; its second exchange, which forwards a chunk received in the first, is staged by the
device only when the GEMM's waits give up (docs/design.md section 7). Ruled out so far: the caller's thread, lazy
module loading, and (experiments/one_queue_probe.py, one process) each step of the sequence behind a one-block kernel.

Variants, each in its own group of processes sharing the GPU (FLUX_LAYERS_TEST_SHARED_GPU=1):

* ``base``: as tests/gpu/test_nccl_transport_gpu.py makes the call (torch's default stream);
* ``side_stream``: the call on a side stream of the caller's;
* ``stand_in_priority_0``: the stand-in's stream at the default priority instead of the highest;
* ``forward_from_host``: a send of a region this stand-in received into earlier leaves from the pinned buffer it
  arrived in: no staging copy, and the stand-in's thread sends it without waiting for the device;
* ``nccl_sms_32``: the GEMM leaves 32 SMs free instead of FLUX_LAYERS_NCCL_SMS's default;
* ``progress``: as ``base``, with the stand-in's device steps traced: after each step its stream stores the
  exchange's number into a word of mapped host memory (``cuStreamWriteValue32``), and a host thread records when each
  word changed: which step the device holds back;
* ``receive_by_kernel``: the receives' host-to-device copies made by a kernel reading the mapped pinned buffer instead
  of ``cudaMemcpyAsync`` (traced as ``progress``);
* ``flags_by_kernel``: each chunk flag the transfer stream sets (``flag_ops``' write) stored by a one-element fill
  kernel instead of ``cuStreamWriteValue32`` on device memory (whether a stream write that must follow the GEMM's
  launch in the one queue is what is held);
* ``receive_op`` (up to 5dc9894, with the op library's receive kernel, since removed): each receive one kernel that
  waited on SMs for the host word and then copied, as an NCCL receive does.

Each variant runs ``--calls`` calls per rank under each ``--connections`` setting, outputs poisoned with NaN; a
rank records per call the seconds until the device finished it, the NaN elements and the error against fp32, or
the error it raised (a call after a timeout raises: its workspace failed).

    FLUX_LAYERS_TEST_SHARED_GPU=1 python -m experiments.one_queue_stand_in [--variants base ...]
        [--connections 1 8] [--calls 3] [--out one_queue_stand_in.json]

Needs one GPU and the op library. First run (ace8079, 4 ranks sharing one H100,
benchmarks/results/one_queue_stand_in_h100.json): under one queue every variant of the first five left every peer
shard of the first call NaN (each tile that ends after the timeout's claim yields NaN); with 8 queues all wrote
everything. At 5dc9894 (one H100, benchmarks/results/one_queue_stand_in_progress_h100.json) ``progress``,
``receive_op`` and ``flags_by_kernel`` failed the same way under one queue; ``progress`` showed every traced step of
the transfer stream, its first included, held until the GEMM's waits gave up, which pointed at the completion word
the op library then wrote on the GEMM's stream (docs/design.md section 7).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

TP, NODE_SIZE = 4, 2
TIMEOUT_S = 5.0
VARIANTS = ("base", "side_stream", "stand_in_priority_0", "forward_from_host", "nccl_sms_32", "progress",
            "receive_by_kernel", "flags_by_kernel")
# The traced steps of an exchange (``progress``), in the order its streams reach them.
STEPS = ("caller_at_exchange", "stand_in_forked", "staged", "arrived_waited", "received", "caller_joined")


def _forward_from_host(sendrecv) -> None:
    """Patch the stand-in so a send of a device region it received into earlier goes from that receive's pinned
    buffer (the bytes are there once the receive's exchange completed, which the stand-in's one thread orders before
    any later exchange), leaving the rest of its exchange as it is: its staging (``_stage``) copies only the other
    sends, so an exchange with none puts no staging copy on the device and its job does not wait for one. Only for
    this experiment: a region written by anything else in between would be sent stale."""
    arrived = {}  # a receive's device region -> the pinned buffer it arrived in
    host_sends = []  # the forwarded sends of the exchange being made, for its job

    def key(t):
        return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()

    stage, receive_buffer, job = sendrecv.HostStagedSendRecv._stage, sendrecv._receive_buffer, sendrecv._Job

    def stage_the_rest(sends, pinned):
        host_sends.append([(sendrecv._as_bytes(arrived[key(t)]), peer) for t, peer in sends if key(t) in arrived])
        return stage([(t, peer) for t, peer in sends if key(t) not in arrived], pinned)

    def remembered_receive_buffer(like, pinned):
        arrived[key(like)] = buffer = receive_buffer(like, pinned)
        return buffer

    def job_with_host_sends(seq, sends, recvs, on_device):
        return job(seq, sends + host_sends.pop(), recvs, on_device)

    sendrecv.HostStagedSendRecv._stage = staticmethod(stage_the_rest)
    sendrecv._receive_buffer = remembered_receive_buffer
    sendrecv._Job = job_with_host_sends


def _flags_by_kernel() -> None:
    """Patch the NCCL transport's flag writes (flux_layers/ops/fused_ag_gemm.py ``flag_ops``, taken at each call) to a
    fill kernel on the current stream: stream order still puts each flag after its chunk's receive."""
    from flux_layers import _library
    from flux_layers.ops import fused_ag_gemm
    _library.require_library()  # flag_ops takes the op library's ops (not loaded by importing the module)
    _, wait = fused_ag_gemm.flag_ops()

    def write_by_kernel(flags, index, value):  # flags: a workspace's int32 flag words, in device memory
        flags[index:index + 1].fill_(value)

    fused_ag_gemm.flag_ops = lambda: (write_by_kernel, wait)


def _stand_in_priority_0(sendrecv) -> None:
    """Patch the stand-in's stream to the default priority (made once, on its first exchange on the GPU)."""
    import torch
    make = sendrecv.HostStagedSendRecv._stream_on

    def stream_on(self, device):
        if self._stream is None:
            make(self, device)  # maps the host words and makes the high-priority stream, replaced here
            self._stream = torch.cuda.Stream(device=device, priority=0)
        return make(self, device)

    sendrecv.HostStagedSendRecv._stream_on = stream_on


class _Progress:
    """Words of mapped host memory the device stores each traced step's exchange number into, and a host thread
    (plain loads, no CUDA call) that records when each changed, in seconds since :attr:`began`."""

    def __init__(self, sendrecv):
        import threading

        import torch
        self.host = torch.zeros(len(STEPS), dtype=torch.int32, pin_memory=True)
        self.device = None
        self.seen: list[tuple[str, int, float]] = []
        self.began = time.monotonic()
        self._mapped = sendrecv._MappedWord
        threading.Thread(target=self._watch, daemon=True).start()

    def word(self, device):
        import torch
        if self.device is None:
            self.device = torch.as_tensor(self._mapped(self.host), device=device)
        return self.device

    def _watch(self) -> None:
        last = [0] * len(STEPS)
        view = memoryview(self.host.numpy())
        while True:
            for i in range(len(STEPS)):
                v = view[i]
                if v != last[i]:
                    last[i] = v
                    self.seen.append((STEPS[i], int(v), round(time.monotonic() - self.began, 4)))
            time.sleep(200e-6)


def _traced_exchange(sendrecv, progress: _Progress, receive: str) -> None:
    """Patch the stand-in's device side (sendrecv.HostStagedSendRecv._exchange_cuda, the same steps) to store each
    step's exchange number into ``progress``'s words. ``receive``: 'copy' (as the stand-in: a stream wait, then
    ``cudaMemcpyAsync``) or 'kernel' (the stream wait, then a torch kernel reading the pinned buffer through its
    mapped address)."""
    import torch

    from flux_layers import _library
    _library.require_library()  # the op library's stream write (not loaded by importing sendrecv)
    write = torch.ops.flux_layers.write_flag.default

    def mapped_bytes(host):
        class Interface:
            __cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                        "version": 3, "data": (host.data_ptr(), False), "strides": None}
        return torch.as_tensor(Interface(), device=torch.cuda.current_device())

    def exchange_cuda(self, seq, sends, recvs):
        current = torch.cuda.current_stream()
        stream = self._stream_on(current.device)
        words = progress.word(current.device)
        write(words, STEPS.index("caller_at_exchange"), seq)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            write(words, STEPS.index("stand_in_forked"), seq)
            staged_sends = self._stage(sends, pinned=True)
            if staged_sends:
                write(self._words_on_device, 1, seq)
                write(words, STEPS.index("staged"), seq)
            buffers = [(sendrecv._receive_buffer(t, pinned=True), t, peer) for t, peer in recvs]
            self._jobs.put(sendrecv._Job(seq, staged_sends, [(sendrecv._as_bytes(b), peer) for b, _, peer in buffers],
                                         bool(staged_sends)))
            if buffers:
                torch.ops.flux_layers.wait_flag.default(self._words_on_device, 0, seq)
                write(words, STEPS.index("arrived_waited"), seq)
                for b, t, _ in buffers:
                    if receive == "kernel":
                        torch.bitwise_or(mapped_bytes(b), 0, out=sendrecv._as_bytes(t))
                    else:
                        t.copy_(b, non_blocking=True)
                write(words, STEPS.index("received"), seq)
        current.wait_stream(stream)
        write(words, STEPS.index("caller_joined"), seq)

    sendrecv.HostStagedSendRecv._exchange_cuda = exchange_cuda


def _rank(rank, tp, variant, calls, seed, out_dir):
    import torch
    import torch.distributed as dist
    os.environ.update(FLUX_LAYERS_TIMEOUT_S=str(TIMEOUT_S), FLUX_LAYERS_POISON_OUTPUTS="1",
                      FLUX_LAYERS_TRANSPORT="nccl", FLUX_LAYERS_NODE_SIZE=str(NODE_SIZE),
                      FLUX_LAYERS_AG_ORDER="internode", FLUX_LAYERS_NUMA_MAP="")
    if variant == "nccl_sms_32":
        os.environ["FLUX_LAYERS_NCCL_SMS"] = "32"
    from flux_layers import ops
    from flux_layers.runtime.multinode import sendrecv
    ops.refresh_settings()
    if variant == "forward_from_host":
        _forward_from_host(sendrecv)
    if variant == "stand_in_priority_0":
        _stand_in_priority_0(sendrecv)
    if variant == "flags_by_kernel":
        _flags_by_kernel()
    progress = None
    if variant in ("progress", "receive_by_kernel"):
        progress = _Progress(sendrecv)
        _traced_exchange(sendrecv, progress, {"progress": "copy", "receive_by_kernel": "kernel"}[variant])
    caller = torch.cuda.current_stream()
    stream = torch.cuda.Stream() if variant == "side_stream" else caller
    results = []
    for i in range(calls):
        gen = torch.Generator(device="cuda").manual_seed(seed + i)
        x = torch.randn(256 * tp, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(128 * tp, 256, generator=gen, device="cuda", dtype=torch.bfloat16).chunk(tp)[rank].contiguous()
        torch.cuda.synchronize()
        dist.barrier()
        began = time.monotonic()
        traced_from = len(progress.seen) if progress else 0
        try:
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                out = ops.ag_gemm(x.chunk(tp)[rank], w, group=dist.group.WORLD, backend="fused")
            caller.wait_stream(stream)
            torch.cuda.synchronize()
        except Exception as exc:  # a call after a timeout: its workspace failed
            results.append({"call": i, "raised": f"{type(exc).__name__}: {str(exc)[:300]}"})
            break
        seconds = time.monotonic() - began
        # each traced step reached: (step, exchange, seconds since the call began)
        steps = [(step, seq, round(t - (began - progress.began), 4)) for step, seq, t in progress.seen[traced_from:]] \
            if progress else None
        ref = x.float() @ w.float().t()
        written = ~out.isnan()
        error = float((out.float()[written] - ref[written]).norm() / ref[written].norm())
        unwritten = ~written
        rows = x.shape[0] // tp
        results.append({"call": i, "seconds": round(seconds, 4), "nan_elements": int(unwritten.sum()),
                        # which source ranks' rows, and whether whole rows (a tile given up) or scattered elements
                        "nan_elements_by_shard": [int(unwritten[g * rows:(g + 1) * rows].sum()) for g in range(tp)],
                        "rows_wholly_nan": int(unwritten.all(dim=1).sum()),
                        "rows_partly_nan": int((unwritten.any(dim=1) & ~unwritten.all(dim=1)).sum()),
                        "rel_error_of_written": error, **({"device_steps": steps} if steps is not None else {})})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.cuda.synchronize()


def _run(variant: str, connections: str, calls: int, seed: int) -> dict:
    from experiments.one_queue_stand_in import _rank as rank  # by its module's name, not __main__'s, for the spawn
    from flux_layers.devtools.launch import run_distributed
    before = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = connections  # read by each rank's CUDA start
    out_dir = tempfile.mkdtemp(prefix="one-queue-stand-in-")
    began = time.monotonic()
    failure = None
    try:
        run_distributed(rank, TP, variant, calls, seed, out_dir, backend="nccl", timeout_s=120)
    except AssertionError as exc:
        failure = str(exc)[-1500:]
    finally:  # the record's settings are this process's
        if before is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS")
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = before
    ranks = {}
    for r in range(TP):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks[r] = json.load(f)
    calls_ok = all(len(v) == calls and all(c.get("nan_elements") == 0 for c in v) for v in ranks.values())
    return {"variant": variant, "connections": connections, "all_written": calls_ok and len(ranks) == TP,
            "wall_s": round(time.monotonic() - began, 1), "ranks": ranks, "launch_failure": failure}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--connections", nargs="+", default=["1", "8"])
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("FLUX_LAYERS_TEST_SHARED_GPU") != "1":
        sys.exit("set FLUX_LAYERS_TEST_SHARED_GPU=1: the ranks share this machine's one GPU through gloo and the "
                 "host-staged stand-in")
    runs = []
    for connections in args.connections:
        for variant in args.variants:
            run = _run(variant, connections, args.calls, args.seed)
            runs.append(run)
            worst = max((c.get("nan_elements", -1) for v in run["ranks"].values() for c in v), default=None)
            print(f"connections={connections} {variant}: all written={run['all_written']} most NaN in a call={worst} "
                  f"({run['wall_s']} s){' launch failed' if run['launch_failure'] else ''}", flush=True)
            if args.out:  # after every run: a run cut short by a time limit keeps the ones before it
                from flux_layers.devtools import records
                records.write_json(args.out, {**records.environment(gpu_count=1), "tp": TP, "node_size": NODE_SIZE,
                                              "runs": runs})


if __name__ == "__main__":
    main()
