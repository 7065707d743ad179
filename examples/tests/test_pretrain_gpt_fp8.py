"""examples/pretrain_gpt.py --fp8 on CPU (2 gloo processes, tiny config, reference backend): the FP8 run trains to
within 3% of the 16-bit run's final loss (same seed, 100 iterations, through ``--compare --fp8``), its layers ran
FP8, and checkpoints interchange between 16-bit and FP8 runs."""
from __future__ import annotations

import json

import pytest
import torch

from examples.gpt import pretrain as pretrain_gpt
from examples.tests.test_pretrain_gpt import _metrics, _run
from examples.tests.test_pretrain_gpt import test_bad_flags_are_parser_errors as _expect_parser_error

LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def test_fp8_compare_trains_within_3_percent_of_bf16(tmp_path):
    out = _run("--compare", "--fp8", "hybrid", "--results-dir", str(tmp_path), "--tag", "t", timeout=600)
    assert "FP8 hybrid (tensorwise, FP8 wgrad)" in out.stdout
    record = _metrics(tmp_path / "e2e_gpt_t.json")
    assert list(record["results"]) == ["megatron", "flux_fp8_reference", "flux_fp8"]
    assert record["fp8"] == {"fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_wgrad": True}
    for key in ("speedup_over_fp8_reference", "speedup_over_bf16"):
        assert record[key] > 0
    fp8, ref, bf16 = (record["results"][k] for k in ("flux_fp8", "flux_fp8_reference", "megatron"))
    assert len(fp8["losses"]) == len(bf16["losses"]) == 100
    assert fp8["losses"][-1] < fp8["losses"][0] - 4.0          # it trains
    assert abs(fp8["losses"][-1] - bf16["losses"][-1]) <= 0.03 * bf16["losses"][-1], (fp8["losses"][-1],
                                                                                      bf16["losses"][-1])
    assert record["final_loss_vs_bf16"] == pytest.approx((fp8["losses"][-1] - bf16["losses"][-1]) /
                                                         bf16["losses"][-1])
    # On the CPU both FP8 runs take the reference path: the same maths, the same losses.
    assert fp8["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=0)
    # The flux linears ran FP8 (megatron's report no paths), and the losses are not the 16-bit run's.
    paths = fp8["linear_paths"]
    assert set(paths) == {f"decoder.layers.*.{n}" for n in LINEARS}
    assert all(p[g]["reason"].startswith("FP8") for p in paths.values() for g in ("fprop", "dgrad", "wgrad"))
    assert bf16["linear_paths"] == {}
    assert fp8["losses"][1:] != pytest.approx(bf16["losses"][1:], rel=1e-4, abs=0)


def _model_state(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_checkpoints_interchange_between_bf16_and_fp8(tmp_path):
    """bf16 run saves at 10; an FP8 run resumes it and saves at 15 in the same format; a bf16 run resumes that.
    The resumed curves stay within 3% of the uninterrupted bf16 run."""
    bf16_ckpt, fp8_ckpt = tmp_path / "bf16", tmp_path / "fp8"
    full = tmp_path / "full.json"
    _run("--train-iters", "20", "--save", str(bf16_ckpt), "--save-interval", "10", "--metrics-out", str(full),
         timeout=300)
    resumed_fp8 = tmp_path / "resumed_fp8.json"
    out = _run("--fp8", "hybrid", "--train-iters", "20", "--load", str(bf16_ckpt), "--ckpt-step", "10",
               "--save", str(fp8_ckpt), "--exit-interval", "15", "--metrics-out", str(resumed_fp8), timeout=300)
    assert "at iteration 10" in out.stdout and "FP8 hybrid" in out.stdout
    resumed_bf16 = tmp_path / "resumed_bf16.json"
    out = _run("--train-iters", "20", "--load", str(fp8_ckpt), "--metrics-out", str(resumed_bf16), timeout=300)
    assert "at iteration 15" in out.stdout
    a, b, c = (_metrics(p) for p in (full, resumed_fp8, resumed_bf16))
    assert b["fp8"]["fp8"] == "hybrid" and c["fp8"] is None
    assert b["iterations"] == list(range(11, 16)) and c["iterations"] == list(range(16, 21))
    for resumed in (b, c):
        for it, loss in zip(resumed["iterations"], resumed["losses"]):
            assert loss == pytest.approx(a["losses"][it - 1], rel=0.03), (it, loss, a["losses"][it - 1])
    # The same checkpoint format: keys, dtypes and shapes of the model state, no FP8 tensors.
    for rank in ("rank_000.pt", "rank_001.pt"):
        s16 = _model_state(bf16_ckpt / "iter_0000010" / rank)
        s8 = _model_state(fp8_ckpt / "iter_0000015" / rank)
        assert list(s16) == list(s8)
        for key, value in s8.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == s16[key].dtype and value.shape == s16[key].shape, key
                assert value.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2), key


@pytest.mark.parametrize("flags, message", [
    (["--fp8", "e5m2"], "invalid choice: 'e5m2'"),
    (["--fp8", "hybrid", "--ffn-hidden-size", "176"],
     "--fp8 needs every linear's features per rank to be multiples of 16 (FP8 GEMMs); at tensor-parallel size 2: "
     "ffn_hidden_size / tp (fc2 input) = 88"),
])
def test_bad_fp8_flags_are_parser_errors(flags, message, monkeypatch, capsys):
    _expect_parser_error(flags, message, monkeypatch, capsys)


def test_fp8_flags_reach_the_config():
    args, _ = pretrain_gpt.resolve_args(pretrain_gpt.build_parser(), ["--device", "cpu", "--fp8", "e4m3",
                                                                      "--no-fp8-wgrad", "--tp", "2"])
    assert pretrain_gpt.fp8_settings(args) == {"fp8": "e4m3", "fp8_recipe": "tensorwise", "fp8_wgrad": False}
    args, _ = pretrain_gpt.resolve_args(pretrain_gpt.build_parser(), ["--device", "cpu", "--tp", "2"])
    assert pretrain_gpt.fp8_settings(args) is None
    json.dumps(pretrain_gpt.fp8_settings(args))
