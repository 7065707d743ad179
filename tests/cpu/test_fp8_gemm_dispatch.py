"""A plain FP8 GEMM's ``auto`` path (flux_layers/ops/backend.fp8_gemm_choice): cuBLASLt (``torch._scaled_mm``, the
reference path on CUDA) unless the tuning table measured the op library's FP8 kernel faster for the nearest shape,
the operands' formats and the accumulation, with the table's FP8 entries (tools/make_dispatch_table.py from
benchmarks/results/gemm_fp8_h200.json, and for the H100's table gemm_fp8_h100.json) as the packaged tables hold them.
The GPU name is set to a table's, so the choice is made as on that GPU; on the CPU the fused path is blocked before
it is asked."""
from __future__ import annotations

import json
import os

import pytest
import torch

from flux_layers import ops
from flux_layers.ops import _dispatch, backend
from flux_layers.runtime import tuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FUSED_SHAPE = (8192, 28672, 8192)  # the one measured shape where the op library's kernel beat cuBLASLt (fast), on
#                                    both GPUs


@pytest.fixture
def on_h200(monkeypatch):
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "NVIDIA H200")
    monkeypatch.delenv("FLUX_LAYERS_TUNING", raising=False)
    monkeypatch.delenv("FLUX_LAYERS_DISPATCH", raising=False)
    ops.refresh_settings()
    yield monkeypatch
    ops.refresh_settings()


def _measured(results: str = "gemm_fp8_h200.json") -> dict[tuple, dict[str, float]]:
    with open(os.path.join(ROOT, "benchmarks/results", results)) as f:
        run = json.load(f)
    ratios: dict[tuple, dict[str, float]] = {}
    for r in run["results"]:
        ratios.setdefault((r["m"], r["k"], r["n"], r["accum"]), {})[r["scale"]] = r["flux_best_over_cublas"]
    return ratios


# Each packaged table with FP8 GEMM entries: the GPU name it is keyed by and the benchmark run it was made from.
FP8_TABLES = [("NVIDIA H200", "gemm_fp8_h200.json"), ("NVIDIA H100 80GB HBM3", "gemm_fp8_h100.json")]


@pytest.mark.parametrize("gpu,results", FP8_TABLES)
def test_every_measured_shape_takes_the_faster_implementation(on_h200, gpu, results):
    on_h200.setattr(tuning, "_gpu_name", lambda: gpu)
    measured = _measured(results)
    assert len(measured) >= 20
    for (m, k, n, accum), ratios in measured.items():
        choice = backend.fp8_gemm_choice(dtype=E4M3, w_dtype=E4M3, mkn=(m, k, n), fast_accum=accum == "fast")
        faster = "fused" if min(ratios.values()) > 1.0 else "reference"
        assert choice.path == faster, f"{gpu} {m}x{k}x{n} {accum}: {choice}, measured {ratios}"
        assert "tuning table" in choice.reason and results in choice.reason, choice.reason
    assert backend.fp8_gemm_choice(dtype=E4M3, w_dtype=E4M3, mkn=FUSED_SHAPE, fast_accum=True).path == "fused"


def test_unmeasured_shapes_and_format_pairs_take_cublaslt(on_h200):
    choice = backend.fp8_gemm_choice(dtype=E4M3, w_dtype=E4M3, mkn=(256, 512, 128), fast_accum=False)
    assert choice.path == "reference" and choice.reason == "auto: " + backend.FP8_GEMM_DEFAULT
    # The entries were measured for e4m3 x e4m3: another pair of formats finds none, even at the fused shape.
    for x_dtype, w_dtype in ((E4M3, E5M2), (E5M2, E4M3)):
        choice = backend.fp8_gemm_choice(dtype=x_dtype, w_dtype=w_dtype, mkn=FUSED_SHAPE, fast_accum=True)
        assert choice.path == "reference" and choice.reason.startswith("auto: "), (x_dtype, w_dtype, choice)


def test_dispatch_always_runs_the_op_library(on_h200):
    on_h200.setenv("FLUX_LAYERS_DISPATCH", "always")
    ops.refresh_settings()
    choice = backend.fp8_gemm_choice(dtype=E4M3, w_dtype=E4M3, mkn=(4096, 2048, 4096), fast_accum=False)
    assert choice.path == "fused", choice


def test_the_16_bit_plain_gemm_still_runs_the_op_library(on_h200):
    assert backend.auto_choice("gemm", dtype=torch.bfloat16, tp=1, mkn=(4096, 2048, 4096)).path == "fused"


def test_forced_fp8_kernels_take_the_measured_configuration_of_their_pair(on_h200):
    # 4096x2048x4096 split: best measured 128 x 128 (id 2) in panels of 8, against the default's 16.
    assert tuning.kernel_config("gemm", dtype=E4M3, tp=1, mkn=(4096, 2048, 4096), fast_accum=False,
                                w_dtype=E4M3) == (2, 8)
    # No entry for e4m3 x e5m2 (its instances differ): the default.
    assert tuning.kernel_config("gemm", dtype=E4M3, tp=1, mkn=(4096, 2048, 4096), fast_accum=False,
                                w_dtype=E5M2) == (2, 16)
    # The fused ops have FP8 entries of their own (none yet): a plain GEMM's entry is not theirs.
    assert tuning.kernel_config("ag_gemm", dtype=E4M3, tp=2, mkn=(4096, 2048, 4096), fast_accum=False,
                                w_dtype=E4M3) == (2, 16)


def test_forced_fp8_kernels_take_the_measured_stream_k_choice(on_h200):
    def choose(mkn, **kw):
        return tuning.resolve_kernel("gemm", dtype=E4M3, tp=1, mkn=mkn, fast_accum=False, w_dtype=E4M3, **kw)
    # On each GPU's table, each measured split shape takes its entry's configuration, the tail included: whole tiles
    # where they measured fastest, the tail where it did (both tables hold both).
    for table, gpu in (("dispatch_h100.json", "NVIDIA H100 80GB HBM3"), ("dispatch_h200.json", "NVIDIA H200")):
        on_h200.setattr(tuning, "_gpu_name", lambda gpu=gpu: gpu)
        on_h200.setenv("FLUX_LAYERS_STREAM_K", "auto")
        with open(os.path.join(ROOT, "flux_layers", "tuning_tables", table)) as f:
            split = [e for e in json.load(f)["entries"] if e["op"] == "gemm" and e["accum"] == "split"
                     and e["dtype"] == e["w_dtype"] == "float8_e4m3fn"]
        assert {e["stream_k"] for e in split} == {True, False}, table
        for e in split:
            assert tuning.kernel_name(choose((e["m"], e["k"], e["n"]))) == e["config"], (table, e)
        whole = next((e["m"], e["k"], e["n"]) for e in split if not e["stream_k"])
        tail = next((e["m"], e["k"], e["n"]) for e in split if e["stream_k"])
        # The caller's own choice of the tile or of the tail, and FLUX_LAYERS_STREAM_K=1 or 0, win over the table's.
        assert choose(whole, stream_k=True).stream_k
        assert choose(whole, swizzle=8).stream_k
        on_h200.setenv("FLUX_LAYERS_STREAM_K", "1")
        assert choose(whole).stream_k
        on_h200.setenv("FLUX_LAYERS_STREAM_K", "0")
        assert not choose(tail).stream_k


def test_decisions_hand_the_dispatcher_the_accumulation_and_the_weight_format(monkeypatch):
    asked = []
    real = _dispatch.choose

    def spy(op, **kw):
        asked.append((op, kw.get("fast_accum"), kw.get("w_dtype")))
        return real(op, **kw)
    monkeypatch.setattr(_dispatch, "choose", spy)
    ops.refresh_settings()
    x, w = torch.randn(32, 64).to(E5M2), torch.randn(48, 64).to(E4M3)
    one = torch.ones((), dtype=torch.float32)
    for fast in (False, True):
        out = ops.gemm(x, w, x_scale=one, w_scale=one, fast_accum=fast)
        assert out.shape == (32, 48) and out.dtype == torch.bfloat16
    assert asked == [("gemm", False, E4M3), ("gemm", True, E4M3)], asked
    ops.refresh_settings()

