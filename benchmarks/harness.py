"""Timing and reporting shared by the benchmarks (design.md §6).

* every variant of a shape is timed in the same process, back to back, on random inputs (rotated among a few
  sets so small shapes do not run from L2);
* one timed repetition = CUDA events around one call; before each repetition the GPU sleeps briefly (the CPU
  runs ahead, so launch overhead is not timed) and, with several ranks, a tiny NCCL all-reduce lines the ranks
  up on the GPU;
* the figure is the median over >= 30 repetitions after warm-up, then the maximum over ranks;
* results go to JSON with the command, commit, GPU model and count.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from statistics import median

import torch
import torch.distributed as dist

from flux_layers.devtools.records import environment, write_json


def time_ms(fn, *, reps: int = 30, warmup: int = 5, group=None, sleep_cycles: int = 2_000_000) -> float:
    """Median milliseconds of ``fn(i)`` over ``reps`` repetitions, max over the ranks of ``group``."""
    ms = median(time_samples_ms(fn, reps=reps, warmup=warmup, group=group, sleep_cycles=sleep_cycles,
                                reduce_ranks=False))
    return ms if group is None else _max_over_ranks(ms, group)


@contextlib.contextmanager
def env_override(**values: str | None):
    """Set FLUX_LAYERS_<name>=value for the duration; None leaves a setting as it is. The library decides each
    distinct call once, reading the settings then: where a setting is set, the decisions are refreshed on entry
    and on exit, so the next call of each is decided again (a cost of its own: enter this outside timed code)."""
    from flux_layers import ops
    values = {k: v for k, v in values.items() if v is not None}
    if not values:
        yield
        return
    saved = {k: os.environ.get("FLUX_LAYERS_" + k) for k in values}
    os.environ.update({"FLUX_LAYERS_" + k: v for k, v in values.items()})
    ops.refresh_settings()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop("FLUX_LAYERS_" + k, None)
            else:
                os.environ["FLUX_LAYERS_" + k] = v
        ops.refresh_settings()


def _max_over_ranks(ms: float, group) -> float:
    t = torch.tensor([ms], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def time_samples_ms(fn, *, reps: int, warmup: int = 5, group=None, sleep_cycles: int = 2_000_000,
                    reduce_ranks: bool = True) -> list[float]:
    """Milliseconds of each of ``reps`` repetitions of ``fn(i)`` (CUDA events, after a GPU sleep and, with a
    group, an all-reduce that lines the ranks up); with ``reduce_ranks``, each the maximum over the ranks."""
    tiny = torch.zeros(1, device="cuda") if group is not None else None
    for i in range(warmup):
        fn(i)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for i in range(reps):
        torch.cuda._sleep(sleep_cycles)
        if group is not None:
            dist.all_reduce(tiny, group=group)
        starts[i].record()
        fn(warmup + i)
        ends[i].record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    if group is not None and reduce_ranks:
        t = torch.tensor(samples, device="cuda", dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        samples = t.tolist()
    return samples


def rotated(keys: list, r: int, rounds: int) -> list:
    """``keys`` in round ``r``'s order of ``rounds``: the rounds start at evenly spread keys, so the machine's drift
    over a run falls on all of them alike."""
    shift = r * len(keys) // rounds
    return keys[shift:] + keys[:shift]


def time_loop_ms(fn, *, calls: int, warmup: int = 3, group=None) -> float:
    """Milliseconds per call of ``calls`` calls of ``fn(i)`` issued back to back (CUDA events around the loop, no
    sleep): what a training loop sees, host cost included wherever the CPU cannot keep ahead of the GPU. With a
    group, the ranks start the loop together (a barrier after the warm-up)."""
    for i in range(warmup):
        fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group=group)
    start.record()
    for i in range(calls):
        fn(warmup + i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def time_loops_interleaved(variants: dict, *, calls: int, rounds: int) -> dict:
    """Per-call milliseconds of every ``variants[key]`` (:func:`time_loop_ms`), one sample per round, the order
    rotated per round as in :func:`time_interleaved`."""
    samples = {key: [] for key in variants}
    for r in range(rounds):
        for key in rotated(list(variants), r, rounds):
            samples[key].append(time_loop_ms(variants[key], calls=calls))
    return samples


def time_interleaved(variants: dict, *, reps: int, rounds: int, warmup: int = 5, group=None,
                     on_round=None, windows: list | None = None, settings: dict | None = None) -> dict:
    """Samples (ms) of every ``variants[key](i)``: ``rounds`` rounds, each timing every variant for ``reps``
    repetitions (:func:`time_samples_ms`), the order rotated so that the rounds start at evenly spread
    variants; the machine's drift over the run then falls on all variants alike. ``on_round(r, samples)`` is
    called after each round; ``windows`` receives (key, start, end) wall-clock times of each variant's repetitions,
    warm-up included (for flux_layers.devtools.gpu_monitor). ``settings[key]`` (optional): a context manager
    factory (e.g. ``lambda: env_override(...)``) entered around each of the variant's timing runs, warm-up
    included: its settings hold before the warm-up, where the library decides the variant's calls, and the timed
    repetitions reuse those decisions (entering settings inside ``variants[key]`` would decide anew every step)."""
    samples = {key: [] for key in variants}
    keys = list(variants)
    settings = settings or {}
    for r in range(rounds):
        for key in rotated(keys, r, rounds):
            began = time.time()
            with settings.get(key, contextlib.nullcontext)():
                samples[key] += time_samples_ms(variants[key], reps=reps, warmup=warmup, group=group)
            if windows is not None:
                windows.append((key, began, time.time()))
        if on_round is not None:
            on_round(r, samples)
    return samples


def cuda_kernels_of(fn) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` launches (torch profiler), e.g. which cuBLAS kernel a
    matmul picked; ['unknown: ...'] if the profiler cannot say."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        return names or ["unknown: no CUDA kernel recorded"]
    except Exception as exc:  # the figure stays useful without the name
        return [f"unknown: {type(exc).__name__}: {exc}"]


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    header = "  ".join(f"{h:>{max(len(h), 9)}}" for _, h, _ in columns)
    print(header)
    for r in rows:
        cells = []
        for key, h, fmt in columns:
            v = r.get(key)
            s = format(v, fmt) if isinstance(v, (int, float)) and fmt else str(v)
            cells.append(f"{s:>{max(len(h), 9)}}")
        print("  ".join(cells))
    sys.stdout.flush()


def parse_shapes(text: str, form: str = "MxKxN") -> list[tuple[int, ...]]:
    """'4096x8192x8192,2048x4096x4096' -> [(4096, 8192, 8192), ...], each with as many sizes as ``form`` names
    ('MxKxN': (M, K, N); 'ROWSxCOLS': (rows, cols))."""
    dims = form.count("x") + 1
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != dims:
            raise ValueError(f"shape {item!r} is not {form}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def positive_ints(text: str) -> tuple[int, ...]:
    """'8,16' -> (8, 16): an argparse ``type`` for options taking comma-separated positive integers (argparse turns
    the error into a usage message naming the option)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"comma-separated positive integers expected, got {text!r}")
    return values


def spawn_ranks(main, nprocs: int, args) -> None:
    """Run ``main(rank, world, args)`` in ``nprocs`` processes with NCCL (unless launched by torchrun)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init_and_run(rank, world, main, args, None)
        return
    import torch.multiprocessing as mp

    from flux_layers.devtools.launch import free_port
    port = free_port()
    mp.spawn(_init_and_run, args=(nprocs, main, args, port), nprocs=nprocs, join=True)


def _init_and_run(rank, world, main, args, port):
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    if port is not None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
    try:
        main(rank, world, args)
    finally:
        dist.destroy_process_group()


OPERATOR_METHOD = ("CUDA events around one call, GPU sleep + NCCL all-reduce before each repetition, median of reps "
                   "after warm-up, max over ranks, 2 rotated random input sets")


# Kernel configurations the operator benchmarks time side by side with the default one: name -> (tile
# configuration id, swizzle panel, stream-K tail as the ops take it, see tuning.stream_k_fill).
KERNEL_VARIANTS = {"256x128_swz8_dp": (0, 8, False), "256x128_swz8_sk": (0, 8, True),
                   "128x256_swz16_dp": (1, 16, False), "128x256_swz16_sk": (1, 16, True)}


def check_kernel_variants(call, ref: torch.Tensor, what: str) -> None:
    """``call(tile=, swizzle=, stream_k=)`` for every KERNEL_VARIANTS entry must match ``ref`` (relative error
    < 1e-2) before anything is timed."""
    ref = ref.float()
    for name, (tile, swizzle, sk) in KERNEL_VARIANTS.items():
        out = call(tile=tile, swizzle=swizzle, stream_k=sk).float()
        err = ((out - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise RuntimeError(f"{what} {name}: relative error {err} against the baseline's result")


def overlap_figures(t: dict, comm: str, seq: str) -> dict:
    """design.md §6's derived figures from the times ``t`` (ms): bound = max(cuBLAS GEMM alone, t[comm]),
    fused/bound, seq/fused, overlap efficiency E and torch's fused op / ours."""
    gemm, fused, torch_fused = t["gemm_cublas"], t["fused"], t["torch_symm_mem_fused"]
    bound = max(gemm, t[comm])
    return {"bound_ms": bound, "fused_over_bound": fused / bound, "seq_over_fused": t[seq] / fused,
            "overlap_efficiency": 1 - (fused - gemm) / max(t[seq] - gemm, 1e-9),
            "torch_over_fused": torch_fused / fused if torch_fused else None}


def time_kernel_variants(call, *, reps: int, group) -> dict[str, float]:
    """``call(i, tile=, swizzle=, stream_k=)`` timed for every KERNEL_VARIANTS entry: {'fused_<name>': ms}."""
    return {f"fused_{name}": time_ms(lambda i, c=cfg: call(i, tile=c[0], swizzle=c[1], stream_k=c[2]),
                                     reps=reps, group=group)
            for name, cfg in KERNEL_VARIANTS.items()}


def operator_columns(own: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The table columns of an operator benchmark (bench_ag_gemm, bench_gemm_rs): the shape and cuBLAS's GEMM, the
    benchmark's ``own`` timings, then the derived figures and the automatic choice."""
    return ([("m", "M", ""), ("k", "K", ""), ("n", "N", ""), ("gemm_cublas", "gemm", ".3f")] + own
            + [("fused_over_bound", "fused/bound", ".3f"), ("seq_over_fused", "seq/fused", ".3f"),
               ("overlap_efficiency", "E", ".2f"), ("dispatch_auto", "auto", "")])


def report_operator_rows(rank: int, tp: int, rows: list[dict], columns: list[tuple[str, str, str]], out: str,
                         extra: dict | None = None) -> None:
    """Rank 0: print the per-shape table (times flattened next to the derived figures) and write the JSON
    (``extra``: more top-level fields, before the results)."""
    if rank != 0:
        return
    flat = [{**{k: v for k, v in r.items() if k != "times_ms"}, **r["times_ms"]} for r in rows]
    print_table(flat, columns)
    if out:
        write_json(out, {**environment(tp), "method": OPERATOR_METHOD, **(extra or {}), "results": rows})


def operator_main(doc: str, default_shapes: str | None, run, add_arguments=None) -> None:
    """Command line shared by the operator benchmarks; ``run(rank, world, args)`` runs in every rank.
    ``default_shapes`` None: no --shapes option; ``add_arguments(parser)`` adds a benchmark's own options."""
    import argparse
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if default_shapes is not None:
        ap.add_argument("--shapes", default=default_shapes, help="comma-separated MxKxN")
    if add_arguments is not None:
        add_arguments(ap)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--nprocs", type=int, default=0, help="ranks (default: all visible GPUs)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    spawn_ranks(run, args.nprocs or torch.cuda.device_count(), args)
