"""examples/pretrain_gpt.py on CPU: 2 gloo processes, tiny config, reference backend.

The training runs are subprocesses of the README's command. They check that the loss falls, that a run resumed from
a checkpoint reproduces the uninterrupted run's losses, and that ``--compare`` writes its record. The config checks
and the data/FLOP helpers are tested in-process.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from examples.gpt import pretrain as pretrain_gpt
from examples.gpt.config import GPTRunConfig, load_model_config, validate
from examples.gpt.data import SyntheticCycleWalk
from examples.gpt.sizing import GiB, estimate_memory_per_gpu, forward_flops_per_token

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "pretrain_gpt.py")


def _run(*flags: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--model", "tiny", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _metrics(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_loss_falls_and_resume_continues_the_curve(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = tmp_path / "full.json"
    out = _run("--train-iters", "30", "--save", str(ckpt), "--save-interval", "15", "--metrics-out", str(full))
    assert "CPU run" in out.stdout and "mean nothing" in out.stdout
    assert "iter 30/30" in out.stdout
    a = _metrics(full)
    assert a["iterations"] == list(range(1, 31))
    assert a["losses"][0] > 6.0                      # ~ln(512) at initialisation
    assert a["losses"][-1] < a["losses"][0] - 2.0    # the synthetic stream is learnable
    assert sorted(os.listdir(ckpt)) == ["iter_0000015", "iter_0000030", "latest"]
    assert sorted(os.listdir(ckpt / "iter_0000015")) == ["rank_000.pt", "rank_001.pt"]

    resumed = tmp_path / "resumed.json"
    out = _run("--train-iters", "30", "--load", str(ckpt), "--ckpt-step", "15", "--metrics-out", str(resumed))
    assert "resumed from" in out.stdout and "at iteration 15" in out.stdout
    b = _metrics(resumed)
    assert b["iterations"] == list(range(16, 31))
    # Same data position, weights, optimizer and scheduler state: the curve continues (bitwise on CPU).
    assert b["losses"] == pytest.approx(a["losses"][15:], rel=1e-6, abs=0)
    assert b["lrs"] == pytest.approx(a["lrs"][15:], rel=1e-12, abs=0)


def test_compare_writes_table_json_and_plot(tmp_path):
    out = _run("--compare", "--train-iters", "8", "--timing-warmup", "2", "--results-dir", str(tmp_path),
               "--tag", "t")
    assert "speedup flux vs megatron" in out.stdout
    record = _metrics(tmp_path / "e2e_gpt_t.json")
    assert record["device"] == "cpu" and record["tensor_parallel"] == 2 and record["note"]
    assert record["command"].endswith("--tag t") and record["git_commit"]
    flux, megatron = record["results"]["flux"], record["results"]["megatron"]
    for r in (flux, megatron):
        assert len(r["losses"]) == len(r["step_times_ms"]) == 8
        assert r["median_step_ms"] > 0 and r["tokens_per_s"] > 0
    # Same seed, same initialisation, same maths (fp32 on CPU): the two implementations train identically.
    assert flux["losses"] == pytest.approx(megatron["losses"], rel=1e-5, abs=0)
    # The flux layers report their paths; on CPU every sequence-parallel GEMM takes the reference path.
    paths = flux["linear_paths"]
    assert set(paths) == {f"decoder.layers.*.{n}" for n in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                           "mlp.linear_fc1", "mlp.linear_fc2")}
    assert all(p["fprop"]["path"] == "reference" for p in paths.values())
    assert megatron["linear_paths"] == {}
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "e2e_gpt_t.png").exists() == has_matplotlib


def test_bad_flag_exits_with_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--seq-length", "63"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "seq_length (63) must be divisible by the tensor-parallel size (2) under sequence parallelism" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--hidden-size", "65", "--num-attention-heads", "5"], "hidden_size (65) must be divisible by the "
                                                            "tensor-parallel size (2)"),
    (["--model", "nope"], "unknown model 'nope'"),
    (["--compare", "--save", "x"], "--compare trains both implementations from scratch"),
    (["--backend", "fused"], "--backend fused needs CUDA GPUs"),
    (["--cuda-graphs"], "--cuda-graphs needs --device cuda"),
    (["--load", "/nonexistent"], "no checkpoint there"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load"),
    (["--save-interval", "3"], "--save-interval needs --save"),
    (["--compare", "--train-iters", "6", "--timing-warmup", "6"], "--timing-warmup 6 leaves no timed iteration"),
])
def test_bad_flags_are_parser_errors(flags, message, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.resolve_args(pretrain_gpt.build_parser(), ["--device", "cpu", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ({"num_attention_heads": 2}, "num_attention_heads (2) must be divisible by the tensor-parallel size (4)"),
    ({"ffn_hidden_size": 170}, "ffn_hidden_size (170) must be divisible"),
    ({"vocab_size": 510}, "vocab_size (510) must be divisible"),
    ({"num_query_groups": 3}, "num_query_groups (3) must divide"),
    ({"lr_warmup_iters": 100}, "lr_warmup_iters (100) must be in [0, train_iters=100)"),
    ({"min_lr": 1.0}, "min_lr <= lr"),
])
def test_validate_names_the_fields(override, message):
    cfg = load_model_config("tiny", override)
    with pytest.raises(ValueError) as exc:
        validate(cfg, tp=4)
    assert message in str(exc.value)


def test_model_configs_are_valid_at_tp2():
    for name in ("tiny", "gpt-1b", "h8192"):
        validate(load_model_config(name), tp=2)


def test_unknown_yaml_field_is_an_error(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("num_layers: 2\nhiddn_size: 64\n")
    with pytest.raises(ValueError, match=r"unknown fields \['hiddn_size'\]"):
        load_model_config(str(path))


def test_h8192_fills_but_fits_two_h200():
    cfg = load_model_config("h8192")
    assert (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.seq_length) == (8192, 28672, 64, 8192)
    # As many layers as leave ~10 GiB of an H200 (143771 MiB) for transient backward buffers and fragmentation.
    budget = 143771 * 2 ** 20 - 10 * GiB
    assert estimate_memory_per_gpu(cfg, tp=2).total <= budget
    one_more = dataclasses.replace(cfg, num_layers=cfg.num_layers + 1)
    assert estimate_memory_per_gpu(one_more, tp=2).total > budget


def test_flops_formula():
    cfg = GPTRunConfig(num_layers=1, hidden_size=8, ffn_hidden_size=12, num_attention_heads=2, num_query_groups=1,
                       vocab_size=16, seq_length=4)
    d, g = 4, 1
    expected = 2 * 8 * (8 + 2 * g * d) + 2 * 4 * 8 + 2 * 8 * 8 + 6 * 8 * 12 + 2 * 8 * 16
    assert forward_flops_per_token(cfg) == expected


def test_synthetic_stream_is_deterministic_and_learnable():
    data = SyntheticCycleWalk(vocab_size=64, seq_length=128, seed=5, jump_prob=0.1)
    a, b = data.batch(3, 4), data.batch(3, 4)
    assert a.shape == (4, 129) and a.equal(b)
    assert not a.equal(data.batch(4, 4))
    successor = data.cycle[(data.position[a[:, :-1]] + 1) % 64]
    follows = (successor == a[:, 1:]).float().mean().item()
    assert 0.8 < follows < 0.97  # 1 - jump_prob, plus jumps that land on the successor by chance


def _check_mixed_precision_adamw(rank, world):
    import torch
    import torch.distributed as dist

    from examples.gpt.train import MixedPrecisionAdamW

    cfg = GPTRunConfig(lr=1e-2, clip_grad=0.5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    g = torch.Generator().manual_seed(7)
    shards = [torch.randn(4, 3, generator=g) for _ in range(world)]       # a TP-sharded matrix, one shard a rank
    norm0 = torch.randn(3, generator=g)                                    # an SP norm weight, replicated
    grads_w = [torch.randn(4, 3, generator=g) for _ in range(world)]
    grads_n = [torch.randn(3, generator=g) for _ in range(world)]          # partial sums over each rank's tokens

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(shards[rank].to(torch.bfloat16))
    model.norm = torch.nn.Parameter(norm0.to(torch.bfloat16))
    model.w.tensor_model_parallel = True
    model.norm.sequence_parallel = True
    opt = MixedPrecisionAdamW(model, cfg, dist.group.WORLD)
    opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = cfg.lr
    opt.param_groups[0]["weight_decay"], opt.param_groups[1]["weight_decay"] = cfg.weight_decay, 0.0
    model.w.grad = grads_w[rank].to(torch.bfloat16)
    model.norm.grad = grads_n[rank].to(torch.bfloat16)
    grad_norm = opt.step()

    # Reference: fp32 masters from the bf16 weights, SP grads summed, one global norm over the unique parameters.
    gw = grads_w[rank].to(torch.bfloat16).float()
    gn = sum(x.to(torch.bfloat16).float() for x in grads_n)
    total = (sum(x.to(torch.bfloat16).float().pow(2).sum() for x in grads_w) + gn.pow(2).sum()).sqrt()
    assert grad_norm == pytest.approx(total.item(), rel=1e-5)
    coef = min(1.0, cfg.clip_grad / (total.item() + 1e-6))
    ref_w = torch.nn.Parameter(shards[rank].to(torch.bfloat16).float())
    ref_n = torch.nn.Parameter(norm0.to(torch.bfloat16).float())
    ref = torch.optim.AdamW([{"params": [ref_w], "weight_decay": cfg.weight_decay},
                             {"params": [ref_n], "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    ref_w.grad, ref_n.grad = gw * coef, gn * coef
    ref.step()
    torch.testing.assert_close(opt.masters[0], ref_w.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.masters[1], ref_n.detach(), rtol=1e-6, atol=1e-7)
    assert model.w.dtype == torch.bfloat16 and model.w.grad is None
    torch.testing.assert_close(model.w.detach(), opt.masters[0].to(torch.bfloat16), rtol=0, atol=0)


def test_mixed_precision_adamw_reduces_clips_and_updates_fp32_masters():
    from flux_layers.devtools.launch import run_distributed
    run_distributed(_check_mixed_precision_adamw, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_train_as_eager(tmp_path):
    """--cuda-graphs on one GPU (TP=1): megatron-core's local CUDA graphs around the flux layers train the same
    losses as the eager run (graphs are captured after iteration 1 and replayed from iteration 2)."""
    curves = {}
    for graphs in (False, True):
        out = tmp_path / f"graphs_{graphs}.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        flags = ["--device", "cuda", "--tp", "1", "--model", "tiny", "--train-iters", "12", "--metrics-out", str(out)]
        proc = subprocess.run([sys.executable, SCRIPT, *flags, *(["--cuda-graphs"] if graphs else [])], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        curves[graphs] = _metrics(out)
    assert curves[True]["cuda_graphs"] is True
    eager, graphed = curves[False]["losses"], curves[True]["losses"]
    assert len(graphed) == 12 and graphed[-1] < graphed[0], graphed
    worst = max(abs(a - b) / abs(a) for a, b in zip(eager, graphed))
    assert worst < 2e-2, f"graphed losses {graphed} differ from eager {eager} (worst relative {worst:.3e})"
