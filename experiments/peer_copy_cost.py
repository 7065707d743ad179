"""Host cost of the CUDA operations an all-gather call makes, by where their memory lives: caching-allocator memory,
this rank's symmetric memory, a peer's symmetric memory (mapped from another process).

cuda_api_cost.cu measures each operation on one process's own memory; a fused all-gather copies into (push) or
out of (pull) a peer's symmetric memory and writes flags there. This probe runs two ranks as processes sharing
GPU 0 (flux_layers.devtools.launch's shared-GPU mode, as the GPU tests), both timing at once, and calls the CUDA
runtime and driver through ctypes (the ctypes call's own cost is the ``cudaGetDevice`` row). Each row: ``--calls``
calls enqueued behind a GPU sleep long enough that the GPU never waits for the host, wall clock per call, median of
``--batches``, maximum over ranks; then the same with the other rank idle.

    python -m experiments.peer_copy_cost [--bytes 8388608] [--pin-cpus 1] [--out results.json]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

SLEEP_CYCLES_PER_MS = 2_000_000


def _lib(patterns):
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise OSError(f"none of {patterns} loads")


def _cudart():
    torch_lib = os.path.dirname(torch.__file__)
    site = os.path.dirname(torch_lib)
    return _lib([os.path.join(site, "nvidia", "cu13", "lib", "libcudart.so*"),
                 os.path.join(site, "nvidia", "cuda_runtime", "lib", "libcudart.so*"),
                 os.path.join(torch_lib, "lib", "libcudart*.so*"), "/usr/local/cuda/lib64/libcudart.so*"])


CU_STREAM_MEM_OP_WRITE_VALUE_32 = 2
BATCH_OP_BYTES = 48  # sizeof(CUstreamBatchMemOpParams), a union


def _write_batch(addresses, value=1):
    """A CUstreamBatchMemOpParams array of 32-bit writes: operation at 0, address at 8, value at 16, flags at 24."""
    buf = (ctypes.c_char * (BATCH_OP_BYTES * len(addresses)))()
    for i, address in enumerate(addresses):
        base = i * BATCH_OP_BYTES
        ctypes.c_uint32.from_buffer(buf, base).value = CU_STREAM_MEM_OP_WRITE_VALUE_32
        ctypes.c_uint64.from_buffer(buf, base + 8).value = address
        ctypes.c_uint32.from_buffer(buf, base + 16).value = value
    return buf


def _time(fn, calls, batches, active=True):
    """Median wall clock per call; a rank that is not ``active`` takes part in the barriers only."""
    per_call = []
    for _ in range(batches):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda._sleep(int((calls * 0.05 + 5) * SLEEP_CYCLES_PER_MS))  # ~50 us per call queued, and 5 ms
        t0 = time.perf_counter()
        for _ in range(calls if active else 0):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def rank_main(rank, world, args):
    import torch.distributed._symmetric_memory as symm_mem
    if args.pin_cpus:  # rank r's calling thread on CPUs [r * n, (r + 1) * n): no migrations between vCPUs
        os.sched_setaffinity(0, range(rank * args.pin_cpus, (rank + 1) * args.pin_cpus))
    rt = _cudart()
    drv = ctypes.CDLL("libcuda.so.1")
    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    rt.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    rt.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    drv.cuStreamWriteValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    drv.cuStreamWaitValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    drv.cuStreamBatchMemOp_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
    rt.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]

    nbytes = args.bytes
    storage = symm_mem.empty(2 * nbytes + 4096, dtype=torch.uint8, device="cuda")
    storage.zero_()
    handle = symm_mem.rendezvous(storage, dist.group.WORLD)
    offset = storage.data_ptr() - handle.buffer_ptrs[rank]
    peer = (rank + 1) % world
    own_sym = handle.buffer_ptrs[rank] + offset
    peer_sym = handle.buffer_ptrs[peer] + offset
    own_flag, peer_flag = own_sym + 2 * nbytes, peer_sym + 2 * nbytes
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    event = torch.cuda.Event()
    event.record()
    ev = ctypes.c_void_p(event.cuda_event)
    dev = ctypes.c_int()
    # a signed flag's batch: the signature's words and the flag (csrc/runtime/driver_api.cpp)
    writes = {where: _write_batch([flag + 4 * i for i in range(4)])
              for where, flag in (("own", own_flag), ("peer", peer_flag))}
    half = nbytes  # the symmetric region's second half is each rank's own target, the first the peer's
    rows = {
        "a Python call of a lambda (no CUDA)": lambda: None,
        "torch.empty 2048x2048 bf16 on the GPU (caching allocator)": lambda: torch.empty(
            (2048, 2048), dtype=torch.bfloat16, device="cuda") is None,
        "cudaGetDevice (the ctypes call's own cost)": lambda: rt.cudaGetDevice(ctypes.byref(dev)),
        "cudaEventRecord": lambda: rt.cudaEventRecord(ev, stream),
        "cudaMemcpyAsync allocator -> allocator": lambda: rt.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, 4,
                                                                             stream),
        "cudaMemcpyAsync allocator -> own symmetric": lambda: rt.cudaMemcpyAsync(own_sym + half, src.data_ptr(),
                                                                                 nbytes, 4, stream),
        "cudaMemcpyAsync allocator -> peer symmetric (push)": lambda: rt.cudaMemcpyAsync(peer_sym, src.data_ptr(),
                                                                                         nbytes, 4, stream),
        "cudaMemcpyAsync peer symmetric -> own symmetric (pull)": lambda: rt.cudaMemcpyAsync(
            own_sym + half, peer_sym + half, nbytes, 4, stream),
        "cudaMemcpyAsync allocator -> peer symmetric, kind DeviceToDevice": lambda: rt.cudaMemcpyAsync(
            peer_sym, src.data_ptr(), nbytes, 3, stream),
        "cuStreamWriteValue32 own symmetric": lambda: drv.cuStreamWriteValue32_v2(stream, own_flag, 1, 0),
        "cuStreamWriteValue32 peer symmetric": lambda: drv.cuStreamWriteValue32_v2(stream, peer_flag, 1, 0),
        "cuStreamWaitValue32 own symmetric (passes)": lambda: drv.cuStreamWaitValue32_v2(stream, own_flag, 0, 0),
        "cuStreamBatchMemOp 4 writes own symmetric": lambda: drv.cuStreamBatchMemOp_v2(stream, 4, writes["own"], 0),
        "cuStreamBatchMemOp 4 writes peer symmetric": lambda: drv.cuStreamBatchMemOp_v2(stream, 4, writes["peer"], 0),
        "cudaStreamWaitEvent (same stream)": lambda: rt.cudaStreamWaitEvent(stream, ev, 0),
    }
    results = []
    for name, fn in rows.items():
        rc = fn()
        if rc:  # a CUDA error code: the row would time a call that fails
            raise RuntimeError(f"{name}: CUDA error {rc}")
        torch.cuda.synchronize()
        us = _time(fn, args.calls, args.batches)
        alone = _time(fn, args.calls, args.batches, active=rank == 0)  # the other rank idle in the barrier
        every = [None] * world
        dist.all_gather_object(every, us)
        results.append({"operation": name, "host_us": round(max(every), 2),
                        "per_rank_us": [round(v, 2) for v in every], "rank0_alone_us": round(alone, 2)})
        if rank == 0:
            print(f"{name:70s} {max(every):6.2f} us (both ranks) {alone:6.2f} us (rank 0 alone)", flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m experiments.peer_copy_cost " + " ".join(args.argv),
                       "commit": os.environ.get("FLUX_LAYERS_COMMIT", "unknown"),
                       "gpu": torch.cuda.get_device_name(), "ranks_sharing_gpu0": world, "bytes": nbytes,
                       "cpus": sorted(os.sched_getaffinity(0)),
                       "method": (f"{args.calls} calls behind a GPU sleep, wall clock per call, median of "
                                  f"{args.batches} batches, maximum over ranks (both ranks timing at once); "
                                  "rank0_alone_us: the same with the other rank idle"),
                       "results": results}, f, indent=1)


def main(argv=None):
    import sys

    from flux_layers.devtools.launch import run_distributed
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=int, default=8 << 20, help="bytes per copy")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--batches", type=int, default=9)
    ap.add_argument("--pin-cpus", type=int, default=0, help="pin rank r to CPUs [r * N, (r + 1) * N) (0: none)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.environ["FLUX_LAYERS_TEST_SHARED_GPU"] = "1"  # the launcher's mode: both ranks on GPU 0, gloo for the group
    run_distributed(rank_main, 2, args, backend="nccl")


if __name__ == "__main__":
    main()
