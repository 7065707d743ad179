"""The fused operator calls of one transformer layer (bench_layer.py's stack), each at the layer's shape and as
the layer makes it, beside cuBLAS alone on the same GEMM and the sequential NCCL path (design.md §6 method).

    python -m benchmarks.bench_layer_ops --out benchmarks/results/layer_ops_h200x2.json

What it answers: how far each fused call is from its GEMM alone in isolation, to set against the layer profile
(benchmarks/profile_layer.py), where the same kernels run inside the step. Calls (hidden h, SwiGLU ffn f, seq s,
TP t, bias-free like the stack; the layers' defaults: column wgrad keeps the gathered input, row dgrad returns the
gathered dY for the row wgrad, column dgrad takes megatron's GEMM-then-NCCL path and is not listed):

| call | operator | M | K | N (this rank) | layout |
|---|---|---|---|---|---|
| qkv fprop | AG+GEMM, gathered out | s | h | 3h/t | nt |
| fc1 fprop | AG+GEMM, gathered out | s | h | 2f/t | nt |
| proj fprop | GEMM+RS | s | h/t | h | nt |
| fc2 fprop | GEMM+RS | s | f/t | h | nt |
| proj dgrad | AG+GEMM, gathered out | s | h | h/t | nn |
| fc2 dgrad | AG+GEMM, gathered out | s | h | f/t | nn |
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.harness import operator_main, report_operator_rows, time_ms


def layer_calls(hidden: int, ffn: int, seq: int, tp: int) -> list[dict]:
    """The fused calls of one layer: name, operator, M, K (this rank's for GEMM+RS), N (this rank's), layout."""
    return [
        dict(name="qkv_fprop", op="ag_gemm", m=seq, k=hidden, n=3 * hidden // tp, layout="nt"),
        dict(name="fc1_fprop", op="ag_gemm", m=seq, k=hidden, n=2 * ffn // tp, layout="nt"),
        dict(name="proj_fprop", op="gemm_rs", m=seq, k=hidden // tp, n=hidden, layout="nt"),
        dict(name="fc2_fprop", op="gemm_rs", m=seq, k=ffn // tp, n=hidden, layout="nt"),
        dict(name="proj_dgrad", op="ag_gemm", m=seq, k=hidden, n=hidden // tp, layout="nn"),
        dict(name="fc2_dgrad", op="ag_gemm", m=seq, k=hidden, n=ffn // tp, layout="nn"),
    ]


def _weight(k: int, n: int, layout: str, gen, dtype):
    shape = (n, k) if layout == "nt" else (k, n)
    return torch.randn(shape, generator=gen, device="cuda").to(dtype)


def _op(w, layout):
    """op(weight) of x @ op(weight): W^T for 'nt', W for 'nn'."""
    return w.t() if layout == "nt" else w


def _matmul(x, w, layout):
    return x @ _op(w, layout)


def bench_call(rank, tp, c, dtype, reps, sets=2):
    from flux_layers.ops import fused_ag_gemm, fused_gemm_rs
    group = dist.group.WORLD
    m, k, n, layout = c["m"], c["k"], c["n"], c["layout"]
    gen = torch.Generator(device="cuda").manual_seed(777 + rank)
    ws_ = [_weight(k, n, layout, gen, dtype) for _ in range(sets)]
    t = {}
    if c["op"] == "ag_gemm":
        xs = [torch.randn(m // tp, k, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
        gathered = [torch.empty(m, k, device="cuda", dtype=dtype) for _ in range(sets)]
        for i in range(sets):
            dist.all_gather_into_tensor(gathered[i], xs[i], group=group)

        def fused(i, keep=True):
            return fused_ag_gemm.ag_gemm(xs[i % sets], ws_[i % sets], group=group, weight_layout=layout,
                                         return_gathered=keep)

        out, got = fused(0)
        ref = _matmul(gathered[0], ws_[0], layout).float()
        assert torch.equal(got, gathered[0]), f"rank {rank} {c['name']}: gathered input differs"

        def seq(i):
            dist.all_gather_into_tensor(gathered[i % sets], xs[i % sets], group=group)
            return _matmul(gathered[i % sets], ws_[i % sets], layout)
        t["gemm_cublas"] = time_ms(lambda i: _matmul(gathered[i % sets], ws_[i % sets], layout), reps=reps,
                                   group=group)
        t["sequential"] = time_ms(seq, reps=reps, group=group)
        t["fused"] = time_ms(fused, reps=reps, group=group)
        t["fused_without_gathered_out"] = time_ms(lambda i: fused(i, keep=False), reps=reps, group=group)
    else:
        xs = [torch.randn(m, k, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
        partial = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
        rs_out = [torch.empty(m // tp, n, device="cuda", dtype=dtype) for _ in range(sets)]
        out = fused_gemm_rs.gemm_rs(xs[0], ws_[0], group=group, weight_layout=layout)
        full = _matmul(xs[0], ws_[0], layout)
        ref_t = torch.empty(m // tp, n, device="cuda", dtype=dtype)
        dist.reduce_scatter_tensor(ref_t, full, group=group)
        ref = ref_t.float()

        def seq(i):
            torch.matmul(xs[i % sets], _op(ws_[i % sets], layout), out=partial[i % sets])
            dist.reduce_scatter_tensor(rs_out[i % sets], partial[i % sets], group=group)
        t["gemm_cublas"] = time_ms(lambda i: _matmul(xs[i % sets], ws_[i % sets], layout), reps=reps, group=group)
        t["sequential"] = time_ms(seq, reps=reps, group=group)
        t["fused"] = time_ms(lambda i: fused_gemm_rs.gemm_rs(xs[i % sets], ws_[i % sets], group=group,
                                                              weight_layout=layout), reps=reps, group=group)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise RuntimeError(f"rank {rank} {c['name']}: fused result disagrees with the sequential path: {err}")
    return {**c, "tp": tp, "dtype": str(dtype).replace("torch.", ""), "times_ms": t, "rel_err": err,
            "fused_over_gemm": t["fused"] / t["gemm_cublas"], "sequential_over_fused": t["sequential"] / t["fused"],
            "implementation": "fused = flux_layers._C operator (FLUX_LAYERS_BACKEND ignored: called directly)"}


def run(rank, tp, args):
    dtype = getattr(torch, args.dtype)
    rows = [bench_call(rank, tp, c, dtype, args.reps) for c in layer_calls(args.hidden, args.ffn, args.seq, tp)]
    total = {k: sum(r["times_ms"][k] for r in rows) for k in ("gemm_cublas", "sequential", "fused")}
    if rank == 0:
        print(f"  sum over the calls: cuBLAS {total['gemm_cublas']:.3f} ms, sequential {total['sequential']:.3f} ms, "
              f"fused {total['fused']:.3f} ms (fused/cuBLAS {total['fused'] / total['gemm_cublas']:.3f})", flush=True)
    report_operator_rows(rank, tp, rows, [("name", "call", ""), ("m", "M", ""), ("k", "K", ""), ("n", "N", ""),
                                          ("layout", "layout", ""), ("gemm_cublas", "cuBLAS", ".3f"),
                                          ("sequential", "seq", ".3f"), ("fused", "fused", ".3f"),
                                          ("fused_over_gemm", "fused/cuBLAS", ".3f"),
                                          ("sequential_over_fused", "seq/fused", ".3f")], args.out,
                         extra={"shape": {"hidden": args.hidden, "ffn": args.ffn, "seq": args.seq}, "sum_ms": total})


def _layer_shape_args(ap) -> None:
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--ffn", type=int, default=28672)
    ap.add_argument("--seq", type=int, default=8192)


def main():
    operator_main(__doc__, None, run, add_arguments=_layer_shape_args)


if __name__ == "__main__":
    main()
