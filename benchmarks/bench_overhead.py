"""Per-call fixed cost of the public operators: host enqueue time, GPU time and the plain back-to-back loop.

For each op (ag_gemm, gemm_rs), shape (M, K, N, global sizes as in ops.plan) and weight layout, each available
implementation is timed three ways, the implementations interleaved in rounds (medians over rounds, then the
maximum over ranks):

* ``host_us``: ``--calls`` calls enqueued behind a GPU sleep long enough that the GPU never waits for the host;
  the wall-clock time of the enqueue loop per call (what the host spends per call);
* ``gpu_ms``: CUDA events around one call queued behind a GPU sleep (host cost hidden);
* ``loop_ms``: CUDA events around ``--calls`` calls issued back to back with nothing else queued (what a training
  step sees when the CPU cannot run ahead), per call.

Implementations: ``fused`` (``backend='fused'``), ``auto`` (the dispatcher's choice, recorded as ``auto_path``),
``sequential`` (``backend='reference'``: NCCL, then cuBLAS) and ``torch_symm_mem`` (torch's
``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``). Each is checked against an fp32 reference before it
is timed.

``--shared-gpu`` runs the ranks as processes sharing GPU 0 (gloo for the group; torch's symmetric memory with
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), for a machine with one GPU: the host figures are the real ones
(the host path does not depend on where the peer is), the GPU figures are not TP figures and are left out of the
results; NCCL-based implementations are skipped there. Use shapes whose persistent grid leaves SMs free (e.g.
2048x4096x4096): with the grid full, one process's GEMM spinning on its peer's data can hold every SM while the
peer's earlier kernel waits for one, until the timeout.

    python -m benchmarks.bench_overhead --out benchmarks/results/op_overhead_h200x2.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.harness import rotated, time_loop_ms, time_samples_ms

SHAPES = "2048x4096x4096,3000x4096x11008,4096x8192x8192,16384x4096x4096"
IMPLS = ("fused", "auto", "sequential", "torch_symm_mem")
DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
SLEEP_CYCLES_PER_MS = 2_000_000  # H200 SM clock ~2 GHz: torch.cuda._sleep counts cycles


def _inputs(op, rank, tp, m, k, n, layout, dtype, sets):
    """Per set: (x, w, fp32 reference of this rank's output) for the rank's shard of the global problem. FP8
    (``dtype`` float8_e4m3fn, 'nt'): x and w are ScaledTensors (each rank's shard cast with its own tensor-wise
    scale) and the reference is that of the dequantized operands."""
    if dtype == torch.float8_e4m3fn:
        return _fp8_inputs(op, rank, tp, m, k, n, layout, sets)
    out = []
    for s in range(sets):
        gen = torch.Generator(device="cuda").manual_seed(1000 * s + 7)
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        w = torch.randn(n, k, generator=gen, device="cuda").to(dtype)  # [N, K]
        if op == "ag_gemm":
            x_r = x.chunk(tp)[rank].contiguous()
            w_r = w.chunk(tp)[rank].contiguous()
            ref = x.float() @ w_r.float().t()
        else:
            x_r = x.chunk(tp, dim=1)[rank].contiguous()
            w_r = w.chunk(tp, dim=1)[rank].contiguous()
            ref = (x.float() @ w.float().t()).chunk(tp)[rank]
        w_op = w_r if layout == "nt" else w_r.t().contiguous()  # 'nn': [K, N]
        out.append((x_r, w_op, ref))
    return out


def _fp8_inputs(op, rank, tp, m, k, n, layout, sets):
    from flux_layers.ops.fp8 import dequantize, quantize
    if layout != "nt":
        raise SystemExit("FP8 operands take the 'nt' layout only")
    out = []
    for s in range(sets):
        gen = torch.Generator(device="cuda").manual_seed(1000 * s + 7)
        x = torch.randn(m, k, generator=gen, device="cuda")
        w = torch.randn(n, k, generator=gen, device="cuda")
        if op == "ag_gemm":
            shards = [quantize(x_s.contiguous()) for x_s in x.chunk(tp)]
            w_r = quantize(w.chunk(tp)[rank].contiguous())
            ref = torch.cat([dequantize(q) for q in shards]) @ dequantize(w_r).t()
            out.append((shards[rank], w_r, ref))
        else:
            parts = [(quantize(x.chunk(tp, dim=1)[r].contiguous()), quantize(w.chunk(tp, dim=1)[r].contiguous()))
                     for r in range(tp)]
            ref = sum(dequantize(xq) @ dequantize(wq).t() for xq, wq in parts).chunk(tp)[rank]
            out.append((*parts[rank], ref))
    return out


def _impl_fn(impl, op, layout, group, fp8=False):
    from flux_layers import ops
    if fp8:  # x, w: ScaledTensors (the unpacking is part of the host cost measured, ~0.1 us)
        if impl not in ("fused", "auto", "sequential"):
            raise NotImplementedError(f"{impl} is not measured with FP8 operands")
        backend = {"fused": "fused", "auto": "auto", "sequential": "reference"}[impl]
        fn = ops.ag_gemm if op == "ag_gemm" else ops.gemm_rs
        return lambda x, w: fn(x.data, w.data, group=group, x_scale=x.scale, w_scale=w.scale, backend=backend)
    if impl in ("fused", "auto", "sequential"):
        backend = {"fused": "fused", "auto": "auto", "sequential": "reference"}[impl]
        fn = ops.ag_gemm if op == "ag_gemm" else ops.gemm_rs
        return lambda x, w: fn(x, w, group=group, weight_layout=layout, backend=backend)
    import torch.distributed._symmetric_memory as symm_mem
    symm_mem.enable_symm_mem_for_group(group.group_name)
    if op == "ag_gemm":
        def torch_ag(x, w):
            b = w.t() if layout == "nt" else w
            return torch.ops.symm_mem.fused_all_gather_matmul(x, [b], 0, group.group_name, return_A=False)[1][0]
        return torch_ag

    def torch_rs(x, w):
        b = w.t() if layout == "nt" else w
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, b, "sum", 0, group.group_name)
    return torch_rs


def _host_us(fn, data, calls, sleep_ms, in_flight):
    """Median over batches of the enqueue time per call, ``in_flight`` calls a batch queued behind a GPU sleep."""
    per_call = []
    for first in range(0, calls, in_flight):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda._sleep(int(sleep_ms * SLEEP_CYCLES_PER_MS))
        t0 = time.perf_counter()
        for i in range(first, first + in_flight):
            fn(*data[i % len(data)][:2])
        per_call.append((time.perf_counter() - t0) / in_flight * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def _breakdown(rank, op, m, k, n, layout, data, group, args):
    """Host time of the parts of one fused call (flux_layers.ops on the fused path): the decision's lookup as the op
    makes it (asked for the fused path and for the automatic choice), torch's query whether the stream is being
    captured, the op library's call alone as the op makes it (the decision's direct call where it applies,
    flux_layers/ops/_opcalls.py), the same through the registered op, and, for ag_gemm, without its GEMM launch,
    calling an op of the same signature that does nothing, the plain GEMM's launch, and allocating an output.
    Measured as ``host_us`` (same batches), then the maximum over ranks."""
    from flux_layers import ops
    from flux_layers.ops import _dispatch, _opcalls
    x, w, _ = data[0]
    call = ops.ag_gemm if op == "ag_gemm" else ops.gemm_rs
    call(x, w, group=group, weight_layout=layout, backend="fused")  # decided and bound
    decision = ops.decide(op, x, w, group=group, weight_layout=layout, backend="fused")
    ws, weight_nn = decision.workspace, layout == "nn"
    plan = ws.plan_index(decision.plan)

    def lookup(backend):
        return lambda x, w: _dispatch._decisions.get(_dispatch.call_key(op, group, x.shape, w.shape, x.dtype,
                                                                        x.get_device(), layout, backend))
    parts = {"dispatch_lookup": lookup("fused"), "dispatch_lookup_auto": lookup(None),
             "capture_query": lambda x, w: torch.cuda.is_current_stream_capturing()}
    if op == "ag_gemm":
        registered = torch.ops.flux_layers.ag_gemm.default
        parts["op_call"] = lambda x, w: decision.run(x, w, None, False)
        parts["op_call_registered"] = lambda x, w: registered(x, w, None, ws.handle, plan, weight_nn, False, True)
        without_gemm = _opcalls.ag_gemm(ws, plan, weight_nn, run_gemm=False)
        parts["op_call_without_gemm"] = lambda x, w: without_gemm(x, w, None, False)
    else:
        registered = torch.ops.flux_layers.gemm_rs.default
        parts["op_call"] = lambda x, w: decision.run(x, w, None)
        parts["op_call_registered"] = lambda x, w: registered(x, w, None, ws.handle, plan, weight_nn)
    out_rows = m if op == "ag_gemm" else m // dist.get_world_size(group)
    out_cols = n // dist.get_world_size(group) if op == "ag_gemm" else n
    parts["call_an_empty_op"] = lambda x, w: torch.ops.flux_layers.call_overhead_probe.default(
        x, w, None, ws.handle, plan, weight_nn, False, True)
    parts["allocate_output"] = lambda x, w: torch.empty((out_rows, out_cols), device=x.device, dtype=x.dtype)
    full_x = torch.randn(out_rows, x.shape[1], device="cuda").to(x.dtype)
    gemm_out = torch.empty((out_rows, out_cols), device="cuda", dtype=x.dtype)
    parts["plain_gemm_launch"] = lambda x, w: torch.ops.flux_layers.gemm(full_x, w, None, None, None, gemm_out,
                                                                         weight_nn, 1, 0, 16, 75, False)
    rows = []
    for name, fn in parts.items():
        for d in data:  # warm: a first call decides (a collective) and would dominate a single batch's median
            fn(*d[:2])
        us = _host_us(fn, data, args.calls, args.sleep_ms, args.in_flight)
        rows.append({"op": op, "m": m, "k": k, "n": n, "layout": layout, "impl": "fused", "part": name,
                     "host_us": _max_over_ranks(us)})
    return rows


def _gpu_ms(fn, data, reps, group):
    """Median milliseconds of one call behind a 1 ms GPU sleep, the ranks lined up before each."""
    return statistics.median(time_samples_ms(lambda i: fn(*data[i % len(data)][:2]), reps=reps, warmup=0,
                                             group=group, sleep_cycles=SLEEP_CYCLES_PER_MS, reduce_ranks=False))


def _loop_ms(fn, data, calls, group):
    """Milliseconds per call of ``calls`` calls issued back to back."""
    return time_loop_ms(lambda i: fn(*data[i % len(data)][:2]), calls=calls, warmup=0, group=group)


def _max_over_ranks(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return None if any(v is None for v in values) else max(values)


def _check(fn, data, what):
    for x, w, ref in data:
        out = fn(x, w).float()
        err = ((out - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise RuntimeError(f"{what}: relative error {err:.3e} against fp32")


def bench_case(rank, tp, op, m, k, n, layout, args, group, impls):
    """Rows of one op, shape and layout: every implementation in every dtype of ``--dtype``, all interleaved in the
    same rounds (so that the dtypes compare within one run)."""
    from flux_layers import ops
    fns, data, rows = {}, {}, []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        fp8 = dtype == torch.float8_e4m3fn
        data[name] = _inputs(op, rank, tp, m, k, n, layout, dtype, sets=2)
        for impl in impls:
            try:
                fn = _impl_fn(impl, op, layout, group, fp8)
                _check(fn, data[name], f"rank {rank} {op} {m}x{k}x{n} {layout} {impl} {name}")
            except Exception as exc:  # an implementation that cannot run here is reported, not hidden
                if impl == "torch_symm_mem":
                    if rank == 0:
                        print(f"  {impl} {name} skipped: {type(exc).__name__}: {exc}", flush=True)
                    continue
                raise
            fns[impl, name] = fn
    auto_paths = {}
    for name in args.dtypes:
        x0, w0, _ = data[name][0]
        auto_paths[name] = (ops.decide(op, x0.data, w0.data, group=group) if name == "float8_e4m3fn" else
                            ops.plan(op, x0, w0, group=group, weight_layout=layout)).path
    samples = {key: {"host_us": [], "gpu_ms": [], "loop_ms": []} for key in fns}
    keys = list(fns)
    for r in range(args.rounds):
        for key in rotated(keys, r, args.rounds):
            fn, inputs = fns[key], data[key[1]]
            samples[key]["host_us"].append(_host_us(fn, inputs, args.calls, args.sleep_ms, args.in_flight))
            if not args.shared_gpu:
                samples[key]["gpu_ms"].append(_gpu_ms(fn, inputs, args.reps, group))
                samples[key]["loop_ms"].append(_loop_ms(fn, inputs, args.calls, group))
    for (impl, name) in fns:
        med = {key: statistics.median(v) if v else None for key, v in samples[impl, name].items()}
        row = {"op": op, "m": m, "k": k, "n": n, "layout": layout, "impl": impl, "dtype": name,
               **{key: _max_over_ranks(v) for key, v in med.items()}}
        if impl == "auto":
            row["auto_path"] = auto_paths[name]
        rows.append(row)
    return rows


def main_rank(rank, tp, args):
    import flux_layers
    from flux_layers import _library
    group = dist.group.WORLD
    impls = [i for i in args.impls.split(",") if i]
    if args.shared_gpu:
        impls = [i for i in impls if i in ("fused", "auto")]
    results, breakdown = [], []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.lower().split("x"))
        for op in args.ops.split(","):
            for layout in args.layouts.split(","):
                rows = bench_case(rank, tp, op, m, k, n, layout, args, group, impls)
                results += rows
                breakdown_dtype = next((d for d in args.dtypes if d != "float8_e4m3fn"), None)
                if args.breakdown and "fused" in impls and breakdown_dtype is not None:
                    parts = _breakdown(rank, op, m, k, n, layout,
                                       _inputs(op, rank, tp, m, k, n, layout, getattr(torch, breakdown_dtype), sets=1),
                                       group, args)
                    breakdown += parts
                    if rank == 0:
                        print("    " + "  ".join(f"{r['part']} {r['host_us']:.1f} us" for r in parts), flush=True)
                if rank == 0:
                    for r in rows:
                        gpu = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.3f}"
                        loop = "-" if r["loop_ms"] is None else f"{r['loop_ms']:.3f}"
                        print(f"{op:8s} {m}x{k}x{n} {layout} {r['dtype']:13s} {r['impl']:15s} "
                              f"host {r['host_us']:7.1f} us  gpu {gpu} ms  loop {loop} ms {r.get('auto_path', '')}",
                              flush=True)
    if rank == 0 and args.out:
        import json
        import platform
        import subprocess
        try:
            commit = os.environ.get("FLUX_LAYERS_COMMIT") or subprocess.check_output(
                ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
        except Exception:
            commit = "unknown"
        payload = {
            "command": " ".join(["python -m benchmarks.bench_overhead"] + args.argv),
            "commit": commit, "gpu": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(),
            "tp": tp, "shared_gpu": args.shared_gpu, "library": os.path.dirname(flux_layers.__file__),
            "torch": torch.__version__, "python": platform.python_version(),
            # (a tree from before the direct calls has neither function: scripts/gpu_check.sh's baseline_overhead)
            "direct_calls": getattr(_library, "direct_calls", lambda: None)() is not None,
            "direct_calls_unavailable": getattr(_library, "direct_calls_unavailable_reason",
                                                lambda: "the library predates them")(),
            "method": (f"host_us: {args.calls} calls enqueued behind a {args.sleep_ms} ms GPU sleep, "
                       f"{args.in_flight} at a time, wall clock per call (median over batches); gpu_ms: CUDA "
                       f"events around one call behind a 1 ms GPU sleep, median of {args.reps}; "
                       f"loop_ms: CUDA events around {args.calls} back-to-back calls, per call; each the median over "
                       f"{args.rounds} interleaved rounds, then the maximum over ranks; 2 random input sets, each "
                       "implementation checked against fp32 first"
                       + ("; shared GPU: ranks share one GPU, so only host_us is a TP figure" if args.shared_gpu
                          else "")),
            "pin_cpus_per_rank": args.pin_cpus,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("FLUX_LAYERS_", "NCCL_", "TORCH_SYMM",
                                                                          "NVSHMEM_", "CUDA_DEVICE_MAX"))},
            "results": results,
            "breakdown": breakdown,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.out}", flush=True)


def _worker(rank, world, args, port):
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if args.pin_cpus:  # rank r on CPUs [r * n, (r + 1) * n): no migrations between vCPUs (threads made later inherit)
        os.sched_setaffinity(0, range(rank * args.pin_cpus, (rank + 1) * args.pin_cpus))
    if args.shared_gpu:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        main_rank(rank, world, args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None):
    import socket
    import sys

    import torch.multiprocessing as mp
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN (global sizes)")
    ap.add_argument("--ops", default="ag_gemm,gemm_rs")
    ap.add_argument("--layouts", default="nt,nn")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--dtype", default="bfloat16",
                    help=f"comma-separated, of {', '.join(DTYPES)}, timed in the same interleaved rounds; "
                    "float8_e4m3fn: e4m3 x e4m3 with tensor-wise scales ('nt' only), out bfloat16")
    ap.add_argument("--calls", type=int, default=20, help="calls per host-cost and loop measurement")
    ap.add_argument("--reps", type=int, default=20, help="repetitions per GPU-time measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sleep-ms", type=float, default=50.0, help="GPU sleep the host-cost calls queue behind")
    ap.add_argument("--nprocs", type=int, default=0, help="ranks (default: every GPU; 2 with --shared-gpu)")
    ap.add_argument("--shared-gpu", action="store_true", help="ranks share GPU 0 (host figures only)")
    ap.add_argument("--in-flight", type=int, default=0, help="calls per host-cost batch (default: --calls)")
    ap.add_argument("--breakdown", action="store_true", help="also time the parts of a fused call")
    ap.add_argument("--pin-cpus", type=int, default=0,
                    help="pin rank r to CPUs [r * N, (r + 1) * N) (0: no pinning, the default)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.dtypes = [d for d in args.dtype.split(",") if d]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        ap.error(f"--dtype {args.dtype!r}: each must be one of {', '.join(DTYPES)}")
    if "float8_e4m3fn" in args.dtypes and args.layouts != "nt":
        ap.error("--dtype float8_e4m3fn is timed with --layouts nt only (FP8 operands are K-major)")
    args.in_flight = args.in_flight or args.calls
    if args.calls % args.in_flight:
        ap.error(f"--calls {args.calls} is not a multiple of --in-flight {args.in_flight}")
    world = args.nprocs or (2 if args.shared_gpu else torch.cuda.device_count())
    if world < 2:
        ap.error(f"needs at least 2 ranks ({torch.cuda.device_count()} GPUs visible; --shared-gpu runs 2 on one)")
    if args.pin_cpus < 0 or world * args.pin_cpus > len(os.sched_getaffinity(0)):
        ap.error(f"--pin-cpus {args.pin_cpus}: {world} ranks need {world * args.pin_cpus} CPUs, "
                 f"{len(os.sched_getaffinity(0))} are available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, args, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
