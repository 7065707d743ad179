"""Host cost of a few torch calls from Python on the GPU machine: the scale of the Python side of a fused call. Each
figure is the wall time per call of 300 calls queued behind a GPU sleep, median of 7.

One process by default (results in benchmarks/results/cuda_api_cost_h200.json, beside the CUDA calls'). ``--ranks 2``
times the same calls in each of two processes sharing GPU 0 with a gloo group, as the shared-GPU host-cost benchmark
(benchmarks/bench_overhead.py --shared-gpu) runs its ranks, and ``--after-ops`` first makes each rank run fused
AllGather+GEMM calls (2048x4096x4096, bf16), so that its workspace, streams and peer mappings exist: the three
settings tell whether torch's own calls cost more in that benchmark because of its processes or because of the op
library's state (docs/experiments.md, per-call host cost). The maximum over ranks is reported.

    python -m experiments.torch_host_cost [--ranks 2 [--after-ops]] [--out FILE]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch


def per_call(fn, calls=300, reps=7, keep=False):
    """``keep``: the results stay alive until the batch is timed (no deallocation inside the loop)."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(60_000_000)
        kept = []
        t0 = time.perf_counter()
        if keep:
            for _ in range(calls):
                kept.append(fn())
        else:
            for _ in range(calls):
                fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        del kept
    torch.cuda.synchronize()
    return statistics.median(samples)


def measure():
    x = torch.randn(1024, 4096, device="cuda").bfloat16()

    def empty():
        return torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16)

    rows = [
        ("empty lambda", lambda: None, {}),
        ("torch.empty cuda 2048x2048 bf16 (freed each call)", empty, {}),
        ("x.view(-1) (a new tensor object, freed)", lambda: x.view(-1), {}),
        ("x.shape", lambda: x.shape, {}),
        ("x.data_ptr()", lambda: x.data_ptr(), {}),
        ("torch.cuda.current_stream()", torch.cuda.current_stream, {}),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing, {}),
        ("torch.empty cuda 2048x2048 bf16 (kept)", empty, {"keep": True}),
        ("x.view(-1) (kept)", lambda: x.view(-1), {"keep": True}),
        ("x + x cuda (kept)", lambda: x + x, {"keep": True, "calls": 100}),
    ]
    return {name: per_call(fn, **kw) for name, fn, kw in rows}


def run_ops(rank, tp):
    """Fused AllGather+GEMM calls of this rank's shard of 2048x4096x4096 (bf16, 'nt'), checked against fp32."""
    import torch.distributed as dist

    from flux_layers import ops
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(2048, 4096, generator=gen, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, generator=gen, device="cuda").bfloat16()
    x_r, w_r = x.chunk(tp)[rank].contiguous(), w.chunk(tp)[rank].contiguous()
    for _ in range(20):
        out = ops.ag_gemm(x_r, w_r, group=dist.group.WORLD, backend="fused")
    ref = x.float() @ w_r.float().t()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise RuntimeError(f"rank {rank}: fused ag_gemm relative error {err:.3e}")
    return ops.decide("ag_gemm", x_r, w_r, group=dist.group.WORLD, backend="fused").choice.path


def _worker(rank, world, args, port, results):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1")
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        path = run_ops(rank, world) if args.after_ops else None
        dist.barrier()
        figures = measure()
        gathered = [None] * world
        dist.all_gather_object(gathered, figures)
        if rank == 0:
            results.put({"path": path, "per_rank": gathered})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1, help="processes sharing GPU 0 (gloo group when 2 or more)")
    ap.add_argument("--after-ops", action="store_true", help="each rank runs fused ag_gemm calls first (--ranks >= 2)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.after_ops and args.ranks < 2:
        ap.error("--after-ops needs --ranks 2 or more")
    if args.ranks == 1:
        torch.cuda.init()
        figures, path, per_rank = measure(), None, None
    else:
        import torch.multiprocessing as mp

        from flux_layers.devtools.launch import free_port
        port = free_port()
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_worker, args=(args.ranks, args, port, results), nprocs=args.ranks, join=True)
        got = results.get()
        path, per_rank = got["path"], got["per_rank"]
        figures = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    for name, us in figures.items():
        print(f"{name}: {us:.2f} us")
    if args.out:
        command = " ".join(["python -m experiments.torch_host_cost"] + (sys.argv[1:] if argv is None else argv))
        payload = {"command": command,
                   "commit": os.environ.get("FLUX_LAYERS_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(),
                   "ranks": args.ranks, "after_ops": args.after_ops, "fused_path": path,
                   "method": "wall time per call of 300 calls behind a GPU sleep, median of 7; max over ranks",
                   "us": figures, "per_rank": per_rank}
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
