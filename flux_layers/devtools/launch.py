"""Start N local processes (from a test or a benchmark), run a function in each with torch.distributed initialised.

``run_distributed(fn, world_size, *args, backend="gloo")`` spawns ``world_size`` processes, initialises the
default process group (gloo on CPU, nccl with one GPU per rank, or gloo with every rank on GPU 0 under
FLUX_LAYERS_TEST_SHARED_GPU=1), calls ``fn(rank, world_size, *args)`` and
re-raises the first failure in the parent with the child's traceback. ``fn`` must be a module-level function.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def shared_gpu() -> bool:
    """FLUX_LAYERS_TEST_SHARED_GPU=1: the GPU tests run their ranks as processes sharing one GPU (a machine with
    one GPU). The fused ops' results are checked as usual; their timing means nothing there (the processes
    share the GPU)."""
    from flux_layers import _env
    return _env.get("TEST_SHARED_GPU") == "1"


def tp_under_test() -> int:
    """Ranks of the GPU tests' groups: FLUX_LAYERS_TEST_TP (2 to 8), else every visible GPU (at least 2, at most 8),
    or 2 where the ranks share one GPU. Ranks sharing a GPU may be any of 2 to 8; with a GPU per rank, the machine
    must have that many (the tests skip where it has fewer)."""
    import torch

    from flux_layers import _env
    from flux_layers.runtime.schedules import MAX_TP
    tp = _env.get_int("TEST_TP")
    if tp == 0:
        return 2 if shared_gpu() else min(max(torch.cuda.device_count(), 2), MAX_TP)
    if not 2 <= tp <= MAX_TP:
        raise ValueError(f"FLUX_LAYERS_TEST_TP={tp} must be 0 (the visible GPUs) or 2 to {MAX_TP}")
    return tp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, fn, args, errors, dump_at, dump_dir):
    import faulthandler

    import torch
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    # A rank still running shortly before the launcher kills it writes every thread's stack to its own file, which
    # the launcher prints rank by rank (to stderr, which pytest shows with the failure): what a hang was waiting for.
    dump_file = open(os.path.join(dump_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.dump_traceback_later(max(dump_at - time.time(), 0.1), exit=False, file=dump_file)
    try:
        if backend == "nccl" and shared_gpu():
            # Emulation on one GPU: every rank on GPU 0, gloo for the group (NCCL refuses two ranks on one GPU).
            os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
            torch.cuda.set_device(0)
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        elif backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size,
                                    device_id=torch.device("cuda", rank))
        else:
            torch.set_num_threads(1)
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done and reported: leave without the interpreter's teardown. Rank 0 hosts the rendezvous TCP store, and
    # torch's teardown at exit now and then destroys the store's thread while it is still joinable
    # ("terminate called without an active exception", exit code -6) after everything above succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# free_port() releases the port before rank 0 binds it, so another process can take it in between; such a
# launch is retried on a new port.
_PORT_TAKEN = "EADDRINUSE"


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0,
                    port_attempts: int = 3) -> None:
    from flux_layers import _env
    cap = _env.get_float("TEST_LAUNCH_S")
    if cap > 0:
        timeout_s = min(timeout_s, cap)
    for attempt in range(port_attempts):
        hung, failures, procs = _launch(fn, world_size, args, backend, timeout_s)
        if not (any(_PORT_TAKEN in tb for _, tb in failures) and attempt + 1 < port_attempts):
            break
    if failures:
        (rank, tb), *others = sorted(failures)
        also = "".join(f"\nrank {r} failed too: {t.strip().splitlines()[-1]}" for r, t in others)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}{also}")
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"processes exited with non-zero codes: {bad}")


def _launch(fn, world_size, args, backend, timeout_s, grace_s: float = 30.0):
    """One launch: (ranks killed at the deadline, [(rank, traceback)], processes). Once a rank has failed, the
    others get ``grace_s`` more to report, not the whole ``timeout_s`` (a rank that failed its rendezvous leaves
    the others waiting for it)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    # Wall-clock time, as every process reads it: a rank starts seconds after the launch (the spawn, torch's import).
    dump_at = time.time() + timeout_s - min(10.0, timeout_s / 4)
    dump_dir = tempfile.mkdtemp(prefix="flux-launch-")
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, errors, dump_at, dump_dir))
             for r in range(world_size)]
    for p in procs:
        p.start()
    failures = []
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while not errors.empty():
            failures.append(errors.get())
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.05)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    if hung:
        _native_stacks(procs, hung)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    while not errors.empty():
        failures.append(errors.get())
    _print_dumps(dump_dir, world_size)
    return hung, failures, procs


def _native_stacks(procs, ranks) -> None:
    """``py-spy dump --native`` of each rank in ``ranks`` (FLUX_LAYERS_TEST_PY_SPY), to stderr: the native frames
    of every thread, and which one holds the GIL, where the Python stacks alone cannot tell a thread blocked in C
    from one waiting for the GIL."""
    from flux_layers import _env
    py_spy = _env.get("TEST_PY_SPY")
    if not py_spy:
        return
    for r in ranks:
        try:
            done = subprocess.run([py_spy, "dump", "--native", "--pid", str(procs[r].pid)], capture_output=True,
                                  text=True, timeout=60)
            text = done.stdout + done.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"{py_spy} failed: {exc}"
        sys.stderr.write(f"--- rank {r}: py-spy dump --native ---\n{text}\n")


def _print_dumps(dump_dir: str, world_size: int) -> None:
    """Every rank's stack dump (written only by a rank still running at ``dump_at``), one rank after another."""
    for r in range(world_size):
        path = os.path.join(dump_dir, f"rank{r}.txt")
        text = ""
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
        if text.strip():
            sys.stderr.write(f"--- rank {r}: every thread's stack, shortly before the kill ---\n{text}\n")
    shutil.rmtree(dump_dir, ignore_errors=True)
