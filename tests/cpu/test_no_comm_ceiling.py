"""flux_layers/devtools/no_comm.py: inside the context megatron-core's sequence-parallel linears move nothing
between ranks (every torch.distributed collective raises) and compute on their local shard as described."""
import pytest
import torch

from flux_layers.devtools.launch import run_distributed


def _worker(rank, tp):
    import torch.distributed as dist
    from megatron.core import ModelParallelConfig
    from megatron.core import tensor_parallel as mtp

    from flux_layers.devtools import no_comm
    from tests.cpu.test_layers import megatron_on_cpu

    group = megatron_on_cpu(tp)
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True, use_cpu_initialization=True,
                                 params_dtype=torch.float64)
    col = mtp.ColumnParallelLinear(8, 6 * tp, config=config, init_method=torch.nn.init.normal_, bias=False,
                                   gather_output=False, tp_group=group)
    row = mtp.RowParallelLinear(6 * tp, 8, config=config, init_method=torch.nn.init.normal_, bias=False,
                                input_is_parallel=True, skip_bias_add=True, tp_group=group)
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(5, 1, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 1, 8, generator=g, dtype=torch.float64)

    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran inside megatron_collectives_as_local_copies")

    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base",
             "all_reduce", "all_gather")
    saved = {n: getattr(dist, n) for n in names}
    with no_comm.megatron_collectives_as_local_copies():
        for n in names:
            setattr(dist, n, refuse)
        try:
            h, _ = col(x)
            y, _ = row(h)
            y.backward(dy)
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)
    # Local semantics: the gathered input is tp copies of the local shard, the reduce-scatter keeps this rank's
    # slice of the local partial.
    x_all = x.detach().repeat(tp, 1, 1)
    h_ref = x_all @ col.weight.detach().t()
    y_ref = (h_ref @ row.weight.detach().t())[rank * 5:(rank + 1) * 5]
    torch.testing.assert_close(y.detach(), y_ref)
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # Restored afterwards: the real collectives run again.
    from megatron.core.tensor_parallel import layers, mappings
    assert layers.dist_all_gather_func is not no_comm.local_all_gather
    assert mappings.dist_reduce_scatter_func is not no_comm.local_reduce_scatter


@pytest.mark.parametrize("tp", [2])
def test_megatron_linears_move_nothing_inside_the_context(tp):
    run_distributed(_worker, tp)


def test_e2e_ceiling_runs_the_three_trainings(tmp_path):
    """examples/gpt/ceiling.py on the tiny CPU model: the three runs train and the JSON holds the ceiling."""
    import json
    import subprocess
    import sys
    out = tmp_path / "ceiling.json"
    proc = subprocess.run([sys.executable, "-m", "examples.gpt.ceiling", "--device", "cpu", "--model", "tiny",
                           "--train-iters", "6", "--timing-warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "measure nothing" in proc.stdout or "mean nothing" in proc.stdout
    record = json.loads(out.read_text())
    runs = record["results"]
    assert set(runs) == {"megatron", "flux", "megatron_no_comm"}
    assert all(len(r["losses"]) == 6 for r in runs.values())
    assert runs["megatron"]["losses"] != runs["megatron_no_comm"]["losses"], "the collectives were not replaced"
    # The figures are the runs' own: each median over the steps after the timing warm-up (1 step), the speedups
    # megatron's median over the other run's.
    import statistics
    median = {name: statistics.median(r["step_times_ms"][1:]) for name, r in runs.items()}
    assert all(len(r["step_times_ms"]) == 6 for r in runs.values())
    for name, r in runs.items():
        assert r["median_step_ms"] == pytest.approx(median[name], rel=1e-12), name
    assert record["ceiling_speedup"] == pytest.approx(median["megatron"] / median["megatron_no_comm"], rel=1e-12)
    assert record["flux_speedup"] == pytest.approx(median["megatron"] / median["flux"], rel=1e-12)
    gain = median["megatron"] - median["megatron_no_comm"]
    share = (median["megatron"] - median["flux"]) / gain if gain > 0 else None
    assert record["flux_share_of_ceiling"] == (pytest.approx(share, rel=1e-9) if share is not None else None)
    # Same seed, same data: the two implementations with communication train alike.
    assert abs(runs["megatron"]["losses"][-1] - runs["flux"]["losses"][-1]) < 1e-3
