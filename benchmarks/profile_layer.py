"""Where a layer-stack step spends its GPU time: kernel time per category, flux spec vs baseline spec.

    python -m benchmarks.profile_layer --out benchmarks/results/layer_profile_h200x2.json

Builds the same blocks as benchmarks/bench_layer.py, runs a few fwd+bwd steps of each under torch.profiler and
sums the CUDA kernel time per category (GEMM by cuBLAS, flux's persistent GEMM, NCCL, attention, the rest) per
step, next to the step's wall time (CUDA events). Kernels on different streams overlap (NCCL beside a GEMM,
copy-engine transfers beside the fused kernels), so the categories may add up to more than the step. Rank 0
prints and writes the result. `baseline_no_comm` is the baseline with megatron-core's collectives as local copies
(flux_layers/devtools/no_comm.py), the same kernels without NCCL beside them. `--trace-dir DIR` also writes each rank's
Chrome trace of the profiled steps per variant (DIR/<variant>_rank<r>.json.gz).
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import os
import re
import shutil
from collections import defaultdict

import torch
import torch.distributed as dist

from benchmarks.bench_layer import add_shape_args, build_block, setup_ranks, step_tensors
from benchmarks.harness import spawn_ranks
from flux_layers.devtools.no_comm import megatron_collectives_as_local_copies
from flux_layers.devtools.records import environment, write_json

CATEGORIES = (  # first match wins
    ("flux_gemm", re.compile(r"flux.*gemm_kernel|gemm_kernel.*flux")),
    ("nccl", re.compile(r"nccl", re.I)),
    ("cublas_gemm", re.compile(r"gemm|xmma|nvjet|cutlass", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def profile_variant(block, inp, dy, steps: int, trace: str | None = None) -> dict:
    def step():
        out = block(inp, attention_mask=None)
        out.backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
    per_cat = defaultdict(float)
    top = defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        per_cat[category(ev.name)] += us / 1e3 / steps
        top[ev.name[:120]] += us / 1e3 / steps
    return {"step_ms": start.elapsed_time(end) / steps,
            "kernel_ms_per_step": dict(sorted(per_cat.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms_per_step": dict(sorted(top.items(), key=lambda kv: -kv[1])[:15])}


def run(rank, tp, args):
    from megatron.core import parallel_state

    setup_ranks(tp)
    x, dy = step_tensors(rank, tp, args)
    results = {}
    for name, baseline in (("baseline", True), ("baseline_no_comm", True), ("flux", False)):
        block = build_block(args, baseline)
        inp = x.clone().requires_grad_(True)
        trace = os.path.join(args.trace_dir, f"{name}_rank{rank}.json") if args.trace_dir else None
        no_comm = megatron_collectives_as_local_copies if name == "baseline_no_comm" else contextlib.nullcontext
        with no_comm():
            results[name] = profile_variant(block, inp, dy, args.steps, trace)
        block = None
        torch.cuda.empty_cache()
        if rank == 0:
            r = results[name]
            print(f"  {name}: step {r['step_ms']:.2f} ms; kernel ms per step: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["kernel_ms_per_step"].items()), flush=True)
            for k, v in r["top_kernels_ms_per_step"].items():
                print(f"      {v:8.2f}  {k}", flush=True)
    if rank == 0 and args.out:
        write_json(args.out, {**environment(tp), "shape": vars(args),
                              "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                              "method": "torch.profiler CUDA kernel times summed per category, per step, rank 0",
                              "results": results})
    parallel_state.destroy_model_parallel()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace-dir", default="", help="write each rank's Chrome trace per variant here")
    args = ap.parse_args()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    os.environ.setdefault("FLUX_LAYERS_BACKEND", "auto")
    spawn_ranks(run, args.nprocs or torch.cuda.device_count(), args)


if __name__ == "__main__":
    main()
