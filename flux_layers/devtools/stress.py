"""Many pipelined fused calls checked in batches: both ops, both weight layouts, M changing call to call, eager calls
and CUDA-graph replays interleaved, one rank now and then late on the GPU; used by benchmarks/reliability.py and the
GPU tests.

Every rank draws the same sequence of calls from one seeded generator. A call takes one of a few input sets of its
problem (op, layout, rows per rank), made before the run with their fp32 reference and their bound (1.5x cuBLAS's
error on the same inputs, flux_layers/devtools/oracle.py), so that consecutive calls of a problem read different
data and a stale or unwritten output (outputs are poisoned with NaN) cannot pass. Calls are not synchronized one by
one: every ``batch`` calls, the relative errors of the batch's outputs are computed on the device and read with one
transfer. A late rank sleeps on the GPU (``torch.cuda._sleep``) before its call, so its host runs ahead and the
peer's kernels wait in their flags.

CUDA graphs must be enabled (``workspace.enable_cuda_graphs()``) before the first call of the run, so that the
workspaces come with their twins; :func:`run` does that. Without a GPU the same run takes the reference backend on
CPU tensors, with neither graphs nor late ranks (the CPU tests check its bookkeeping that way).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from flux_layers.devtools import oracle


@dataclass(frozen=True)
class StressConfig:
    calls: int = 10_000
    batch: int = 50                 # calls between checks: at most this many are in flight
    rows: tuple[int, ...] = (8, 64, 128, 264, 512, 1000, 1024)  # rows per rank (M = rows * tp)
    k: int = 1024
    n: int = 1024                   # ag_gemm: N over the group (N / tp per rank); gemm_rs: N
    input_sets: int = 4             # per problem; even sets carry a bias
    graph_share: float = 0.1        # share of calls that are CUDA-graph replays
    late_every: int = 200           # one rank sleeps on the GPU before every late_every-th call (0: never)
    late_ms: float = 100.0
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    ops: tuple[str, ...] = ("ag_gemm", "gemm_rs")
    layouts: tuple[str, ...] = ("nt", "nn")
    device: str = "cuda"            # "cpu": the reference backend, no graphs, no late rank (a dry run)


@dataclass
class _Problem:
    op: str
    layout: str
    rows: int
    sets: list = field(default_factory=list)  # (x, w, b or None, fp32 reference, bound)


def _make_problem(cfg: StressConfig, rank: int, tp: int, op: str, layout: str, rows: int, seed: int) -> _Problem:
    p = _Problem(op, layout, rows)
    m = rows * tp
    for s in range(cfg.input_sets):
        gen = torch.Generator(device=cfg.device).manual_seed(seed * 64 + s)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=cfg.device).to(cfg.dtype)
        x = rand(m, cfg.k)
        w = rand(cfg.n, cfg.k) if layout == "nt" else rand(cfg.k, cfg.n)
        b = rand(cfg.n) if s % 2 == 0 else None
        if op == "ag_gemm":  # this rank's N shard of the weight; the whole x
            w_local = w.chunk(tp, dim=0 if layout == "nt" else 1)[rank].contiguous()
            b_local = b.chunk(tp)[rank].contiguous() if b is not None else None
            ref = oracle.matmul_fp32(x, w_local, b_local, layout)
            cublas = oracle.matmul_cublas(x, w_local, b_local, layout)
            args = (x.chunk(tp)[rank].contiguous(), w_local, b_local)
        else:  # this rank's K shard of x and the weight; its rows of the sum
            args = (x.chunk(tp, dim=1)[rank].contiguous(),
                    w.chunk(tp, dim=1 if layout == "nt" else 0)[rank].contiguous(), b)
            ref = oracle.matmul_fp32(x, w, b, layout).chunk(tp)[rank].contiguous()
            cublas = oracle.matmul_cublas(x, w, b, layout).chunk(tp)[rank]
        p.sets.append((*args, ref, oracle.errors(cublas, ref)))
    return p


def _call(op: str, layout: str, group, backend: str):
    from flux_layers import ops
    fn = ops.ag_gemm if op == "ag_gemm" else ops.gemm_rs
    return lambda x, w, b: fn(x, w, b, group=group, weight_layout=layout, backend=backend)


def cycles_per_ms() -> float:
    """The GPU's clock for torch.cuda._sleep, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / max(start.elapsed_time(end), 1e-3)


class _Graph:
    """One captured call of a problem on static inputs (a set with a bias), replayed with other sets copied in."""

    def __init__(self, problem: _Problem, fn):
        self.problem, self.fn = problem, fn
        x, w, b = problem.sets[0][:3]
        self.static = (x.clone(), w.clone(), b.clone())
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(*self.static)

    def replay(self, s: int) -> torch.Tensor:
        for dst, src in zip(self.static, self.problem.sets[s][:3]):
            dst.copy_(src)
        self.graph.replay()
        return self.out.clone()


def run(rank: int, tp: int, group, cfg: StressConfig, progress: Callable[[str], None] | None = None) -> dict:
    """The stress run on this rank (every rank of ``group`` runs it with the same ``cfg``); its record."""
    from flux_layers.runtime import workspace
    cuda = cfg.device == "cuda"
    if cuda:
        workspace.enable_cuda_graphs()
    group = group if group is not None else dist.group.WORLD
    problems = []
    for op in cfg.ops:
        for layout in cfg.layouts:
            for rows in sorted(cfg.rows, reverse=True):  # the largest first: workspaces made once, at full size
                problems.append(_make_problem(cfg, rank, tp, op, layout, rows, cfg.seed + len(problems)))
    fns = {(op, layout): _call(op, layout, group, "fused" if cuda else "reference") for op in cfg.ops
           for layout in cfg.layouts}
    bounds = torch.stack([s[4] for p in problems for s in p.sets]).tolist()
    bound_of = {}
    i = 0
    for p in problems:
        for s in range(len(p.sets)):
            bound_of[(id(p), s)] = oracle.bound(bounds[i], cfg.dtype)
            i += 1
    for p in problems:  # warm-up: every call decided (the cross-rank check), the workspaces and twins made
        fns[(p.op, p.layout)](*p.sets[0][:3])
    rng = random.Random(cfg.seed)
    graphs = []
    if cuda:
        torch.cuda.synchronize()
        graphs = [_Graph(rng.choice([p for p in problems if (p.op, p.layout) == key]), fns[key]) for key in fns]
        torch.cuda.synchronize()
    sleep_cycles = int(cfg.late_ms * cycles_per_ms()) if cfg.late_every and cuda else 0
    bias_sets = list(range(0, cfg.input_sets, 2))
    counts = {"eager": 0, "graph": 0, "late": 0}
    mismatches, worst, examples = 0, 0.0, []
    pending: list = []

    def check():
        nonlocal mismatches, worst
        if not pending:
            return
        errs = torch.stack([oracle.errors(out, p.sets[s][3]) for _, out, p, s in pending]).tolist()
        for (i, out, p, s), err in zip(pending, errs):
            limit = bound_of[(id(p), s)]
            ratio = err / limit if err == err else float("inf")  # NaN: an unwritten element
            worst = max(worst, ratio)
            if not err <= limit:
                mismatches += 1
                if len(examples) < 10:
                    examples.append({"call": i, "op": p.op, "layout": p.layout, "m": p.rows * tp, "set": s,
                                     "rel_error": err, "bound": limit})
        pending.clear()

    began = time.monotonic()
    for i in range(cfg.calls):
        if cfg.late_every and i % cfg.late_every == cfg.late_every - 1:
            counts["late"] += 1
            if rank == (i // cfg.late_every) % tp and sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
        if graphs and rng.random() < cfg.graph_share:
            g = graphs[rng.randrange(len(graphs))]
            s = rng.choice(bias_sets)
            pending.append((i, g.replay(s), g.problem, s))
            counts["graph"] += 1
        else:
            p = problems[rng.randrange(len(problems))]
            s = rng.randrange(cfg.input_sets)
            pending.append((i, fns[(p.op, p.layout)](*p.sets[s][:3]), p, s))
            counts["eager"] += 1
        if len(pending) >= cfg.batch:
            check()
            if progress is not None and (i + 1) % max(cfg.batch, cfg.calls // 10 // cfg.batch * cfg.batch) == 0:
                progress(f"{i + 1} calls, {mismatches} mismatches, {time.monotonic() - began:.1f} s")
    check()
    if cuda:
        torch.cuda.synchronize()
        workspace.check_graph_replays()
    seconds = time.monotonic() - began
    return {"calls": cfg.calls, "mismatches": mismatches, "seconds": round(seconds, 2),
            "eager_calls": counts["eager"], "graph_replays": counts["graph"], "late_calls": counts["late"],
            "late_ms": cfg.late_ms if cfg.late_every else 0, "batch": cfg.batch,
            "problems": len(problems), "rows_per_rank": list(cfg.rows), "k": cfg.k, "n": cfg.n,
            "worst_error_over_bound": round(worst, 3), "first_mismatches": examples}
