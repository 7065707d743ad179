"""GEMM + ReduceScatter: the fused operator beside every baseline, one run, per shape (design.md §6).

    python -m benchmarks.bench_gemm_rs --out benchmarks/results/gemm_rs_h200x2.json

Shapes are MxKxN with K the global reduction size (each rank holds K/tp). Variants: cuBLAS GEMM alone, our
GEMM alone, NCCL reduce-scatter alone, GEMM then NCCL reduce_scatter_tensor, torch's
fused_matmul_reduce_scatter, and the fused operator; bound = max(GEMM alone, reduce-scatter alone).

The transport is the library's choice for the group; every row and the JSON say which ran (``transport``). With
the NCCL transport, which the reduce-scatter takes only when forced (across nodes, or emulated on one machine:

    FLUX_LAYERS_TRANSPORT=nccl FLUX_LAYERS_NODE_SIZE=1 python -m benchmarks.bench_gemm_rs \
        --out benchmarks/results/gemm_rs_internode_h200x2.json

) the variants are: cuBLAS GEMM alone, our GEMM alone on all SMs and on the SMs the fused op leaves it beside
NCCL, NCCL reduce-scatter alone, cuBLAS then NCCL reduce-scatter, torch's fused op, and the fused operator over
NCCL (flux_layers/runtime/multinode/nccl_rs_transport.py) with the default and the other kernel configurations; bound =
max(GEMM alone, NCCL reduce-scatter alone). With the hybrid transport (the two-level plan: node partials summed
inside each node, one NCCL send per node partial; 4+ GPUs, nodes emulated by the declared node size:

    FLUX_LAYERS_TRANSPORT=hybrid FLUX_LAYERS_NODE_SIZE=2 python -m benchmarks.bench_gemm_rs \
        --out benchmarks/results/gemm_rs_hybrid_h200x4.json

) the same variants, and the flat NCCL transport's fused operator beside it (``fused_nccl_flat``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.harness import (
    check_kernel_variants,
    operator_columns,
    operator_main,
    overlap_figures,
    parse_shapes,
    report_operator_rows,
    time_kernel_variants,
    time_ms,
)
from flux_layers.runtime.tuning import RS_TRANSPORTS as TRANSPORTS

DEFAULT_SHAPES = "4096x8192x8192,8192x28672x8192,8192x12288x12288,2048x4096x4096,16384x4096x4096"


def _inputs(rank, tp, m, k, n, dtype, sets):
    """This rank's x shards [M, K/tp] and weight shards [N, K/tp] of ``sets`` random input sets, and buffers for
    the unfused path: the partial product [M, N] and its reduce-scattered rows [M/tp, N]."""
    gen = torch.Generator(device="cuda").manual_seed(4321 + rank)
    xs = [torch.randn(m, k // tp, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
    ws_ = [torch.randn(n, k // tp, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
    partial = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
    rs_out = [torch.empty(m // tp, n, device="cuda", dtype=dtype) for _ in range(sets)]
    return xs, ws_, partial, rs_out


def _checked(rank, out, x, w, what):
    """(reference, relative error) of a fused call's output against cuBLAS then NCCL's reduce-scatter; raises where
    they disagree (before anything is timed)."""
    tp = dist.get_world_size()
    ref = torch.empty(x.shape[0] // tp, w.shape[0], device="cuda", dtype=x.dtype)
    dist.reduce_scatter_tensor(ref, x @ w.t(), group=dist.group.WORLD)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < 1e-2:
        raise RuntimeError(f"rank {rank}: {what} disagrees with cuBLAS+NCCL: {err}")
    return ref, err


def _unfused_times(rank, xs, ws_, partial, rs_out, reps, what, sms=None):
    """What the fused op is measured against: cuBLAS and our GEMM alone (and on ``sms`` SMs), NCCL's
    reduce-scatter, cuBLAS then NCCL, and torch's fused op."""
    import torch.distributed._symmetric_memory as symm_mem

    from flux_layers.ops import fused_gemm
    group, sets = dist.group.WORLD, len(xs)
    t = {"gemm_cublas": time_ms(lambda i: torch.matmul(xs[i % sets], ws_[i % sets].t(), out=partial[i % sets]),
                                reps=reps, group=group),
         "gemm_flux": time_ms(lambda i: fused_gemm.gemm(xs[i % sets], ws_[i % sets]), reps=reps, group=group)}
    if sms is not None:
        t["gemm_flux_beside_nccl"] = time_ms(lambda i: fused_gemm.gemm(xs[i % sets], ws_[i % sets], sm_count=sms),
                                             reps=reps, group=group)
    t["nccl_rs"] = time_ms(lambda i: dist.reduce_scatter_tensor(rs_out[i % sets], partial[i % sets], group=group),
                           reps=reps, group=group)

    def seq(i):
        torch.matmul(xs[i % sets], ws_[i % sets].t(), out=partial[i % sets])
        dist.reduce_scatter_tensor(rs_out[i % sets], partial[i % sets], group=group)
    t["gemm_then_nccl"] = time_ms(seq, reps=reps, group=group)
    try:
        symm_mem.enable_symm_mem_for_group(group.group_name)
        wts = [w.t() for w in ws_]
        t["torch_symm_mem_fused"] = time_ms(
            lambda i: torch.ops.symm_mem.fused_matmul_reduce_scatter(xs[i % sets], wts[i % sets], "sum", 0,
                                                                     group.group_name),
            reps=reps, group=group)
    except Exception as exc:  # report, do not hide (across real nodes it cannot map the peers' memory)
        t["torch_symm_mem_fused"] = None
        if rank == 0:
            print(f"torch fused_matmul_reduce_scatter failed on {what}: {exc}", flush=True)
    return t


def _key(x_shard_k, w_shard_k, tp):
    """The tuning table key of the fused calls here (x [M, K/tp], weight [N, K/tp]: the per-rank GEMM, as the op
    looks it up)."""
    from flux_layers.runtime import tuning
    return tuning.table_key("gemm_rs", x_shard_k.shape[0], x_shard_k.shape[1], w_shard_k.shape[0], tp)


def bench_shape(rank, tp, m, k, n, dtype, reps, sets=2):
    from flux_layers import ops
    from flux_layers.ops import fused_gemm_rs
    from flux_layers.runtime import tuning, workspace

    group = dist.group.WORLD
    k_local = k // tp
    xs, ws_, partial, rs_out = _inputs(rank, tp, m, k, n, dtype, sets)
    rs_ws = workspace.get_rs_workspace(group, dtype, m, n)

    ref, err = _checked(rank, fused_gemm_rs.gemm_rs(xs[0], ws_[0], group=group, ws=rs_ws), xs[0], ws_[0],
                        f"fused gemm_rs on {m}x{k}x{n}")
    for transport in TRANSPORTS:
        check_kernel_variants(lambda **cfg: fused_gemm_rs.gemm_rs(xs[0], ws_[0], group=group, ws=rs_ws,
                                                                  transport=transport, **cfg), ref,
                              f"rank {rank}: fused gemm_rs ({transport}) on {m}x{k}x{n}")

    t = _unfused_times(rank, xs, ws_, partial, rs_out, reps, f"{m}x{k}x{n}")
    t["fused"] = time_ms(lambda i: fused_gemm_rs.gemm_rs(xs[i % sets], ws_[i % sets], group=group, ws=rs_ws),
                         reps=reps, group=group)
    t.update(time_kernel_variants(lambda i, **cfg: fused_gemm_rs.gemm_rs(xs[i % sets], ws_[i % sets], group=group,
                                                                        ws=rs_ws, **cfg), reps=reps, group=group))
    # Each transport with the default kernel configuration (fused_<transport>); 'fused' above took the table's.
    for transport in TRANSPORTS:
        t[f"fused_{transport}"] = time_ms(
            lambda i: fused_gemm_rs.gemm_rs(xs[i % sets], ws_[i % sets], group=group, ws=rs_ws, transport=transport),
            reps=reps, group=group)
    # Copy-engine chunk widths (columns; the default is 1024): narrower strips finish sooner, wider ones copy
    # longer rows.
    for cols in (512, 2048, 4096):
        t[f"fused_copy_engine_cols{cols}"] = time_ms(
            lambda i: fused_gemm_rs.gemm_rs(xs[i % sets], ws_[i % sets], group=group, ws=rs_ws,
                                            transport="copy_engine", chunk_cols=cols), reps=reps, group=group)
    rs_ws.check()

    fused_transport = tuning.rs_transport(dtype=dtype, tp=tp, mkn=_key(xs[0], ws_[0], tp))  # what 'fused' ran
    return {"m": m, "k": k, "n": n, "k_local": k_local, "tp": tp, "dtype": str(dtype).replace("torch.", ""),
            "times_ms": t, **overlap_figures(t, "nccl_rs", "gemm_then_nccl"),
            "rel_err_vs_nccl": err, "transport": fused_transport,
            "dispatch_auto": ops.plan("gemm_rs", xs[0], ws_[0], group=group).path,
            "fused_default_config": tuning.kernel_name(tuning.resolve_kernel("gemm_rs", dtype=dtype, tp=tp,
                                                                             mkn=_key(xs[0], ws_[0], tp))),
            "fused_transport": fused_transport,
            "implementation": "fused = flux_layers._C gemm_rs with the default transport (fused_transport: "
                              "'epilogue' = epilogue stores into peer slots, flagged tiles; 'copy_engine' = epilogue "
                              "stores locally, copy engine moves finished chunks); the owner reduces in its "
                              "epilogue. fused_epilogue / fused_copy_engine: each transport, default kernel"}


def bench_shape_nccl(rank, tp, m, k, n, dtype, reps, sets=2, transport="nccl"):
    """bench_shape for the NCCL or hybrid transport (the module docstring's variants)."""
    from flux_layers import ops
    from flux_layers.ops import fused_gemm_rs
    from flux_layers.runtime import tuning, workspace
    from flux_layers.runtime.multinode import nccl_transport

    group = dist.group.WORLD
    k_local = k // tp
    xs, ws_, partial, rs_out = _inputs(rank, tp, m, k, n, dtype, sets)

    def fused_on(via):
        w = workspace.get_rs_workspace(group, dtype, m, n, over_nccl=via == "nccl", hybrid=via == "hybrid")

        def fused(i, **cfg):
            return fused_gemm_rs.gemm_rs(xs[i % sets], ws_[i % sets], group=group, ws=w, transport=via, **cfg)
        return w, fused

    rs_ws, fused = fused_on(transport)
    what = f"fused gemm_rs ({transport}) on {m}x{k}x{n}"
    ref, err = _checked(rank, fused(0), xs[0], ws_[0], what)
    check_kernel_variants(lambda **cfg: fused(0, **cfg), ref, f"rank {rank}: {what}")

    sms = nccl_transport.gemm_sms_beside_nccl(rs_ws.device)
    t = _unfused_times(rank, xs, ws_, partial, rs_out, reps, f"{m}x{k}x{n}", sms=sms)
    t["fused"] = time_ms(fused, reps=reps, group=group)
    t.update(time_kernel_variants(fused, reps=reps, group=group))
    if transport == "hybrid":  # the flat transport beside it: what the node partials save
        flat_ws, flat = fused_on("nccl")
        _checked(rank, flat(0), xs[0], ws_[0], f"fused gemm_rs (nccl, flat) on {m}x{k}x{n}")
        t["fused_nccl_flat"] = time_ms(flat, reps=reps, group=group)
        flat_ws.check()
    rs_ws.check()

    call = fused_gemm_rs.plan_nccl_call(rs_ws, m=m, k=k_local, n=n)
    return {"m": m, "k": k, "n": n, "k_local": k_local, "tp": tp, "dtype": str(dtype).replace("torch.", ""),
            "times_ms": t, **overlap_figures(t, "nccl_rs", "gemm_then_nccl"),
            "rel_err_vs_nccl": err, "transport": transport, "node_size": call.plan.node_size, "gemm_sm_count": sms,
            "chunks_per_peer": len(call.chunks), "rows_per_chunk": [c.rows for c in call.chunks],
            "dispatch_auto": ops.plan("gemm_rs", xs[0], ws_[0], group=group).path,
            "fused_default_config": tuning.kernel_name(tuning.resolve_kernel("gemm_rs", dtype=dtype, tp=tp,
                                                                             mkn=_key(xs[0], ws_[0], tp))),
            "implementation": ("fused = flux_layers._C gemm_rs in external-transfer mode (partials staged locally, "
                               "counted per full-width chunk) + NCCL send/recv batches (torch.distributed) each "
                               "after its chunk's count and followed by the received chunk's flag "
                               "(flux_layers/runtime/multinode/nccl_rs_transport.py); the owner reduces in its "
                               "epilogue" if transport == "nccl" else
                               "fused = flux_layers._C gemm_rs on the two-level plan (the epilogue's stores inside "
                               "the node, the collectors' node partials staged and counted per full-width chunk) + "
                               "one NCCL send/recv batch per node partial and chunk (nccl_rs_transport."
                               "node_partial_batches); fused_nccl_flat = the flat NCCL transport, same run")}


def run(rank, tp, args):
    from flux_layers.ops.backend import rs_host_transport
    from flux_layers.runtime import topology
    # The transport comes from the settings like the library's: NCCL or hybrid where FLUX_LAYERS_TRANSPORT forces
    # it; otherwise the peer-mapped transports. A group they cannot serve stops here saying why.
    host = rs_host_transport(dist.group.WORLD)
    host_driven = host is not None  # the NCCL transport, flat or two-level: its own benchmark rows
    blocker = topology.fused_path_blocker(tuple(range(tp)), topology.group_node_ids(dist.group.WORLD), op="gemm_rs")
    if blocker is not None:
        raise RuntimeError(f"bench_gemm_rs: {blocker}")
    dtype = getattr(torch, args.dtype)
    rows = []
    for (m, k, n) in parse_shapes(args.shapes):
        r = (bench_shape_nccl(rank, tp, m, k, n, dtype, args.reps, transport=host) if host_driven
             else bench_shape(rank, tp, m, k, n, dtype, args.reps))
        rows.append(r)
        if rank == 0:
            tt = r["times_ms"]
            print(f"  {m}x{k}x{n} [{r['transport']}]: gemm {tt['gemm_cublas']:.3f} rs {tt['nccl_rs']:.3f} seq "
                  f"{tt['gemm_then_nccl']:.3f} torch {tt['torch_symm_mem_fused']} fused {tt['fused']:.3f} ms",
                  flush=True)
    if host_driven:
        flat = [("fused_nccl_flat", "flat", ".3f")] if host == "hybrid" else []
        report_operator_rows(rank, tp, rows, operator_columns([
            ("gemm_flux_beside_nccl", "gemm_sms", ".3f"), ("nccl_rs", "nccl_rs", ".3f"),
            ("gemm_then_nccl", "seq", ".3f"), ("torch_symm_mem_fused", "torch", ".3f"), ("fused", "fused", ".3f"),
            *flat, ("chunks_per_peer", "chunks", "")]), args.out,
            extra={"transport": f"{host} (FLUX_LAYERS_TRANSPORT={host}; node size {topology.declared_node_size()})"})
        return
    report_operator_rows(rank, tp, rows, operator_columns([
        ("gemm_flux", "gemm_flux", ".3f"), ("nccl_rs", "nccl_rs", ".3f"), ("gemm_then_nccl", "seq", ".3f"),
        ("torch_symm_mem_fused", "torch", ".3f"), ("fused", "fused", ".3f"), ("fused_epilogue", "epilogue", ".3f"),
        ("fused_copy_engine", "ce", ".3f"), ("fused_copy_engine_cols512", "ce512", ".3f"),
        ("fused_copy_engine_cols2048", "ce2048", ".3f"), ("fused_copy_engine_cols4096", "ce4096", ".3f")]),
        args.out, extra={"transport": "epilogue or copy_engine (peer-mapped; per shape: each row's transport)"})

def main():
    operator_main(__doc__, DEFAULT_SHAPES, run)


if __name__ == "__main__":
    main()
