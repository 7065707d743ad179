"""The FP8 linears on GPUs (2 ranks, or TP processes sharing one GPU with FLUX_LAYERS_TEST_SHARED_GPU=1 and
FLUX_LAYERS_TEST_TP: at TP > 2 the lean set, the three sequence-parallel linears), bf16 activations: the layers on
'auto' (the fused FP8 AG+GEMM and GEMM+RS; the plain FP8 GEMMs, wgrad and the layers without sequence parallelism, as
ops/backend.fp8_gemm_choice decides: cuBLASLt unless the op library's kernel measured faster) match the same layers
on the reference backend, and both match the fp64 reference of the same quantized math
(tests/cpu/test_layers_fp8.py). Needs the op library (fails, never skips, without it); fused outputs are poisoned
with NaN before every launch.
"""
from __future__ import annotations

import os

import pytest
import torch

from flux_layers.devtools.launch import run_distributed
from tests.cpu.test_layers_fp8 import Case, _rel, _run_case
from tests.gpu.gpu_support import layers_tp, lean, needs_gpus

TP = layers_tp()
pytestmark = [pytest.mark.gpu, needs_gpus(TP)]
AGREE = 2.0**-7   # fused against reference backend: the same FP8 operands, two bf16 roundings apart at most


def _cases():
    big = dict(dtype=torch.bfloat16, seq=256)
    for fmt, wgrad in (("hybrid", True), ("e4m3", True), ("hybrid", False)):
        yield Case("column", True, fmt, wgrad, k=512, n=768, **big)
        yield Case("row", True, fmt, wgrad, k=768, n=512, **big)
        yield Case("norm", True, fmt, wgrad, k=512, n=768, **big)
        if lean():  # TP time-sliced processes: the three linears on the fused ops once; the rest runs at TP = 2
            return
    yield Case("column", False, k=512, n=768, ga=True, **big)
    yield Case("row", False, k=768, n=512, **big)
    yield Case("column", True, k=512, n=768, wgrad_input="regather", **big)
    yield Case("row", True, k=768, n=512, ga=True, **big)
    yield Case("column", False, k=512, n=768, tp1=True, **big)
    yield Case("row", False, k=768, n=512, tp1=True, frozen=True, **big)


def _worker(rank, world, seed):
    import torch.distributed as dist
    from megatron.core import parallel_state

    import flux_layers
    from flux_layers import _library
    os.environ["FLUX_LAYERS_POISON_OUTPUTS"] = "1"
    assert flux_layers.fused_ops_available(), f"fused ops unavailable: {_library.unavailable_reason()}"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    solo = [dist.new_group([r]) for r in range(world)]
    for i, case in enumerate(_cases()):
        g = solo[rank] if case.tp1 else group
        reference = _run_case(case, rank, world, g, seed + i, device="cuda", backend="reference")
        assert all(p.path == "reference" for p in reference["paths"].values() if p.path != "local"), case
        # 'fused': every FP8 GEMM on the op library; 'auto': the local ones as ops/backend.fp8_gemm_choice decides.
        for backend in ("fused", "auto"):
            fused = _run_case(case, rank, world, g, seed + i, device="cuda", backend=backend)
            where = f"rank {rank} {backend} {case}"
            for name in ("output", "dgrad", "wgrad", "dbias"):
                a, b = fused[name], reference[name]
                if b is None:
                    assert a is None, (where, name)
                    continue
                assert not torch.isnan(a).any(), f"{where} {name}: NaN (an element was never written)"
                err = _rel(a.float().cpu(), b.double().cpu())
                assert err < AGREE, f"{where} {name}: fused vs reference backend relative error {err:.3e}"
            paths = fused["paths"]
            communicating = [p for p in ("fprop", "dgrad") if case.sp and not case.tp1]
            local = [p for p in ("fprop", "dgrad") if p not in communicating] + (
                ["wgrad"] if case.wgrad and not case.frozen else [])
            assert all(paths[p].path == "fused" for p in communicating), (where, paths)
            if backend == "fused":
                assert all(paths[p].path == "fused" for p in local), (where, paths)
            else:
                assert all("cuBLASLt" in paths[p].reason for p in local), (where, paths)


def test_fp8_layers_fused_match_reference_backend():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_distributed(_worker, TP, seed, backend="nccl")
