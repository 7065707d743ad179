"""AllGather + GEMM: the fused operator beside every baseline, one run, per shape (design.md §6).

    python -m benchmarks.bench_ag_gemm --out benchmarks/results/ag_gemm_h200x2.json

Shapes are MxKxN with M the gathered rows and N the global output size (each rank computes N/tp columns).
Variants: cuBLAS GEMM alone on the gathered shape, our GEMM alone, NCCL all-gather alone, copy-engine
all-gather alone, one peer-to-peer copy of a shard (copy-engine bandwidth reference), NCCL then cuBLAS,
torch.ops.symm_mem.fused_all_gather_matmul, and the fused operator. Derived: bound = max(GEMM alone,
copy-engine all-gather alone), fused/bound, seq/fused, overlap efficiency E = 1 - (fused - gemm)/(seq - gemm),
and the path the library's default dispatch takes for the shape.

The transport is the library's choice for the group (FLUX_LAYERS_TRANSPORT, node layout, peer access); every row
and the JSON say which ran. With the NCCL transport (e.g. across nodes, or emulated on one machine:

    FLUX_LAYERS_TRANSPORT=nccl FLUX_LAYERS_NODE_SIZE=1 python -m benchmarks.bench_ag_gemm \
        --out benchmarks/results/ag_gemm_internode_h200x2.json

) the variants are: cuBLAS GEMM alone, our GEMM alone on all SMs and on the SMs the fused op leaves it beside
NCCL, NCCL all-gather alone, the NCCL transport's transfers alone (its send/recv batches and flags), NCCL then
cuBLAS, torch's fused op, and the fused operator at 1, 2 and 4 chunks per shard; bound = max(GEMM alone, NCCL
all-gather alone). The hybrid transport (FLUX_LAYERS_TRANSPORT=hybrid with FLUX_LAYERS_NODE_SIZE, e.g. 2 on 4 GPUs:
NCCL between the emulated nodes, copy-engine pushes inside them) runs the same variants, its transfers alone
included.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.harness import (
    check_kernel_variants,
    env_override,
    operator_columns,
    operator_main,
    overlap_figures,
    parse_shapes,
    report_operator_rows,
    time_kernel_variants,
    time_ms,
)

DEFAULT_SHAPES = "4096x8192x8192,8192x8192x28672,8192x12288x12288,2048x4096x4096,16384x4096x4096"
AG_CHUNK_COUNTS = (1, 2, 4)  # copy-engine chunks per shard timed beside the default


def _inputs(rank, tp, m, k, n, dtype, sets):
    """This rank's x shards [M/tp, K] and weight shards [N/tp, K] of ``sets`` random input sets, and each set's
    x all-gathered by NCCL [M, K]."""
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    xs = [torch.randn(m // tp, k, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
    ws_ = [torch.randn(n // tp, k, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
    gathered = [torch.empty(m, k, device="cuda", dtype=dtype) for _ in range(sets)]
    for x, g in zip(xs, gathered):
        dist.all_gather_into_tensor(g, x, group=dist.group.WORLD)
    return xs, ws_, gathered


def _checked(rank, out, gathered, w, what):
    """(fp32 reference, relative error) of a fused call's output against cuBLAS on the NCCL-gathered input;
    raises where they disagree (before anything is timed)."""
    ref = (gathered @ w.t()).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise RuntimeError(f"rank {rank}: {what} disagrees with NCCL+cuBLAS: {err}")
    return ref, err


def _unfused_times(rank, xs, ws_, gathered, reps, what, sms=None):
    """What the fused op is measured against: cuBLAS and our GEMM alone (and on ``sms`` SMs), NCCL's all-gather,
    NCCL then cuBLAS, and torch's fused op."""
    import torch.distributed._symmetric_memory as symm_mem

    from flux_layers.ops import fused_gemm
    group, sets = dist.group.WORLD, len(xs)
    t = {"gemm_cublas": time_ms(lambda i: gathered[i % sets] @ ws_[i % sets].t(), reps=reps, group=group),
         "gemm_flux": time_ms(lambda i: fused_gemm.gemm(gathered[i % sets], ws_[i % sets]), reps=reps, group=group)}
    if sms is not None:
        t["gemm_flux_beside_nccl"] = time_ms(lambda i: fused_gemm.gemm(gathered[i % sets], ws_[i % sets],
                                                                       sm_count=sms), reps=reps, group=group)
    t["nccl_ag"] = time_ms(lambda i: dist.all_gather_into_tensor(gathered[i % sets], xs[i % sets], group=group),
                           reps=reps, group=group)

    def seq(i):
        dist.all_gather_into_tensor(gathered[i % sets], xs[i % sets], group=group)
        return gathered[i % sets] @ ws_[i % sets].t()
    t["nccl_then_gemm"] = time_ms(seq, reps=reps, group=group)
    try:
        symm_mem.enable_symm_mem_for_group(group.group_name)
        wts = [w.t() for w in ws_]
        t["torch_symm_mem_fused"] = time_ms(
            lambda i: torch.ops.symm_mem.fused_all_gather_matmul(xs[i % sets], [wts[i % sets]], 0,
                                                                 group.group_name, return_A=False),
            reps=reps, group=group)
    except Exception as exc:  # report, do not hide (across real nodes it cannot map the peers' memory)
        t["torch_symm_mem_fused"] = None
        if rank == 0:
            print(f"torch fused_all_gather_matmul failed on {what}: {exc}", flush=True)
    return t


def _key(x_shard_m, w_shard_n, tp):
    """The tuning table key of the fused calls here (x [M/tp, K], weight [N/tp, K]: the per-rank GEMM, as the op
    looks it up)."""
    from flux_layers.runtime import tuning
    return tuning.table_key("ag_gemm", x_shard_m.shape[0], x_shard_m.shape[1], w_shard_n.shape[0], tp)


def bench_shape(rank, tp, m, k, n, dtype, reps, sets=2):
    from flux_layers import _env, ops
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.runtime import tuning, workspace

    group = dist.group.WORLD
    n_local = n // tp
    rows = m // tp
    xs, ws_, gathered = _inputs(rank, tp, m, k, n, dtype, sets)
    ag_ws = workspace.get_ag_workspace(group, dtype, m, k)

    # Correctness before timing: fused vs cuBLAS on the gathered input.
    ref, err = _checked(rank, fused_ag_gemm.ag_gemm(xs[0], ws_[0], group=group, ws=ag_ws), gathered[0], ws_[0],
                        f"fused ag_gemm on {m}x{k}x{n}")
    check_kernel_variants(lambda **cfg: fused_ag_gemm.ag_gemm(xs[0], ws_[0], group=group, ws=ag_ws, **cfg), ref,
                          f"rank {rank}: fused ag_gemm on {m}x{k}x{n}")

    t = _unfused_times(rank, xs, ws_, gathered, reps, f"{m}x{k}x{n}")
    t["ce_ag"] = time_ms(lambda i: fused_ag_gemm.copy_engine_all_gather(xs[i % sets], group=group, ws=ag_ws),
                         reps=reps, group=group)
    # One shard copied from a peer's symmetric buffer by the copy engine: the bandwidth the all-gather can reach.
    peer = (rank + 1) % tp
    peer_view = ag_ws._handle.get_buffer(peer, (rows, k), dtype, 0)
    local = torch.empty(rows, k, device="cuda", dtype=dtype)
    t["p2p_copy_one_shard"] = time_ms(lambda i: local.copy_(peer_view), reps=reps, group=group)
    t["fused"] = time_ms(lambda i: fused_ag_gemm.ag_gemm(xs[i % sets], ws_[i % sets], group=group, ws=ag_ws),
                         reps=reps, group=group)
    # The other copy direction (pull: the copy engine reads the peer's shard): what the direction costs.
    with env_override(AG_MODE="pull"):
        t["ce_ag_pull"] = time_ms(lambda i: fused_ag_gemm.copy_engine_all_gather(xs[i % sets], group=group,
                                                                                ws=ag_ws), reps=reps, group=group)
        t["fused_pull"] = time_ms(lambda i: fused_ag_gemm.ag_gemm(xs[i % sets], ws_[i % sets], group=group,
                                                                  ws=ag_ws), reps=reps, group=group)
    # Chunk count per shard: fewer, larger copies move the shard faster (each copy is followed by a flag write
    # the next copy on that stream waits for); more, smaller ones let the GEMM start on a peer's rows sooner.
    for chunks in AG_CHUNK_COUNTS:
        with env_override(CHUNK_ROWS=str(-(-rows // (128 * chunks)) * 128)):
            t[f"ce_ag_{chunks}chunk"] = time_ms(lambda i: fused_ag_gemm.copy_engine_all_gather(
                xs[i % sets], group=group, ws=ag_ws), reps=reps, group=group)
            t[f"fused_{chunks}chunk"] = time_ms(lambda i: fused_ag_gemm.ag_gemm(xs[i % sets], ws_[i % sets],
                                                                                group=group, ws=ag_ws),
                                                reps=reps, group=group)
    t.update(time_kernel_variants(lambda i, **cfg: fused_ag_gemm.ag_gemm(xs[i % sets], ws_[i % sets], group=group,
                                                                        ws=ag_ws, **cfg), reps=reps, group=group))
    ag_ws.check()

    shard_bytes = rows * k * xs[0].element_size()
    row = {"m": m, "k": k, "n": n, "n_local": n_local, "tp": tp, "dtype": str(dtype).replace("torch.", ""),
           "times_ms": t, **overlap_figures(t, "ce_ag", "nccl_then_gemm"),
           "ce_ag_gbps": (tp - 1) * shard_bytes / t["ce_ag"] / 1e6,
           "p2p_gbps": shard_bytes / t["p2p_copy_one_shard"] / 1e6,
           "rel_err_vs_cublas": err,
           "transport": "copy_engine", "ag_mode": _env.get("AG_MODE"), "ag_order": ag_ws.order,
           "dispatch_auto": ops.plan("ag_gemm", xs[0], ws_[0], group=group).path,
           "fused_default_config": tuning.kernel_name(tuning.resolve_kernel("ag_gemm", dtype=dtype, tp=tp,
                                                                            mkn=_key(xs[0], ws_[0], tp))),
           "implementation": "fused = flux_layers._C ag_gemm (copy-engine chunks + signal-waiting persistent GEMM)"}
    row["ce_over_p2p"] = row["ce_ag_gbps"] / row["p2p_gbps"]
    return row


def bench_shape_nccl(rank, tp, m, k, n, dtype, reps, sets=2, transport="nccl"):
    """bench_shape for the NCCL or hybrid transport (the module docstring's variants)."""
    from flux_layers import ops
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.runtime import tuning, workspace
    from flux_layers.runtime.multinode import nccl_transport

    group = dist.group.WORLD
    n_local = n // tp
    rows = m // tp
    xs, ws_, gathered = _inputs(rank, tp, m, k, n, dtype, sets)
    ag_ws = workspace.get_ag_workspace(group, dtype, m, k, transport)

    def fused(i, **cfg):
        return fused_ag_gemm.ag_gemm(xs[i % sets], ws_[i % sets], group=group, ws=ag_ws, **cfg)

    ref, err = _checked(rank, fused(0), gathered[0], ws_[0], f"fused ag_gemm ({transport}) on {m}x{k}x{n}")
    check_kernel_variants(lambda **cfg: fused(0, **cfg), ref,
                          f"rank {rank}: fused ag_gemm ({transport}) on {m}x{k}x{n}")

    sms = nccl_transport.gemm_sms_beside_nccl(ag_ws.device)
    t = _unfused_times(rank, xs, ws_, gathered, reps, f"{m}x{k}x{n}", sms=sms)
    t["nccl_p2p_ag"] = time_ms(lambda i: fused_ag_gemm.nccl_all_gather(xs[i % sets], group=group, ws=ag_ws),
                               reps=reps, group=group)
    t["fused"] = time_ms(fused, reps=reps, group=group)
    for chunks in AG_CHUNK_COUNTS:
        chunk_rows = -(-rows // (128 * chunks)) * 128
        t[f"fused_{chunks}chunk"] = time_ms(lambda i, r=chunk_rows: fused(i, chunk_rows=r), reps=reps, group=group)
    t.update(time_kernel_variants(fused, reps=reps, group=group))
    ag_ws.check()

    call = fused_ag_gemm.plan_nccl_call(ag_ws, m=m, k=k, n=n)
    row = {"m": m, "k": k, "n": n, "n_local": n_local, "tp": tp, "dtype": str(dtype).replace("torch.", ""),
           "times_ms": t, **overlap_figures(t, "nccl_ag", "nccl_then_gemm"),
           "rel_err_vs_cublas": err, "transport": transport, "ag_order": call.executor.plan.order,
           "node_of": list(ag_ws.layout.node_of), "gemm_sm_count": sms,
           "rows_per_chunk": call.rows_per_chunk,
           "dispatch_auto": ops.plan("ag_gemm", xs[0], ws_[0], group=group).path,
           "fused_default_config": tuning.kernel_name(tuning.resolve_kernel("ag_gemm", dtype=dtype, tp=tp,
                                                                            mkn=_key(xs[0], ws_[0], tp))),
           "implementation": "fused = flux_layers._C ag_gemm in external-transfer mode + NCCL send/recv batches "
                             "(torch.distributed) each followed by its chunk flag (flux_layers/runtime/multinode/"
                             "nccl_transport.py)" + ("; inside each node, copy-engine pushes from the host, each "
                                                     "followed by the chunk's flag at the peer (hybrid transport)"
                                                     if transport == "hybrid" else "")}
    return row


def run(rank, tp, args):
    from flux_layers.ops.backend import ag_transport
    dtype = getattr(torch, args.dtype)
    transport = ag_transport(dist.group.WORLD)
    rows = []
    for (m, k, n) in parse_shapes(args.shapes):
        if transport == "copy_engine":
            r = bench_shape(rank, tp, m, k, n, dtype, args.reps)
        else:
            r = bench_shape_nccl(rank, tp, m, k, n, dtype, args.reps, transport=transport)
        rows.append(r)
        if rank == 0:
            tt = r["times_ms"]
            comm = "ce_ag" if transport == "copy_engine" else "nccl_p2p_ag"
            print(f"  {m}x{k}x{n} [{transport}]: gemm {tt['gemm_cublas']:.3f} {comm} {tt[comm]:.3f} "
                  f"seq {tt['nccl_then_gemm']:.3f} torch {tt['torch_symm_mem_fused']} fused {tt['fused']:.3f} ms",
                  flush=True)
    if transport != "copy_engine":
        report_operator_rows(rank, tp, rows, operator_columns([
            ("gemm_flux_beside_nccl", "gemm_sms", ".3f"), ("nccl_ag", "nccl_ag", ".3f"),
            ("nccl_p2p_ag", "p2p_ag", ".3f"), ("nccl_then_gemm", "seq", ".3f"),
            ("torch_symm_mem_fused", "torch", ".3f"), ("fused", "fused", ".3f"), ("fused_1chunk", "f_1ch", ".3f"),
            ("fused_2chunk", "f_2ch", ".3f"), ("fused_4chunk", "f_4ch", ".3f")]), args.out,
            extra={"transport": transport})
        return
    report_operator_rows(rank, tp, rows, operator_columns([
        ("ce_ag", "ce_ag", ".3f"), ("nccl_ag", "nccl_ag", ".3f"), ("nccl_then_gemm", "seq", ".3f"),
        ("torch_symm_mem_fused", "torch", ".3f"), ("fused", "fused", ".3f"), ("fused_pull", "pull", ".3f"),
        ("ce_ag_pull", "ce_pull", ".3f"), ("ce_ag_1chunk", "ce_1ch", ".3f"), ("ce_ag_2chunk", "ce_2ch", ".3f"),
        ("fused_1chunk", "f_1ch", ".3f"), ("fused_2chunk", "f_2ch", ".3f"), ("ce_over_p2p", "ce/p2p", ".2f")]),
        args.out, extra={"transport": "copy_engine"})

def main():
    operator_main(__doc__, DEFAULT_SHAPES, run)


if __name__ == "__main__":
    main()
