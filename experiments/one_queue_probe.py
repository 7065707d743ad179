"""Which operations, enqueued on other streams after a kernel that is still running, wait for that kernel when the
context has one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) and which run beside it.

Why: under one queue the NCCL transport's all-gather over the host-staged stand-in leaves output rows unwritten (its
second exchange, which forwards a chunk received in the first, is staged only once the GEMM's waits give up;
docs/design.md section 7). Between the two exchanges sit host-to-device copies, event waits, stream writes and waits
on mapped host words; this probe times each of them, and the stand-in's sequence step by step, behind a running
kernel, with one queue and with eight.

A trial launches ``torch.cuda._sleep`` (one block, about ``--kernel-s`` seconds) on stream A, then enqueues the
trial's steps on streams B and C, with an event after each step. The host polls every event and notes when each
completes; a step that completes long before the kernel's own event ran beside it, one that completes just after it
waited for it. Each step's enqueue is timed on the host too: a CUDA call that blocks the host until the kernel ends
shows there. Steps marked "host store" wait on a mapped host word that the host stores 0.1 s after the enqueue (as the
stand-in's thread does when a transfer arrived). The stand-in's sequence runs again where the fused op differs: the
kernel on torch's default stream (where the tests' GEMM runs), the stand-in's stream at high priority, and both.

    python -m experiments.one_queue_probe [--kernel-s 1.0] [--processes 1 [4]] [--out one_queue_probe.json]

Each setting runs in its own process (the variable is read when CUDA starts); ``--processes 4`` runs four copies at
once, four contexts time-slicing the GPU as the failing test's ranks do. Needs one GPU and the op library (its
``write_flag`` / ``wait_flag``: cuStreamWriteValue32 / cuStreamWaitValue32).

The stand-in's sequence writes its chunk flag into a device word, as the transports do (until f395f6e a host word),
and two trials write and wait on a device word alone.

Found (9e7dbc6, one H200, one process; the chunk flag then a host word): with one queue as with eight, none of the
steps, nor the stand-in's whole sequence, waited for the running kernel, and no enqueue blocked the host. Again at
5dc9894 (one H100, ``--processes 1 4 --kernel-s 0.5``, benchmarks/results/one_queue_probe_h100.json), the variants,
the device-word trials and four contexts at once included. At 54a092e (one H100, ``--processes 1 --kernel-s 0.5``,
benchmarks/results/one_queue_probe_kernel_stream_h100.json) the trials on the kernel's own stream: the write (or
record) behind the kernel waited for it, as stream order says, and an event record enqueued on another stream after it
did not, with one queue as with eight. At 8c7622f (one H100, ``--processes 1 4 --kernel-s 0.5``, the same file) the
later trials reproduced the hold under one queue, in one process as in four: a stream write on another stream after
the write behind the kernel waited for the kernel, and so did the stand-in's chunk flag write and every step after it
(the forwarding exchange's event wait, staging copy and host-word store), while the exchange's first steps and an
event record on another stream ran beside it. With eight queues only the write on the kernel's own stream waited.
That is the failure docs/design.md section 7 describes, and why the external-mode calls enqueue nothing behind the
GEMM.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
HOST_STORE_AFTER_S = 0.1
STAND_IN = "stand-in: exchange, then a forwarding exchange"


def _trials(torch, ops, words, dev, pinned):
    """name -> list of (step name, stream letter, enqueue function)."""
    def wait_word(value):
        return lambda: ops.wait_flag.default(words, 0, value)

    def write_word(index, value):
        return lambda: ops.write_flag.default(words, index, value)

    def write_device_word(value):  # the chunk flags the transports write live in device memory, not host memory
        return lambda: ops.write_flag.default(dev["flags"], 0, value)

    d2h = lambda: pinned["d2h"].copy_(dev["src"], non_blocking=True)  # noqa: E731
    h2d = lambda: dev["dst"].copy_(pinned["h2d"], non_blocking=True)  # noqa: E731
    d2d = lambda: dev["dst"].copy_(dev["src"], non_blocking=True)  # noqa: E731
    # the stand-in's exchange j, then exchange j + 1 forwarding what j received (sendrecv.py _exchange_cuda)
    stand_in = [
        ("B waits C", "B", "wait:C"),
        ("stage d2h", "B", d2h),
        ("store staged", "B", write_word(1, 1)),
        ("wait arrived (host store)", "B", wait_word(1)),
        ("receive h2d", "B", h2d),
        ("C waits B", "C", "wait:B"),
        ("flag write", "C", write_device_word(2)),
        ("B waits C again", "B", "wait:C"),
        ("forward stage d2h", "B", lambda: pinned["d2h"].copy_(dev["dst"], non_blocking=True)),
        ("store staged again", "B", write_word(1, 3)),
    ]
    behind_kernel = ("write on the kernel's stream", "A", write_word(1, 9))
    return {
        "event record only": [("record", "B", lambda: None)],
        "device-to-host copy": [("d2h", "B", d2h)],
        "host-to-device copy": [("h2d", "B", h2d)],
        "device-to-device copy": [("d2d", "B", d2d)],
        "stream write to a host word": [("write", "B", write_word(1, 7))],
        "stream write to a device word": [("write (device)", "B", write_device_word(7))],
        "stream wait on a device word already set": [("wait (device, set)", "B",
                                                      lambda: ops.wait_flag.default(dev["flags"], 1, 0))],
        "stream wait on a host word already set": [("wait (set)", "B", wait_word(0))],
        "stream wait on a host word, host store": [("wait (host store)", "B", wait_word(1))],
        "event wait on an idle stream": [("wait C", "B", "wait:C")],
        # the external-mode calls up to 5dc9894 wrote their completion word on the GEMM's stream right after it, and
        # the caller's transfers followed on another stream: the first step waits for the kernel by stream order,
        # the question is whether the second does too
        "stream write behind the kernel on its stream, then a record on another": [
            behind_kernel, ("record on B after it", "B", lambda: None)],
        # the record above did not wait (54a092e): the same with a stream write after it, and with the stand-in's
        # sequence, whose first operation in the traced failure was a stream write
        "stream write behind the kernel on its stream, then a stream write on another": [
            behind_kernel, ("write on B after it", "B", write_word(1, 11))],
        "stream write behind the kernel on its stream, then the stand-in's sequence": [behind_kernel] + stand_in,
        "event record behind the kernel on its stream, then a record on another": [
            ("record on the kernel's stream", "A", lambda: None), ("record on B after it", "B", lambda: None)],
        # a pinned buffer of a size not cached yet: the host allocator's cudaHostAlloc
        "new pinned buffer, then a host-to-device copy from it": [
            ("h2d from a new pinned buffer", "B", lambda: dev["dst"][:MiB + 4096].copy_(
                torch.empty(MiB + 4096, pin_memory=True), non_blocking=True))],
        STAND_IN: stand_in,
    }


def _run_setting(kernel_s: float) -> dict:
    import torch

    from flux_layers import _library
    _library.require_library()
    ops = torch.ops.flux_layers
    torch.cuda.init()
    host_words = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    from flux_layers.runtime.multinode.sendrecv import _MappedWord  # the stand-in's own mapping of its words
    words = torch.as_tensor(_MappedWord(host_words), device="cuda")
    if words.data_ptr() != host_words.data_ptr():
        raise RuntimeError("the host words are not mapped in place (a copy would never see the host's stores)")
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = {"src": torch.randn(4 * MiB, device="cuda", generator=g), "dst": torch.empty(4 * MiB, device="cuda"),
           "flags": torch.zeros(2, dtype=torch.int32, device="cuda")}
    pinned = {"d2h": torch.empty(4 * MiB, pin_memory=True), "h2d": torch.randn(4 * MiB).pin_memory()}
    streams = {k: torch.cuda.Stream() for k in "ABC"}

    # cycles per second of _sleep, from a short calibration
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(streams["A"]):
        start.record()
        torch.cuda._sleep(100_000_000)
        end.record()
    end.synchronize()
    cycles = int(100_000_000 * kernel_s / (start.elapsed_time(end) * 1e-3))

    # The stand-in's sequence again where the fused op differs from the trials above: its GEMM runs on the caller's
    # stream (torch's default stream, in the tests) and the stand-in's own stream (B) has a high priority.
    high = {"A": streams["A"], "B": torch.cuda.Stream(priority=-1), "C": streams["C"]}
    default_a = dict(streams, A=torch.cuda.default_stream())
    variants = {"": streams, " [kernel on the default stream]": default_a, " [B at high priority]": high,
                " [both]": dict(high, A=torch.cuda.default_stream())}
    trials = _trials(torch, ops, words, dev, pinned)
    runs = [(name, steps, streams) for name, steps in trials.items()]
    runs += [(STAND_IN + suffix, trials[STAND_IN], chosen) for suffix, chosen in variants.items() if suffix]
    results = {}
    for name, steps, streams in runs:
        torch.cuda.synchronize()
        host_words.zero_()
        with torch.cuda.stream(streams["A"]):
            torch.cuda._sleep(cycles)
            kernel_done = torch.cuda.Event()
            kernel_done.record()
        events, enqueue_s = [], {}
        t0 = time.perf_counter()
        for step, letter, enqueue in steps:
            stream = streams[letter]
            began = time.perf_counter()
            with torch.cuda.stream(stream):
                if isinstance(enqueue, str):  # "wait:X": this stream waits for what X enqueued so far
                    stream.wait_stream(streams[enqueue.split(":")[1]])
                else:
                    enqueue()
                ev = torch.cuda.Event()
                ev.record()
            enqueue_s[step] = time.perf_counter() - began  # a host call that blocks until the kernel ends shows here
            events.append((step, ev))
        done: dict[str, float] = {}
        stored = False
        kernel_t = None
        while (kernel_t is None or len(done) < len(events)) and time.perf_counter() - t0 < kernel_s + 10:
            now = time.perf_counter() - t0
            if not stored and now >= HOST_STORE_AFTER_S:
                host_words[0] = 1 << 30  # every wait on word 0 passes from here on
                stored = True
            if kernel_t is None and kernel_done.query():
                kernel_t = now
            for step, ev in events:
                if step not in done and ev.query():
                    done[step] = now
            time.sleep(0.001)
        results[name] = {
            "kernel_done_s": kernel_t,
            "steps": [{"step": s, "enqueue_s": enqueue_s[s], "done_s": done.get(s),
                       "waited_for_the_kernel": (None if done.get(s) is None or kernel_t is None
                                                 else done[s] >= kernel_t - 0.05)}
                      for s, _ in events],
        }
        torch.cuda.synchronize()
    return {"cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "gpu": torch.cuda.get_device_name(), "kernel_s": kernel_s, "trials": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--processes", type=int, nargs="+", default=[1],
                    help="copies of each setting run at once, each its own CUDA context (default: 1)")
    ap.add_argument("--setting-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.setting_only:
        print(json.dumps(_run_setting(args.kernel_s)))
        return
    settings = []
    for connections in ("1", "8"):
        for processes in args.processes:  # e.g. 4: as many contexts time-slicing the GPU as the failing test's ranks
            env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=connections)
            procs = [subprocess.Popen([sys.executable, "-m", "experiments.one_queue_probe", "--setting-only",
                                       "--kernel-s", str(args.kernel_s)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(processes)]
            outs = [p.communicate(timeout=180) for p in procs]
            for p, (stdout, stderr) in zip(procs, outs):
                if p.returncode != 0:
                    settings.append({"cuda_device_max_connections": connections, "processes": processes,
                                     "error": stderr[-2000:]})
                    continue
                setting = dict(json.loads(stdout.strip().splitlines()[-1]), processes=processes)
                settings.append(setting)
                for name, trial in setting["trials"].items():
                    waited = [s["step"] for s in trial["steps"] if s["waited_for_the_kernel"]]
                    blocked = [s["step"] for s in trial["steps"] if s["enqueue_s"] > 0.5 * args.kernel_s]
                    kernel = ("never seen done" if trial["kernel_done_s"] is None
                              else f"{trial['kernel_done_s']:.2f} s")
                    print(f"connections={connections} processes={processes} {name}: kernel {kernel}; on the GPU "
                          f"waited for it: {', '.join(waited) or 'none'}; host blocked enqueueing: "
                          f"{', '.join(blocked) or 'none'}", flush=True)
    if args.out:
        from flux_layers.devtools import records
        records.write_json(args.out, {**records.environment(gpu_count=1), "settings": settings})


if __name__ == "__main__":
    main()
