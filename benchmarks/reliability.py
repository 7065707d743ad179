"""Reliability of the fused operators: each scenario in its own process group (fresh processes), one JSON record.

| scenario | what happens | recorded |
|---|---|---|
| ``peer_death`` | after two good calls the last rank exits; the others enqueue three calls and synchronize, then go on calling (a call, then a device sync, as a training step) | ``raised`` (WorkspaceError on every survivor), ``seconds`` from the first call after the death to the raise (max over survivors), ``timeout_s``, ``message``, ``names_peer``, ``pipelined_drain_s`` (until the three enqueued calls drained) |
| ``peer_death_inside_call`` | the last rank's chunks of a call go out, then it exits while its GEMM waits for rank 0's (held back by a GPU sleep), so its end-of-call handshake never comes; the others finish that call, then go on as in ``peer_death`` | as ``peer_death`` |
| ``rejected_call_then_valid`` | rank 0 alone makes rejected calls (Python checks and the op library's), then M = 0 calls, then valid calls on every rank | ``ok`` (rejections raised, epochs equal across ranks, M = 0 a no-op, valid calls right) |
| ``graph_replay_timeout`` | a captured call replays on rank 0 only | ``raised`` (``workspace.check_graph_replays()`` raised within timeout + 10 s), ``seconds``, ``eager_call_raised`` (the next eager call on the workspace raises), ``first_replay_peer_rows_written`` (elements of the peers' rows holding numbers after the replay that timed out: 0 when each tile that waited is NaN), ``later_replays_nan`` (three more replays, still alone, finish and yield NaN), ``later_replay_max_s``, ``drained`` (after ``release()``) |
| ``rank_mismatch`` | ranks make different fused calls (M, layout, op: checked on the host when a call is new), or calls of known shapes out of step (``out_of_step_*``: checked on the device) | ``raised_on_both`` (ValueError, or WorkspaceError for the device variants, on every rank, for every variant), ``names_every_rank`` (every rank's call in the message; device variants: the two calls that met), ``later_ok``, ``device_seconds`` (longest time to the device variants' error) |
| ``bad_inputs`` | the catalogue of flux_layers/devtools/bad_inputs.py, a valid call of each op after each case | ``cases``, ``unclear`` (raised without naming the argument and the rule), ``not_raised``, ``later_calls_ok``, ``epoch_advanced`` |
| ``workspace_growth`` | M grows call to call (both ops); then the cap FLUX_LAYERS_WORKSPACE_MAX_GIB is set below the next size | ``bounded``, ``peak_gib``, ``final_workspace_gib``, ``created_gib``, ``outgrown_freed``, ``cap_raised``, ``cap_message``, ``after_cap_ok`` |
| ``reset_after_timeout`` | rank 0 times out waiting for rank 1, which never made the call; every rank calls ``workspace.reset()`` | ``ok`` (rank 0 raised, valid calls right after the reset) |
| ``stress`` | flux_layers/devtools/stress.py: pipelined calls of both ops and layouts, M changing, eager and graph replays, a rank late on the GPU now and then, checked in batches | ``calls``, ``mismatches``, ``seconds`` |

A scenario that fails or overruns its time limit is recorded with its error and does not stop the others. The
processes run with CUDA_DEVICE_MAX_CONNECTIONS=1 (set here unless given). ``--shared-gpu`` runs two ranks as
processes sharing GPU 0 (gloo for the group, ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``): the checks hold, the
times are not TP times; its defaults are smaller (calls piled up across the processes can hold the GPU until the
timeout when a persistent grid fills every SM).

    python -m benchmarks.reliability --out benchmarks/results/reliability_h200x2.json
    python -m benchmarks.reliability --shared-gpu --out benchmarks/results/reliability_shared_h200.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

SCENARIOS = ("peer_death", "peer_death_inside_call", "rejected_call_then_valid", "graph_replay_timeout",
             "rank_mismatch", "bad_inputs", "workspace_growth", "reset_after_timeout", "stress")
DEFAULT_OUT = "benchmarks/results/reliability_h200x2.json"
K, N = 512, 512  # the small calls of the scenarios other than stress and growth (N over the group)


# ---- helpers run in the scenario processes

def _write(out_dir: str, rank: int, record: dict) -> None:
    """This rank's record of the scenario (written before any os._exit)."""
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, default=str)
    os.replace(path + ".tmp", path)


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"    {text}", flush=True)


def _valid(rank: int, tp: int, op: str, seed: int, rows: int = 256, layout: str = "nt", ws=None) -> tuple[bool, str]:
    """One call of ``op`` on inputs identical on every rank, checked against fp32 (1.5x cuBLAS's error)."""
    import torch
    import torch.distributed as dist

    from flux_layers import ops
    from flux_layers.devtools import oracle
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows * tp, K, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, generator=gen, device="cuda").to(torch.bfloat16)
    w = w if layout == "nt" else w.t().contiguous()
    if op == "ag_gemm":
        w_local = w.chunk(tp, dim=0 if layout == "nt" else 1)[rank].contiguous()
        kw = dict(group=dist.group.WORLD, weight_layout=layout)
        out = ops.ag_gemm(x.chunk(tp)[rank], w_local, backend="fused", **kw) if ws is None else \
            _fused_ag(x.chunk(tp)[rank], w_local, ws=ws, **kw)
        ref, cublas = oracle.matmul_fp32(x, w_local, None, layout), oracle.matmul_cublas(x, w_local, None, layout)
    else:
        x_local = x.chunk(tp, dim=1)[rank].contiguous()
        w_local = w.chunk(tp, dim=1 if layout == "nt" else 0)[rank].contiguous()
        out = ops.gemm_rs(x_local, w_local, group=dist.group.WORLD, weight_layout=layout, backend="fused")
        ref = oracle.matmul_fp32(x, w, None, layout).chunk(tp)[rank]
        cublas = oracle.matmul_cublas(x, w, None, layout).chunk(tp)[rank]
    ok, err, limit = oracle.verdict(out, ref, cublas)
    return ok, f"{op} {layout} M={rows * tp}: relative error {err:.3e}, bound {limit:.3e}"


def _fused_ag(x, w, **kw):
    from flux_layers.ops import fused_ag_gemm
    return fused_ag_gemm.ag_gemm(x, w, **kw)


def _all(values) -> list:
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def _wait_for(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


# ---- the scenarios (module level: started by run_distributed in fresh processes)

def peer_death(rank, tp, opts, out_dir):
    import torch
    import torch.distributed as dist

    from flux_layers.runtime.workspace import AgWorkspace
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 256 * tp, K)
    ws.timeout_s = opts["timeout_s"]
    before = [_valid(rank, tp, "ag_gemm", opts["seed"] + i, ws=ws) for i in range(2)]
    torch.cuda.synchronize()
    dist.barrier()
    if rank == tp - 1:
        _write(out_dir, rank, {"role": "died"})
        os._exit(0)  # between calls: no error, no goodbye
    _say(rank, f"rank {tp - 1} exited; calling on with FLUX_LAYERS timeout {opts['timeout_s']} s")
    _call_on_without_the_dead(rank, tp, opts, out_dir, ws, all(ok for ok, _ in before))


def peer_death_inside_call(rank, tp, opts, out_dir):
    import torch
    import torch.distributed as dist

    from flux_layers.runtime.workspace import AgWorkspace
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 256 * tp, K)
    ws.timeout_s = opts["timeout_s"]
    ok, _ = _valid(rank, tp, "ag_gemm", opts["seed"], ws=ws)
    torch.cuda.synchronize()
    dist.barrier()
    x = torch.randn(256, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N // tp, K, device="cuda", dtype=torch.bfloat16)
    if rank == tp - 1:
        _fused_ag(x, w, group=dist.group.WORLD, ws=ws)
        time.sleep(0.3)  # its chunks landed; its GEMM waits for rank 0's, held behind rank 0's GPU sleep
        _write(out_dir, rank, {"role": "died"})
        os._exit(0)  # inside the call: its end-of-call done never reaches the others
    if rank == 0:
        torch.cuda._sleep(int(3e9))  # over a second: rank 0's chunks leave after the death
    _say(rank, f"rank {tp - 1} exits inside a call; calling on with FLUX_LAYERS timeout {opts['timeout_s']} s")
    _call_on_without_the_dead(rank, tp, opts, out_dir, ws, ok, lead=lambda: _fused_ag(x, w, group=dist.group.WORLD,
                                                                                        ws=ws))


def _call_on_without_the_dead(rank, tp, opts, out_dir, ws, good_before, lead=None):
    """The survivors' part of the peer-death scenarios: ``lead`` (the call the dead rank was inside), then, as a
    training step does, three calls enqueued back to back and a sync, then a call and a sync at a time, until the
    WorkspaceError; this rank's record."""
    import torch
    import torch.distributed as dist

    from flux_layers.runtime.workspace import WorkspaceError
    began = time.monotonic()
    raised, message, calls, drained_s = False, None, 0, None
    try:
        if lead is not None:
            lead()
            calls += 1
        # Behind the first call that waits for the dead rank, the next ones' stream waits for its handshake would
        # hold the only hardware queue under CUDA_DEVICE_MAX_CONNECTIONS=1 but for the kernels' own release.
        x = torch.randn(256, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N // tp, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            _fused_ag(x, w, group=dist.group.WORLD, ws=ws)
            calls += 1
        torch.cuda.synchronize()
        drained_s = time.monotonic() - began
        for i in range(opts["peer_death_calls"]):  # then a call and a sync (a loss read) at a time
            _valid(rank, tp, "ag_gemm", opts["seed"] + 10 + i, ws=ws)
            calls += 1
            torch.cuda.synchronize()
    except WorkspaceError as exc:
        raised, message = True, str(exc)
    seconds = time.monotonic() - began
    _write(out_dir, rank, {"role": "survivor", "raised": raised, "seconds": round(seconds, 2), "message": message,
                           "calls_before_raise": calls, "good_before": good_before,
                           "pipelined_drain_s": None if drained_s is None else round(drained_s, 2)})
    os._exit(0)  # the peer is gone: no collective shutdown


def _merge_peer_death(records, opts):
    survivors = [r for r in records.values() if r.get("role") == "survivor"]
    tp = len(records) if records else 0
    seconds = max((r["seconds"] for r in survivors), default=None)
    return {"raised": bool(survivors) and all(r["raised"] for r in survivors), "seconds": seconds,
            "timeout_s": opts["timeout_s"], "message": survivors[0]["message"] if survivors else None,
            "names_peer": bool(survivors) and all(f"rank {tp - 1}" in (r["message"] or "") for r in survivors),
            "within_timeout_plus_10s": seconds is not None and seconds <= opts["timeout_s"] + 10,
            "survivors": len(survivors), "good_before": all(r["good_before"] for r in survivors),
            "pipelined_calls": 3,
            "pipelined_drain_s": max((r.get("pipelined_drain_s") or 0 for r in survivors), default=None)}


def rejected_call_then_valid(rank, tp, opts, out_dir):
    import torch
    import torch.distributed as dist

    from flux_layers import ops
    from flux_layers.ops import _dispatch, fused_ag_gemm
    os.environ["FLUX_LAYERS_POISON_OUTPUTS"] = "1"
    group, seed = dist.group.WORLD, opts["seed"]
    decided = [_valid(rank, tp, op, seed + i)[0] for i, op in enumerate(("ag_gemm", "gemm_rs"))]
    x = torch.randn(256, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N // tp, K, device="cuda", dtype=torch.bfloat16)
    ag = _dispatch.decided("ag_gemm", x, w, group, "nt", "fused").workspace  # made and bound on every rank, not run
    x_rs = torch.randn(256 * tp, K // tp, device="cuda", dtype=torch.bfloat16)
    w_rs = torch.randn(N, K // tp, device="cuda", dtype=torch.bfloat16)
    rs = _dispatch.decided("gemm_rs", x_rs, w_rs, group, "nt", "fused").workspace
    rejected = []
    if rank == 0:  # calls rejected on one rank only: nothing may be enqueued and no epoch may advance
        bad = {
            "non-contiguous bias (op library)": lambda: ops.ag_gemm(
                x, w, torch.randn(N, device="cuda", dtype=torch.bfloat16)[::tp], group=group, backend="fused"),
            "misaligned x (op library)": lambda: ops.gemm_rs(
                torch.randn(256 * tp * (K // tp) + 8, device="cuda", dtype=torch.bfloat16)[1:1 + x_rs.numel()]
                .view(x_rs.shape), w_rs, group=group, backend="fused"),
            "N not a multiple of 8 (Python)": lambda: fused_ag_gemm.ag_gemm(
                x, torch.randn(2044, K, device="cuda", dtype=torch.bfloat16), group=group, ws=ag),
        }
        for what, call in bad.items():
            try:
                call()
                rejected.append({"call": what, "raised": False})
            except ValueError as exc:
                rejected.append({"call": what, "raised": True, "message": str(exc).split("\nException")[0][:300]})
    epochs = (ag.epoch, rs.epoch)
    in_step = len(set(_all(epochs))) == 1
    empty_ag = ops.ag_gemm(x[:0], w, group=group, backend="fused")
    empty_rs = ops.gemm_rs(x_rs[:0], w_rs, group=group, backend="fused")
    m0_noop = empty_ag.shape == (0, N // tp) and empty_rs.shape == (0, N) and (ag.epoch, rs.epoch) == epochs
    valid = [_valid(rank, tp, op, seed + 100 + i) for i in range(3) for op in ("ag_gemm", "gemm_rs")]
    torch.cuda.synchronize()
    _write(out_dir, rank, {"decided": all(decided), "rejected": rejected, "epochs_in_step": in_step,
                           "m0_noop": m0_noop, "valid_ok": all(ok for ok, _ in valid),
                           "valid_errors": [e for ok, e in valid if not ok]})


def _merge_rejected(records, opts):
    r = list(records.values())
    rejected = [x for rec in r for x in rec["rejected"]]
    ok = (len(r) > 0 and all(rec["decided"] and rec["epochs_in_step"] and rec["m0_noop"] and rec["valid_ok"]
                             for rec in r) and len(rejected) > 0 and all(x["raised"] for x in rejected))
    return {"ok": ok, "rejected_calls": rejected, "epochs_in_step": all(rec["epochs_in_step"] for rec in r),
            "m0_noop": all(rec["m0_noop"] for rec in r), "valid_ok": all(rec["valid_ok"] for rec in r),
            "valid_errors": [e for rec in r for e in rec["valid_errors"]]}


def graph_replay_timeout(rank, tp, opts, out_dir):
    import torch
    import torch.distributed as dist

    from flux_layers import ops
    from flux_layers.devtools import oracle
    from flux_layers.runtime import workspace
    from flux_layers.runtime.workspace import WorkspaceError
    timeout = opts["graph_timeout_s"]
    os.environ["FLUX_LAYERS_TIMEOUT_S"] = str(timeout)  # read when the workspaces (and their twins) are made
    workspace.enable_cuda_graphs()
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(opts["seed"])
    x = torch.randn(256 * tp, K, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(N // tp, K, generator=gen, device="cuda").to(torch.bfloat16)
    x_local = x.chunk(tp)[rank].contiguous()

    def call():
        return ops.ag_gemm(x_local, w, group=group, backend="fused")
    call()
    torch.cuda.synchronize()
    twin = ops.decide("ag_gemm", x_local, w, group=group, backend="fused").workspace.graph_twin
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    replay_ok = oracle.verdict(out, oracle.matmul_fp32(x, w, None, "nt"), oracle.matmul_cublas(x, w, None, "nt"))[0]
    dist.barrier()
    done = os.path.join(out_dir, "rank0.done")
    record = {"replay_ok": replay_ok}
    if rank == 0:  # replays alone: the twin's waits time out on the device
        graph.replay()
        first_done = torch.cuda.Event()
        first_done.record()
        began = time.monotonic()
        raised, message = False, None
        while time.monotonic() - began < timeout + 10:
            try:
                workspace.check_graph_replays()
            except WorkspaceError as exc:
                raised, message = True, str(exc)
                break
            time.sleep(0.01)
        seconds = time.monotonic() - began
        while not first_done.query() and time.monotonic() - began < timeout + 10:
            time.sleep(0.01)
        # Its peers' rows never came: elements of them holding numbers (none, when every tile that waited is NaN)
        peer_rows = torch.cat([o for g, o in enumerate(out.chunk(tp)) if g != rank])
        first_written = int((~peer_rows.isnan()).sum()) if first_done.query() else None
        try:
            call()
            eager_raised = False
        except WorkspaceError:
            eager_raised = True
        # Later replays, still alone, without releasing the twin here: they must run through (the watchdog keeps a
        # failed twin released) and yield NaN (the GEMM of a failed call), not hang or return numbers.
        later_nan, later_s = True, 0.0
        for _ in range(3):
            graph.replay()
            finished, began = torch.cuda.Event(), time.monotonic()
            finished.record()
            while not finished.query() and time.monotonic() - began < timeout + 10:
                time.sleep(0.01)
            later_s = max(later_s, time.monotonic() - began)
            later_nan = later_nan and finished.query() and bool(torch.isnan(out).all())
        twin.release()
        drained = torch.cuda.Event()
        drained.record()
        deadline = time.monotonic() + timeout + 10
        while not drained.query() and time.monotonic() < deadline:
            time.sleep(0.01)
        record.update(raised=raised, seconds=round(seconds, 2), message=message, eager_call_raised=eager_raised,
                      first_replay_peer_rows_written=first_written, later_replays_nan=later_nan,
                      later_replay_max_s=round(later_s, 3), drained=drained.query())
        open(done, "w").close()
    else:
        record["rank0_finished"] = _wait_for(done, 3 * timeout + 30)
    _write(out_dir, rank, record)
    os._exit(0)  # the twin is unusable; no collective shutdown needed


def _merge_graph_timeout(records, opts):
    r0 = records.get(0, {})
    return {"raised": bool(r0.get("raised")), "seconds": r0.get("seconds"), "timeout_s": opts["graph_timeout_s"],
            "message": r0.get("message"), "eager_call_raised": r0.get("eager_call_raised"),
            "drained": r0.get("drained"), "first_replay_peer_rows_written": r0.get("first_replay_peer_rows_written"),
            "later_replays_nan": r0.get("later_replays_nan"),
            "later_replay_max_s": r0.get("later_replay_max_s"),
            "replay_ok_before": all(r.get("replay_ok") for r in records.values())}


def rank_mismatch(rank, tp, opts, out_dir):
    import torch

    seed = opts["seed"]
    variants = {  # (op, rows per rank, layout) per rank: rank 0 differs from the others
        "M": (("ag_gemm", 256, "nt"), ("ag_gemm", 128, "nt")),
        "layout": (("gemm_rs", 128, "nt"), ("gemm_rs", 128, "nn")),
        "op": (("ag_gemm", 128, "nt"), ("gemm_rs", 128, "nt")),
    }
    results = {}
    for i, (name, (first, other)) in enumerate(variants.items()):
        op, rows, layout = first if rank == 0 else other
        try:
            _valid(rank, tp, op, seed + i, rows=rows, layout=layout)
            results[name] = {"raised": False}
        except ValueError as exc:
            message = str(exc)
            results[name] = {"raised": True, "message": message[:600],
                             "names_every_rank": all(f"rank {r}:" in message for r in range(tp))}
        results[name]["later_ok"] = all(_valid(rank, tp, o, seed + 10 + i)[0] for o in ("ag_gemm", "gemm_rs"))
    for i, op in enumerate(("ag_gemm", "gemm_rs")):
        results[f"out_of_step_{op}"] = _out_of_step(rank, tp, op, seed + 20 + i)
    torch.cuda.synchronize()
    _write(out_dir, rank, results)


def _out_of_step(rank, tp, op, seed):
    """Calls of shapes every rank has decided (256 and 128 rows per rank), then rank 0 calls 256 rows and the
    others 128: no host-side check runs (the calls are known), the kernels compare the calls' signatures. Raised
    (WorkspaceError, within seconds, not at the timeout) on every rank, both calls named, in step after a reset."""
    import torch
    import torch.distributed as dist

    from flux_layers.runtime import workspace
    from flux_layers.runtime.workspace import WorkspaceError
    for rows in (256, 128):
        _valid(rank, tp, op, seed, rows=rows)
    torch.cuda.synchronize()
    dist.barrier()
    mine, theirs = (256, 128) if rank == 0 else (128, 256)
    began = time.monotonic()
    record = {"device": True, "raised": False}
    try:
        _valid(rank, tp, op, seed, rows=mine)
        for ws in list(workspace._cache.values()):
            ws.check()
    except WorkspaceError as exc:
        message = str(exc)
        record.update(raised=True, message=message[:600],
                      names_every_rank=f"{op}(M={mine * tp}," in message and f"{op}(M={theirs * tp}," in message)
    record["seconds"] = round(time.monotonic() - began, 2)
    workspace.reset()
    record["later_ok"] = all(_valid(rank, tp, o, seed + 10)[0] for o in ("ag_gemm", "gemm_rs"))
    return record


def _merge_mismatch(records, opts):
    r = list(records.values())
    variants = sorted({v for rec in r for v in rec})
    return {"raised_on_both": bool(r) and all(rec[v]["raised"] for rec in r for v in variants),
            "names_every_rank": bool(r) and all(rec[v].get("names_every_rank") for rec in r for v in variants),
            "later_ok": bool(r) and all(rec[v]["later_ok"] for rec in r for v in variants),
            "variants": variants, "message": r[0][variants[0]].get("message") if r and variants else None,
            "device_message": next((rec[v].get("message") for rec in r for v in variants if rec[v].get("device")),
                                   None),
            "device_seconds": max((rec[v]["seconds"] for rec in r for v in variants if rec[v].get("device")),
                                  default=None)}


def bad_inputs(rank, tp, opts, out_dir):
    import torch

    from flux_layers.devtools import bad_inputs as catalogue
    os.environ["FLUX_LAYERS_POISON_OUTPUTS"] = "1"
    env = catalogue.Env.here(rank, tp, seed=opts["seed"])
    rows = catalogue.run_cases(env, progress=lambda text: _say(rank, text))
    torch.cuda.synchronize()
    _write(out_dir, rank, {"rows": rows})


def _merge_bad_inputs(records, opts):
    per_rank = [rec["rows"] for rec in records.values()]
    if not per_rank:
        return {"cases": 0}
    names = [row["case"] for row in per_rank[0]]
    by_case = {name: [next(r for r in rows if r["case"] == name) for rows in per_rank] for name in names}
    unclear = [n for n, rows in by_case.items() if not all(r["clear"] for r in rows)]
    return {"cases": len(names), "unclear": len(unclear), "unclear_cases": unclear,
            "not_raised": [n for n, rows in by_case.items() if not all(r["raised"] for r in rows)],
            "later_calls_ok": all(r["later_ok"] for rows in by_case.values() for r in rows),
            "epoch_advanced": [n for n, rows in by_case.items() if any(r["epoch_advanced"] for r in rows)],
            "details": per_rank[0]}


def workspace_growth(rank, tp, opts, out_dir):
    import gc
    import weakref

    import torch

    k = n = opts["growth_kn"]
    seen: list = []  # (weak reference, bytes) of every workspace made (twins included)

    def live():
        wss = _live_objects()
        for w in wss:
            if not any(ref() is w for ref, _ in seen):
                seen.append((weakref.ref(w), w._storage.numel()))
        return sum(w._storage.numel() for w in wss), len(wss)

    ranks_here = tp if _shared() else 1

    def outside_torch() -> int:
        """Device memory in use that torch's allocators do not hold: the symmetric workspaces, the CUDA context,
        the communicators (the whole device: both processes where ranks share it)."""
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        return total - free - (sum(_all(reserved)) if ranks_here > 1 else reserved)

    steps = list(range(128, opts["growth_max_rows"] + 1, 128))
    baseline = peak = excess = peak_live = 0
    for i, rows in enumerate(steps):
        for op in ("ag_gemm", "gemm_rs"):
            ok, error = _valid_growth(rank, tp, op, rows, k, n, opts["seed"] + i)
            if not ok:
                raise AssertionError(f"rank {rank} step {i}: {error}")
        torch.cuda.synchronize()  # one call in flight: the growth, not a pile-up, is measured
        dist_barrier()  # where ranks share the device, both are at the same step
        live_bytes = live()[0]
        if i == 0:  # what the first calls set up once (context, communicators, the first workspaces' mappings)
            baseline = outside_torch() - ranks_here * live_bytes
        used = outside_torch() - baseline  # a collective where ranks share the device
        peak, peak_live = max(peak, used), max(peak_live, live_bytes)
        excess = max(excess, used - ranks_here * live_bytes)  # memory of outgrown workspaces not given back
        if (i + 1) % max(1, len(steps) // 8) == 0:
            _say(rank, f"rows per rank {rows}: device memory outside torch +{used / 2**30:.2f} GiB, live "
                       f"workspaces {live_bytes / 2**30:.2f} GiB per rank")
    gc.collect()
    final_bytes, final_count = live()
    live_now = _live_objects()
    freed = all(ref() is None for ref, _ in seen if not any(ref() is w for w in live_now))
    del live_now
    created = sum(b for _, b in seen)
    slack = 2**27  # allocation granularity, signal pads, communicators' lazy buffers
    # The cap: set below the next workspace's size; the next growth must raise a clear error on every rank.
    cap_gib = final_bytes / 2 / 2**30 * 1.2
    os.environ["FLUX_LAYERS_WORKSPACE_MAX_GIB"] = f"{cap_gib:.6f}"
    cap_raised, cap_message = False, None
    try:
        _valid_growth(rank, tp, "ag_gemm", steps[-1] * 2, k, n, opts["seed"])
    except RuntimeError as exc:
        cap_message = str(exc)
        cap_raised = "FLUX_LAYERS_WORKSPACE_MAX_GIB" in cap_message and "GiB" in cap_message
    after_cap_ok = all(_valid_growth(rank, tp, op, steps[-1], k, n, opts["seed"] + 7)[0]
                       for op in ("ag_gemm", "gemm_rs"))
    torch.cuda.synchronize()
    _write(out_dir, rank, {
        "bounded": freed and excess <= slack, "peak_gib": round(peak / 2**30, 3),
        "excess_gib": round(excess / 2**30, 3), "slack_gib": round(slack / 2**30, 3),
        "ranks_on_device": ranks_here, "final_workspace_gib": round(final_bytes / 2**30, 3),
        "peak_live_workspace_gib": round(peak_live / 2**30, 3), "created_gib": round(created / 2**30, 3),
        "workspaces_created": len(seen), "live_workspaces": final_count, "outgrown_freed": freed,
        "torch_max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3), "steps": len(steps),
        "max_m": steps[-1] * tp, "k_n": k, "cap_gib": round(cap_gib, 4), "cap_raised": cap_raised,
        "cap_message": cap_message, "after_cap_ok": after_cap_ok})


def dist_barrier():
    import torch.distributed as dist
    dist.barrier()


def _live_objects():
    from flux_layers.runtime import workspace
    return [w for ws in list(workspace._cache.values()) + workspace._retired for w in (ws, ws.graph_twin) if w]


def _shared() -> bool:
    from flux_layers.devtools.launch import shared_gpu
    return shared_gpu()


def _valid_growth(rank, tp, op, rows, k, n, seed):
    """A call of ``op`` at M = rows * tp through ops (cached workspaces, grown as needed), checked."""
    import torch
    import torch.distributed as dist

    from flux_layers import ops
    from flux_layers.devtools import oracle
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if op == "ag_gemm":  # AllGather workspace: M x K; a narrow N keeps the GEMM cheap
        x = torch.randn(rows * tp, k, generator=gen, device="cuda").to(torch.bfloat16)
        w = torch.randn(128, k, generator=gen, device="cuda").to(torch.bfloat16)
        out = ops.ag_gemm(x.chunk(tp)[rank], w, group=dist.group.WORLD, backend="fused")
        ref, cublas = oracle.matmul_fp32(x, w, None, "nt"), oracle.matmul_cublas(x, w, None, "nt")
    else:  # ReduceScatter workspace: M x N; a short K keeps the GEMM cheap
        x = torch.randn(rows * tp, 128 * tp, generator=gen, device="cuda").to(torch.bfloat16)
        w = torch.randn(n, 128 * tp, generator=gen, device="cuda").to(torch.bfloat16)
        out = ops.gemm_rs(x.chunk(tp, dim=1)[rank].contiguous(), w.chunk(tp, dim=1)[rank].contiguous(),
                          group=dist.group.WORLD, backend="fused")
        ref = oracle.matmul_fp32(x, w, None, "nt").chunk(tp)[rank]
        cublas = oracle.matmul_cublas(x, w, None, "nt").chunk(tp)[rank]
    ok, err, limit = oracle.verdict(out, ref, cublas)
    return ok, f"{op} M={rows * tp}: relative error {err:.3e}, bound {limit:.3e}"


def _merge_growth(records, opts):
    r = list(records.values())
    if not r:
        return {"bounded": False}
    merged = dict(r[0])
    merged.update(bounded=all(x["bounded"] for x in r), peak_gib=max(x["peak_gib"] for x in r),
                  cap_raised=all(x["cap_raised"] for x in r), after_cap_ok=all(x["after_cap_ok"] for x in r),
                  outgrown_freed=all(x["outgrown_freed"] for x in r))
    return merged


def reset_after_timeout(rank, tp, opts, out_dir):
    import torch
    import torch.distributed as dist

    from flux_layers.ops import _dispatch
    from flux_layers.runtime import workspace
    from flux_layers.runtime.workspace import WorkspaceError
    seed = opts["seed"]
    before = _valid(rank, tp, "ag_gemm", seed)[0]
    torch.cuda.synchronize()
    x = torch.randn(256, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N // tp, K, device="cuda", dtype=torch.bfloat16)
    ws = _dispatch.decided("ag_gemm", x, w, dist.group.WORLD, "nt", "fused").workspace
    ws.timeout_s = opts["graph_timeout_s"]
    dist.barrier()
    raised = None
    if rank == 0:  # the others never make this call
        from flux_layers import ops
        ops.ag_gemm(x, w, group=dist.group.WORLD, backend="fused")
        try:
            ws.check()
            raised = False
        except WorkspaceError:
            raised = True
    dist.barrier()
    workspace.reset()
    after = [_valid(rank, tp, op, seed + 1 + i)[0] for i, op in enumerate(("ag_gemm", "gemm_rs", "ag_gemm"))]
    torch.cuda.synchronize()
    _write(out_dir, rank, {"before_ok": before, "raised": raised, "after_ok": all(after),
                           "fresh_workspace": _dispatch.decided("ag_gemm", x, w, dist.group.WORLD, "nt",
                                                                "fused").workspace is not ws})


def _merge_reset(records, opts):
    r = list(records.values())
    ok = bool(r) and records.get(0, {}).get("raised") is True and all(
        x["before_ok"] and x["after_ok"] and x["fresh_workspace"] for x in r)
    return {"ok": ok, "timed_out_rank_raised": records.get(0, {}).get("raised"),
            "after_ok": all(x["after_ok"] for x in r)}


def stress(rank, tp, opts, out_dir):
    import torch.distributed as dist

    from flux_layers.devtools import stress as engine
    os.environ["FLUX_LAYERS_POISON_OUTPUTS"] = "1"
    cfg = engine.StressConfig(calls=opts["stress_calls"], batch=opts["stress_batch"], late_every=opts["late_every"],
                              late_ms=opts["late_ms"], seed=opts["seed"], k=opts["stress_kn"], n=opts["stress_kn"],
                              rows=tuple(opts["stress_rows"]))
    record = engine.run(rank, tp, dist.group.WORLD, cfg, progress=lambda text: _say(rank, text))
    _write(out_dir, rank, record)


def _merge_stress(records, opts):
    r = list(records.values())
    if not r:
        return {"calls": 0}
    merged = dict(r[0])
    merged.update(mismatches=sum(x["mismatches"] for x in r), seconds=max(x["seconds"] for x in r),
                  worst_error_over_bound=max(x["worst_error_over_bound"] for x in r),
                  first_mismatches=[m for x in r for m in x["first_mismatches"]][:10],
                  cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    return merged


RUNNERS = {
    "peer_death": (peer_death, _merge_peer_death),
    "peer_death_inside_call": (peer_death_inside_call, _merge_peer_death),
    "rejected_call_then_valid": (rejected_call_then_valid, _merge_rejected),
    "graph_replay_timeout": (graph_replay_timeout, _merge_graph_timeout),
    "rank_mismatch": (rank_mismatch, _merge_mismatch),
    "bad_inputs": (bad_inputs, _merge_bad_inputs),
    "workspace_growth": (workspace_growth, _merge_growth),
    "reset_after_timeout": (reset_after_timeout, _merge_reset),
    "stress": (stress, _merge_stress),
}


# ---- the parent: one process group per scenario

def limit_s(name: str, opts: dict) -> float:
    """The time limit of a scenario (its processes are killed after it)."""
    t = opts["timeout_s"]
    g = opts["graph_timeout_s"]
    return {"peer_death": 3 * t + 90, "peer_death_inside_call": 3 * t + 90, "graph_replay_timeout": 3 * g + 90,
            "reset_after_timeout": 3 * g + 90, "stress": opts["stress_limit_s"]}.get(name, 240)


def run_scenario(name: str, world: int, opts: dict, launch=None) -> dict:
    """Run one scenario in fresh processes; its merged record, or the error that stopped it (with whatever the ranks
    wrote before)."""
    from flux_layers.devtools.launch import run_distributed
    launch = launch or run_distributed
    fn, merge = RUNNERS[name]
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"reliability_{name}_") as out_dir:
        error = None
        try:
            launch(fn, world, opts, out_dir, backend=opts["backend"], timeout_s=limit_s(name, opts))
        except BaseException as exc:  # noqa: BLE001 - recorded, the other scenarios still run
            error = f"{type(exc).__name__}: {exc}"[-6000:]
        records = {}
        for path in glob.glob(os.path.join(out_dir, "rank*.json")):
            with open(path) as f:
                records[int(os.path.basename(path)[4:-5])] = json.load(f)
    try:
        record = merge(records, opts)
    except Exception as exc:  # noqa: BLE001 - a partial record after a failure
        record = {"merge_error": f"{type(exc).__name__}: {exc}"}
    if error is not None:
        record["error"] = error
    record["wall_s"] = round(time.monotonic() - began, 1)
    return record


def parse_args(argv=None):
    from benchmarks.harness import positive_ints
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from: " + ", ".join(SCENARIOS))
    ap.add_argument("--shared-gpu", action="store_true", help="two ranks as processes sharing GPU 0")
    ap.add_argument("--nprocs", type=int, default=0, help="ranks (default: every GPU; 2 with --shared-gpu)")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="FLUX_LAYERS timeout of peer_death's waits")
    ap.add_argument("--graph-timeout-s", type=float, default=3.0,
                    help="timeout of graph_replay_timeout's and reset_after_timeout's waits")
    ap.add_argument("--stress-calls", type=int, default=10_000)
    ap.add_argument("--stress-batch", type=int, default=50, help="calls checked together (at most in flight)")
    ap.add_argument("--stress-kn", type=int, default=None, help="K and N of the stress calls (default 1024; 512 with "
                    "--shared-gpu)")
    ap.add_argument("--stress-rows", type=positive_ints, default="8,64,128,264,512,1000,1024",
                    help="rows per rank of the stress calls")
    ap.add_argument("--late-every", type=int, default=200, help="a rank sleeps on the GPU before every n-th call")
    ap.add_argument("--late-ms", type=float, default=None, help="its sleep (default 100 ms; 20 with --shared-gpu)")
    ap.add_argument("--stress-limit-s", type=float, default=None,
                    help="time limit of the stress scenario (default 400 s; 240 with --shared-gpu)")
    ap.add_argument("--growth-kn", type=int, default=2048, help="K of the AllGather and N of the ReduceScatter "
                    "workspaces that grow")
    ap.add_argument("--growth-max-rows", type=int, default=None,
                    help="rows per rank the growth ends at (default 8192; 4096 with --shared-gpu)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    unknown = [s for s in args.scenarios.split(",") if s and s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    return args


def options(args) -> dict:
    """The plain settings the scenario processes get (picklable)."""
    shared = args.shared_gpu
    return {"backend": "nccl", "timeout_s": args.timeout_s, "graph_timeout_s": args.graph_timeout_s,
            "peer_death_calls": 20, "seed": args.seed, "stress_calls": args.stress_calls,
            "stress_batch": args.stress_batch, "stress_kn": args.stress_kn or (512 if shared else 1024),
            "stress_rows": list(args.stress_rows), "late_every": args.late_every,
            "late_ms": args.late_ms if args.late_ms is not None else (20.0 if shared else 100.0),
            "stress_limit_s": args.stress_limit_s or (240.0 if shared else 400.0), "growth_kn": args.growth_kn,
            "growth_max_rows": args.growth_max_rows or (4096 if shared else 8192)}


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # inherited by every scenario's processes
    if args.shared_gpu:
        os.environ["FLUX_LAYERS_TEST_SHARED_GPU"] = "1"
    import torch

    from flux_layers.devtools import records
    gpus = torch.cuda.device_count()
    world = args.nprocs or (2 if args.shared_gpu else gpus)
    if world < 2 or (gpus < world and not args.shared_gpu) or gpus < 1:
        sys.exit(f"needs at least 2 ranks: {gpus} GPUs visible (--shared-gpu runs 2 ranks on one)")
    opts = options(args)
    payload = {**records.environment(gpus), "command": " ".join(["python -m benchmarks.reliability"] + args.argv),
               "tp": world, "shared_gpu": args.shared_gpu, "settings": opts}
    for name in [s for s in args.scenarios.split(",") if s]:
        print(f"=== {name} (limit {limit_s(name, opts):.0f} s)", flush=True)
        payload[name] = run_scenario(name, world, opts)
        summary = {k: v for k, v in payload[name].items() if not isinstance(v, (list, dict)) and k != "message"}
        print(f"  {name}: {summary}", flush=True)
        records.write_json(args.out, payload)  # after every scenario: a later hang leaves the earlier results
    return payload


if __name__ == "__main__":
    main()
