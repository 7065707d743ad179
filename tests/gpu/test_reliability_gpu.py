"""The fused ops when a peer misbehaves or a caller errs (TP GPUs, or TP ranks sharing one under
FLUX_LAYERS_TEST_SHARED_GPU=1; FLUX_LAYERS_TEST_TP):
a dead peer raises instead of hanging; a rejected call leaves the ranks in step; M = 0 is a no-op; a graph replay
that times out is reported; ranks making different calls raise on every rank (new calls on the host, calls and
replays out of step on the device); the bad-input catalogue
(flux_layers/devtools/bad_inputs.py) is answered clearly; workspaces grow bounded and capped; a collective reset
after a timeout; a short pipelined stress run (flux_layers/devtools/stress.py). Timeouts are short, so each test runs
in seconds; benchmarks/reliability.py runs the long versions."""
from __future__ import annotations

import gc
import os
import re
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, shared_gpu, tp_under_test
from tests.gpu.gpu_support import (
    assert_close_rel,
    at_tp2_when_lean,
    global_inputs,
    lean_params,
    needs_gpus,
    poison_outputs,
    references,
)

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP)]
TIMEOUT_S = 2.0


def _seed() -> int:
    return int(torch.randint(0, 2**30, ()).item())


def _ag_call(rank, tp, seed, ws=None, m=256, k=256, n=128, backend="fused"):
    """One AllGather+GEMM call (on ``ws``, else through ops) and its references."""
    from flux_layers import ops
    from flux_layers.ops import fused_ag_gemm
    x, w, _ = global_inputs(seed, m * tp, k, n * tp, torch.bfloat16, "nt")
    w_shard_n = w.chunk(tp)[rank].contiguous()
    if ws is None:
        out = ops.ag_gemm(x.chunk(tp)[rank], w_shard_n, group=dist.group.WORLD, backend=backend)
    else:
        out = fused_ag_gemm.ag_gemm(x.chunk(tp)[rank], w_shard_n, group=dist.group.WORLD, ws=ws)
    return out, *references(x, w_shard_n, None, "nt")


def _rs_call(rank, tp, seed, m=256, k=128, n=256):
    from flux_layers import ops
    xg, wg, bg = global_inputs(seed, m * tp, k * tp, n, torch.bfloat16, "nt")
    out = ops.gemm_rs(xg.chunk(tp, dim=1)[rank].contiguous(), wg.chunk(tp, dim=1)[rank].contiguous(), bg,
                      group=dist.group.WORLD, backend="fused")
    return out, *(r.chunk(tp)[rank] for r in references(xg, wg, bg, "nt"))


def _peer_death(rank, tp, seed):
    from flux_layers.runtime.workspace import AgWorkspace, WorkspaceError
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 256 * tp, 256)
    ws.timeout_s = TIMEOUT_S
    for i in range(2):
        assert_close_rel(*_ag_call(rank, tp, seed + i, ws), f"rank {rank} call {i} before the peer died")
    torch.cuda.synchronize()
    dist.barrier()
    if rank == tp - 1:
        os._exit(0)  # dies between calls: no error, no goodbye
    began = time.monotonic()
    for i in range(3):  # enqueued behind calls that wait for the dead rank: the first may or may not raise
        try:
            _ag_call(rank, tp, seed + 10 + i, ws)
        except WorkspaceError:
            break
    torch.cuda.synchronize()  # returns: the kernels' waits time out and the watchdog releases the stream waits
    elapsed = time.monotonic() - began
    assert elapsed < TIMEOUT_S + 10, f"rank {rank}: the device drained only after {elapsed:.1f} s"
    _raises_leading_to_the_dead_rank(rank, tp, lambda: _ag_call(rank, tp, seed + 20, ws))
    os._exit(0)  # the peer is gone: no collective shutdown


def _raises_leading_to_the_dead_rank(rank, tp, call):
    """``call`` raises, and its error leads to the dead rank (the last). At TP = 2 the error names it. Above that the
    peer it names may be a survivor stuck behind the dead rank (a survivor's chunks queue behind its own handshake
    wait: ranks 0-2 of 4 each named another survivor at 59f5da8), so the message also lists every peer this rank still
    waited for when it gave up, and the dead rank must be among them; or the error is the out-of-step one, met from a
    survivor whose workspace was released first and ran its enqueued calls through (seen at TP = 8), which says so."""
    from flux_layers.runtime.workspace import WorkspaceError
    dead = tp - 1
    if tp == 2:
        expected = rf"rank {rank} timed out after .* waiting for .*rank {dead}"
    else:
        other = rf"(?!{rank}\b)\d+"  # a peer, never this rank
        expected = (rf"rank {rank} timed out after .* waiting for .*\brank {dead}\b|"
                    rf"went out of step: rank {rank}'s call .* Rank {other} is ahead")
    with pytest.raises(WorkspaceError) as raised:
        call()
    assert re.search(expected, str(raised.value)), f"rank {rank}: the error leads not to rank {dead}: {raised.value}"


# The default, and the single hardware queue Megatron asks for, where a blocked stream wait holds every stream's work
# (the host's release included): there the kernels release this rank's waits themselves.
CONNECTIONS = lean_params(["8", "1"], ["1"], "one hardware queue, the harder case, runs at every TP")


@pytest.mark.parametrize("connections", CONNECTIONS)
def test_dead_peer_raises_instead_of_hanging(connections, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    run_distributed(_peer_death, TP, _seed(), backend="nccl", timeout_s=180)


def _peer_death_inside_a_call(rank, tp, seed):
    """The last rank dies inside a push all-gather call: its chunks went out, its GEMM still waits for rank 0's
    (held back on rank 0's GPU), so its end-of-call ``done`` never comes. The survivors' call after that one waits
    for that ``done`` at its handshake; under one hardware queue nothing queued behind that wait runs, the host's
    release included, so only a GEMM enqueued ahead of it can give up and release it."""
    from flux_layers.runtime.workspace import AgWorkspace, WorkspaceError
    ws = AgWorkspace(dist.group.WORLD, torch.bfloat16, 256 * tp, 256)
    ws.timeout_s = TIMEOUT_S
    assert_close_rel(*_ag_call(rank, tp, seed, ws), f"rank {rank}: the call before the peer died")
    torch.cuda.synchronize()
    dist.barrier()
    if rank == tp - 1:
        _ag_call(rank, tp, seed + 1, ws)
        time.sleep(0.3)  # its pushes land; its GEMM waits for rank 0's chunks, held behind rank 0's GPU sleep
        os._exit(0)
    if rank == 0:
        torch.cuda._sleep(int(3e9))  # over a second: the last rank dies before rank 0's chunks leave
    began = time.monotonic()
    out, ref, _ = _ag_call(rank, tp, seed + 1, ws)  # the last rank's chunks arrived: this call completes
    for i in range(2):  # the first waits at its handshake for a done that never comes
        try:
            _ag_call(rank, tp, seed + 10 + i, ws)
        except WorkspaceError:
            break
    torch.cuda.synchronize()
    elapsed = time.monotonic() - began
    assert elapsed < TIMEOUT_S + 10, f"rank {rank}: the device drained only after {elapsed:.1f} s"
    _raises_leading_to_the_dead_rank(rank, tp, lambda: _ag_call(rank, tp, seed + 20, ws))
    os._exit(0)


@pytest.mark.parametrize("connections", CONNECTIONS)
def test_peer_dead_inside_a_call_raises_instead_of_hanging(connections, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    monkeypatch.setenv("FLUX_LAYERS_AG_MODE", "push")
    run_distributed(_peer_death_inside_a_call, TP, _seed(), backend="nccl", timeout_s=90)


def _rejected_then_valid(rank, tp, seed):
    from flux_layers.ops import fused_ag_gemm, fused_gemm_rs
    from flux_layers.runtime.workspace import AgWorkspace, RsWorkspace
    poison_outputs()
    ag = AgWorkspace(dist.group.WORLD, torch.bfloat16, 512 * tp, 256)
    rs = RsWorkspace(dist.group.WORLD, torch.bfloat16, 512 * tp, 256)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    if rank == 0:  # rejected calls on one rank only: nothing may be enqueued and no epoch may advance
        with pytest.raises(ValueError, match="N = 2044 .* must be a multiple of 8"):
            fused_ag_gemm.ag_gemm(x, torch.randn(2044, 256, device="cuda", dtype=torch.bfloat16),
                                  group=dist.group.WORLD, ws=ag)
        with pytest.raises(ValueError, match="bias must be contiguous"):
            fused_gemm_rs.gemm_rs(x, torch.randn(256, 256, device="cuda", dtype=torch.bfloat16),
                                  torch.randn(512, device="cuda", dtype=torch.bfloat16)[::2],
                                  group=dist.group.WORLD, ws=rs)
    epochs = (ag.epoch, rs.epoch)
    empty = fused_ag_gemm.ag_gemm(x[:0], torch.randn(128, 256, device="cuda", dtype=torch.bfloat16),
                                  group=dist.group.WORLD, ws=ag)
    assert empty.shape == (0, 128) and (ag.epoch, rs.epoch) == epochs == (0, 0), "M = 0 must be a no-op"
    for i in range(3):  # every rank in step: valid calls are right
        assert_close_rel(*_ag_call(rank, tp, seed + i, ag), f"rank {rank} ag_gemm call {i} after rejected calls")
        xg, wg, bg = global_inputs(seed + 100 + i, 256 * tp, 128 * tp, 256, torch.bfloat16, "nt")
        y = fused_gemm_rs.gemm_rs(xg.chunk(tp, dim=1)[rank].contiguous(), wg.chunk(tp, dim=1)[rank].contiguous(),
                                  bg, group=dist.group.WORLD, ws=rs)
        ref, cublas = references(xg, wg, bg, "nt")
        assert_close_rel(y, ref.chunk(tp)[rank], cublas.chunk(tp)[rank],
                         f"rank {rank} gemm_rs call {i} after rejected calls")
    assert (ag.epoch, rs.epoch) == (3, 3)
    torch.cuda.synchronize()


def test_rejected_call_leaves_ranks_in_step():
    run_distributed(_rejected_then_valid, TP, _seed(), backend="nccl")


def _wait_for(event, what: str, limit_s: float = 10.0) -> None:
    """Poll ``event`` (a synchronize would hang for good if the GPU did)."""
    began = time.monotonic()
    while not event.query():
        assert time.monotonic() - began < limit_s, f"{what} hangs"
        time.sleep(0.01)


def _graph_timeout(rank, tp, seed, done):
    from flux_layers import ops
    from flux_layers.runtime import workspace
    from flux_layers.runtime.workspace import WorkspaceError
    os.environ["FLUX_LAYERS_TIMEOUT_S"] = str(TIMEOUT_S)  # read when the workspace and its twin are made
    workspace.enable_cuda_graphs()
    x, w, _ = global_inputs(seed, 256 * tp, 256, 128, torch.bfloat16, "nt")
    x_shard_m = x.chunk(tp)[rank].contiguous()

    def call():
        from flux_layers import ops
        return ops.ag_gemm(x_shard_m, w, group=dist.group.WORLD, backend="fused")
    call()
    torch.cuda.synchronize()
    twin = ops.decide("ag_gemm", x_shard_m, w, group=dist.group.WORLD, backend="fused").workspace.graph_twin
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    assert_close_rel(out, *references(x, w, None, "nt"), f"rank {rank} replay with every rank")
    workspace.check_graph_replays()  # nothing recorded
    dist.barrier()
    if rank == 0:  # replays alone: the twin's waits time out on the device
        graph.replay()
        finished = torch.cuda.Event()
        finished.record()
        began = time.monotonic()
        while True:
            try:
                workspace.check_graph_replays()
            except WorkspaceError as exc:
                assert "rank 0 timed out" in str(exc), str(exc)
                break
            assert time.monotonic() - began < TIMEOUT_S + 10, "the replay's timeout was not reported"
            time.sleep(0.01)
        _wait_for(finished, "the replay that timed out")
        # Its peers' rows never came: every tile of them is NaN, the tiles whose mainloop had started before a wait
        # gave up included (their loads read the previous replay's rows, numbers that look right).
        peer_rows = torch.cat([o for g, o in enumerate(out.chunk(tp)) if g != rank])
        written = int((~peer_rows.isnan()).sum())
        assert written == 0, f"the replay that timed out wrote numbers into {written} elements of rows that never came"
        with pytest.raises(WorkspaceError):  # the next eager call on the workspace reports it too
            call()
        for i in range(3):  # later replays, still without the peer: they run through and yield NaN
            graph.replay()
            finished = torch.cuda.Event()
            finished.record()
            _wait_for(finished, f"replay {i} after the failure")
            assert torch.isnan(out).all(), f"replay {i} after the failure wrote numbers, not NaN"
        with pytest.raises(WorkspaceError, match="rank 0 timed out"):
            workspace.check_graph_replays()
        twin.release()
        torch.cuda.synchronize()
        open(done, "w").close()
    else:
        deadline = time.monotonic() + 3 * TIMEOUT_S + 30
        while not os.path.exists(done):
            assert time.monotonic() < deadline, "rank 0 did not finish"
            time.sleep(0.05)
    os._exit(0)  # the twin is unusable: no collective shutdown


@at_tp2_when_lean("one rank replays alone")
@pytest.mark.parametrize("connections", CONNECTIONS)
def test_graph_replay_timeout_is_reported(tmp_path, connections, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    run_distributed(_graph_timeout, TP, _seed(), str(tmp_path / "done"), backend="nccl", timeout_s=120)


def _mismatch(rank, tp, seed):
    poison_outputs()
    with pytest.raises(ValueError, match=rf"rank 0: \('ag_gemm', {256 * tp},.*rank 1: \('ag_gemm', {128 * tp},"):
        _ag_call(rank, tp, seed, m=256 if rank == 0 else 128)  # M (gathered) 256 * tp on rank 0, 128 * tp elsewhere
    with pytest.raises(ValueError, match=r"rank 0: \('ag_gemm'.*rank 1: \('gemm_rs'"):
        (_ag_call if rank == 0 else _rs_call)(rank, tp, seed)
    for i in range(2):  # every rank in step again
        assert_close_rel(*_ag_call(rank, tp, seed + 1 + i), f"rank {rank} ag_gemm after the mismatch")
        assert_close_rel(*_rs_call(rank, tp, seed + 1 + i), f"rank {rank} gemm_rs after the mismatch")
    torch.cuda.synchronize()


def test_ranks_making_different_calls_raise_on_every_rank():
    run_distributed(_mismatch, TP, _seed(), backend="nccl")


def _check_cached_workspaces():
    """Raise the WorkspaceError any cached workspace recorded, once the work queued so far finished (bounded)."""
    from flux_layers.runtime import workspace
    for ws in list(workspace._cache.values()):
        ws.check()


# Transports whose call signatures the kernels compare: (FLUX_LAYERS_AG_MODE, AG_ORDER, RS_TRANSPORT).
SIGNED_TRANSPORTS = {"push-mesh-epilogue": ("push", "mesh", "epilogue"),
                     "pull-ring-copy": ("pull", "ring", "copy_engine")}


def _out_of_step(rank, tp, seed, transports):
    """Shapes every rank has decided, called out of step (rank 0 with 256 rows per rank, the others with 128): the
    host-side check of a new call cannot see it, the kernels compare the calls' signatures and every rank raises
    well before the timeout, naming both calls; workspace.reset() brings the ranks back in step."""
    from flux_layers.runtime import workspace
    from flux_layers.runtime.workspace import WorkspaceError
    ag_mode, ag_order, rs_transport = transports
    os.environ.update(FLUX_LAYERS_AG_MODE=ag_mode, FLUX_LAYERS_AG_ORDER=ag_order, FLUX_LAYERS_RS_TRANSPORT=rs_transport,
                      FLUX_LAYERS_TIMEOUT_S="60")  # a wait that timed out would take a minute
    poison_outputs()
    mine, theirs = (256, 128) if rank == 0 else (128, 256)
    for i, (op, call) in enumerate((("ag_gemm", _ag_call), ("gemm_rs", _rs_call))):
        for rows in (256, 128):  # decided in step (the host-side check of a new call passes)
            assert_close_rel(*call(rank, tp, seed + i, m=rows), f"rank {rank} {op} rows {rows} in step")
        torch.cuda.synchronize()
        dist.barrier()
        began = time.monotonic()
        with pytest.raises(WorkspaceError) as raised:
            call(rank, tp, seed + i, m=mine)
            _check_cached_workspaces()
        seconds = time.monotonic() - began
        message = str(raised.value)
        assert "went out of step" in message, message
        assert f"{op}(M={mine * tp}," in message and f"{op}(M={theirs * tp}," in message, message
        assert seconds < 20, f"rank {rank}: the mismatch took {seconds:.1f} s (a timeout?)"
        workspace.reset()
    for i in range(2):  # every rank in step again
        assert_close_rel(*_ag_call(rank, tp, seed + 10 + i), f"rank {rank} ag_gemm after the reset")
        assert_close_rel(*_rs_call(rank, tp, seed + 10 + i), f"rank {rank} gemm_rs after the reset")
    torch.cuda.synchronize()


@pytest.mark.parametrize("transports", lean_params(list(SIGNED_TRANSPORTS.values()),
                                                [SIGNED_TRANSPORTS["push-mesh-epilogue"]],
                                                "push-mesh-epilogue runs at every TP"), ids=SIGNED_TRANSPORTS.keys())
def test_calls_out_of_step_raise_on_every_rank_from_the_device(transports):
    run_distributed(_out_of_step, TP, _seed(), transports, backend="nccl", timeout_s=240)


def _replays_out_of_step(rank, tp, seed):
    """Two captured calls replayed in a different order on rank 0: the twin's kernels compare the signatures and
    check_graph_replays() raises on every rank; a reset brings eager calls back."""
    from flux_layers import ops
    from flux_layers.runtime import workspace
    from flux_layers.runtime.workspace import WorkspaceError
    os.environ["FLUX_LAYERS_TIMEOUT_S"] = "60"
    workspace.enable_cuda_graphs()
    graphs, inputs, expected = {}, {}, {}
    for rows in (256, 128):
        x, w, _ = global_inputs(seed + rows, rows * tp, 256, 128, torch.bfloat16, "nt")
        x_shard_m = x.chunk(tp)[rank].contiguous()
        inputs[rows] = (x_shard_m, w)  # a graph's inputs must outlive its replays
        ops.ag_gemm(x_shard_m, w, group=dist.group.WORLD, backend="fused")  # decided eagerly, in step
        torch.cuda.synchronize()
        graphs[rows] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[rows]):
            out = ops.ag_gemm(x_shard_m, w, group=dist.group.WORLD, backend="fused")
        expected[rows] = (out, *references(x, w, None, "nt"))
    for rows in (256, 128):
        graphs[rows].replay()
    torch.cuda.synchronize()
    for rows in (256, 128):
        assert_close_rel(*expected[rows], f"rank {rank} replay of {rows} rows in step")
    workspace.check_graph_replays()
    dist.barrier()
    graphs[256 if rank == 0 else 128].replay()
    began = time.monotonic()
    while True:
        try:
            workspace.check_graph_replays()
        except WorkspaceError as exc:
            assert "went out of step" in str(exc) and "(CUDA-graph twin)" in str(exc), str(exc)
            break
        assert time.monotonic() - began < 20, f"rank {rank}: the replays' mismatch was not reported"
        time.sleep(0.01)
    torch.cuda.synchronize()  # the twin's kernels gave up: the device drains
    workspace.reset()
    assert_close_rel(*_ag_call(rank, tp, seed + 1), f"rank {rank} ag_gemm after the reset")
    torch.cuda.synchronize()


@at_tp2_when_lean("the twins compare signatures pairwise")
def test_replays_out_of_step_are_reported_on_every_rank():
    run_distributed(_replays_out_of_step, TP, _seed(), backend="nccl", timeout_s=240)


def _bad_inputs(rank, tp, seed):
    from flux_layers.devtools import bad_inputs
    poison_outputs()
    env = bad_inputs.Env.here(rank, tp, seed=seed)
    rows = bad_inputs.run_cases(env)
    assert len(rows) >= 25
    unclear = [(r["case"], r["error_type"], r["message"]) for r in rows if not r["clear"]]
    assert not unclear, f"rank {rank}: unclear or missing errors: {unclear}"
    advanced = [r["case"] for r in rows if r["epoch_advanced"]]
    assert not advanced, f"rank {rank}: rejected calls advanced an epoch: {advanced}"
    wrong = [(r["case"], r["later_error"]) for r in rows if not r["later_ok"]]
    assert not wrong, f"rank {rank}: calls after a rejected one were wrong: {wrong}"
    torch.cuda.synchronize()


@at_tp2_when_lean("the catalogue's checks")
def test_bad_inputs_are_rejected_clearly_and_later_calls_are_right():
    run_distributed(_bad_inputs, TP, _seed(), backend="nccl")


def _growth(rank, tp, seed):
    from flux_layers.runtime import workspace
    made = []
    for i, rows in enumerate(range(128, 2048 + 1, 128)):
        assert_close_rel(*_ag_call(rank, tp, seed + i, m=rows, k=512), f"rank {rank} ag_gemm rows {rows}")
        torch.cuda.synchronize()
        ws = next(iter(workspace._cache.values()))
        if not any(ref() is ws for ref in made):
            made.append(weakref.ref(ws))
    del ws
    gc.collect()
    live = list(workspace._cache.values())
    assert len(live) == 1 and live[0].max_m >= 2048 * tp
    assert 4 <= len(made) <= 10, f"{len(made)} workspaces for 16 sizes: growth by 1.5x expected"
    assert all(ref() is None for ref in made[:-1]), "an outgrown workspace is still alive"
    assert live[0].max_m < 2048 * tp * 1.5 + 128 * tp, f"max_m {live[0].max_m} overshoots"
    os.environ["FLUX_LAYERS_WORKSPACE_MAX_GIB"] = str(live[0].max_m * 512 * 2 / 2**30 * 1.2)
    with pytest.raises(RuntimeError, match=r"needs .* GiB of symmetric memory, over FLUX_LAYERS_WORKSPACE_MAX_GIB"):
        _ag_call(rank, tp, seed, m=live[0].max_m // tp + 128, k=512)
    assert_close_rel(*_ag_call(rank, tp, seed, m=2048, k=512), f"rank {rank} ag_gemm after the cap")
    torch.cuda.synchronize()


@at_tp2_when_lean("the growth rule")
def test_workspace_growth_is_bounded_and_capped():
    run_distributed(_growth, TP, _seed(), backend="nccl")


def _reset(rank, tp, seed):
    from flux_layers.ops import _dispatch
    from flux_layers.runtime import workspace
    from flux_layers.runtime.workspace import WorkspaceError
    poison_outputs()
    assert_close_rel(*_ag_call(rank, tp, seed), f"rank {rank} before the timeout")
    torch.cuda.synchronize()
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    old = _dispatch.decided("ag_gemm", x, w, dist.group.WORLD, "nt", "fused").workspace  # on every rank, not run
    old.timeout_s = TIMEOUT_S
    dist.barrier()
    if rank == 0:  # the others never make this call
        from flux_layers import ops
        ops.ag_gemm(x, w, group=dist.group.WORLD, backend="fused")
        with pytest.raises(WorkspaceError, match="rank 0 timed out"):
            old.check()
    dist.barrier()
    workspace.reset()
    assert not workspace._cache
    # its native state freed there (with the GIL released), not whenever Python drops the object
    assert old.closed
    with pytest.raises((ValueError, RuntimeError), match="was closed"):
        old.native.epoch()
    assert _dispatch.decided("ag_gemm", x, w, dist.group.WORLD, "nt", "fused").workspace is not old
    for i in range(2):
        assert_close_rel(*_ag_call(rank, tp, seed + 1 + i), f"rank {rank} ag_gemm after the reset")
        assert_close_rel(*_rs_call(rank, tp, seed + 1 + i), f"rank {rank} gemm_rs after the reset")
    torch.cuda.synchronize()


def test_reset_after_a_timeout_brings_the_ranks_back_in_step():
    run_distributed(_reset, TP, _seed(), backend="nccl", timeout_s=120)


def _stress(rank, tp, seed):
    from flux_layers.devtools import stress
    poison_outputs()
    cfg = stress.StressConfig(calls=300, batch=25, rows=(8, 128, 264, 512), k=512, n=512, input_sets=4,
                              graph_share=0.2, late_every=50, late_ms=10.0, seed=seed % 1000)
    record = stress.run(rank, tp, dist.group.WORLD, cfg)
    assert record["mismatches"] == 0, f"rank {rank}: {record['first_mismatches']}"
    assert record["graph_replays"] > 20 and record["late_calls"] == 6, record
    torch.cuda.synchronize()


@at_tp2_when_lean("its 300 pipelined calls per rank take minutes among more time-sliced processes")
def test_short_stress_of_pipelined_mixed_calls():
    run_distributed(_stress, TP, _seed(), backend="nccl", timeout_s=300 if shared_gpu() else 180)
