"""The op library's persistent GEMM against an fp32 reference (1 GPU)."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.gpu_support import (
    assert_close_rel,
    needs_gpus,
    poison_outputs,
    random_matrix,
    references,
    stream_k_active,
)

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

SHAPES = [(1024, 1024, 1024), (1000, 520, 1048), (8, 136, 264), (4104, 4104, 512), (300, 2056, 128)]  # (M, N, K)


@pytest.fixture(autouse=True)
def _poison():
    poison_outputs()


@pytest.mark.parametrize("tile", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", ["nt", "nn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mnk", SHAPES)
def test_gemm_matches_fp32_reference(mnk, dtype, layout, with_bias, tile):
    from flux_layers.ops import fused_gemm
    m, n, k = mnk
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    x = random_matrix(m, k, dtype, gen)
    w = random_matrix(n, k, dtype, gen) if layout == "nt" else random_matrix(k, n, dtype, gen)
    b = random_matrix(1, n, dtype, gen)[0] if with_bias else None
    out = fused_gemm.gemm(x, w, b, weight_layout=layout, tile=tile)
    assert_close_rel(out, *references(x, w, b, layout), f"gemm {mnk} {dtype} {layout} bias={with_bias} tile={tile}")


def test_gemm_row_stride_and_views():
    from flux_layers.ops import fused_gemm
    gen = torch.Generator(device="cuda").manual_seed(7)
    big = random_matrix(512, 1024, torch.bfloat16, gen)
    x = big[:, :512]  # row stride 1024 elements, not contiguous
    w = random_matrix(256, 512, torch.bfloat16, gen)
    out = fused_gemm.gemm(x, w)
    assert_close_rel(out, *references(x, w, None, "nt"), "strided x")


def test_bad_inputs_raise_and_later_calls_work():
    from flux_layers.ops import fused_gemm
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = random_matrix(256, 512, torch.bfloat16, gen)
    w = random_matrix(128, 512, torch.bfloat16, gen)
    with pytest.raises(ValueError, match="dtype"):
        fused_gemm.gemm(x, w.float())
    with pytest.raises(ValueError, match="dtype"):
        fused_gemm.gemm(x.float(), w.float())
    with pytest.raises(ValueError, match="CUDA"):
        fused_gemm.gemm(x.cpu(), w.cpu())
    with pytest.raises(ValueError, match="disagree on K"):
        fused_gemm.gemm(x, random_matrix(128, 256, torch.bfloat16, gen))
    with pytest.raises(ValueError, match="unit stride"):
        fused_gemm.gemm(random_matrix(512, 256, torch.bfloat16, gen).t(), w)
    with pytest.raises(ValueError, match="multiple of"):
        fused_gemm.gemm(random_matrix(256, 510, torch.bfloat16, gen), random_matrix(128, 510, torch.bfloat16, gen))
    with pytest.raises(ValueError, match="bias"):
        fused_gemm.gemm(x, w, random_matrix(1, 64, torch.bfloat16, gen)[0])
    with pytest.raises(ValueError, match="tile"):
        fused_gemm.gemm(x, w, tile=7)
    out = fused_gemm.gemm(x, w)
    assert_close_rel(out, *references(x, w, None, "nt"), "valid call after bad ones")


# (M, N, K, tile, SMs, fill limit %): the persistent grid is limited so that the split of the last wave is known
# here; the last case splits a last wave 58/66 full, above the default limit.
STREAM_K_CASES = [(4096, 4096, 4096, 1, 44, 75), (1000, 1048, 4096, 1, 64, 75), (2048, 3072, 8192, 1, 132, 75),
                  (4104, 4104, 1032, 1, 40, 75), (4104, 4104, 1032, 1, 36, 75), (384, 512, 16384, 1, 64, 75),
                  (4096, 4096, 8192, 1, 132, 100)]


@pytest.mark.parametrize("layout", ["nt", "nn"])
@pytest.mark.parametrize("case", STREAM_K_CASES)
def test_stream_k_tail_matches_reference_and_repeats_bitwise(case, layout):
    from flux_layers.ops import fused_gemm
    m, n, k, tile, sms, fill = case
    # The persistent grid holds the SMs asked for, at most the device's: the split must happen at that count.
    # (Fewer clusters than SMs / 2 may be resident at once; which grid ran is for the op's report of the call.)
    grid = min(sms, torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    assert stream_k_active(m, n, k, 1, tile, grid, max_fill_pct=fill), \
        f"{case}: the stream-K tail would not run on a grid of {grid} SMs"
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = random_matrix(m, k, torch.bfloat16, gen)
    w = random_matrix(n, k, torch.bfloat16, gen) if layout == "nt" else random_matrix(k, n, torch.bfloat16, gen)
    b = random_matrix(1, n, torch.bfloat16, gen)[0]
    ref, cublas = references(x, w, b, layout)
    first = fused_gemm.gemm(x, w, b, weight_layout=layout, tile=tile, sm_count=sms, stream_k=fill)
    assert_close_rel(first, ref, cublas, f"stream-K {case} {layout}")
    again = fused_gemm.gemm(x, w, b, weight_layout=layout, tile=tile, sm_count=sms, stream_k=fill)
    assert torch.equal(first, again), f"stream-K {case} {layout}: two runs differ bitwise"
    whole = fused_gemm.gemm(x, w, b, weight_layout=layout, tile=tile, sm_count=sms, stream_k=False)
    assert_close_rel(whole, ref, cublas, f"whole tiles {case} {layout}")
