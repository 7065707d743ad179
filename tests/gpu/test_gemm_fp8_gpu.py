"""The op library's FP8 GEMM against an fp32 matmul of the dequantized operands, beside torch._scaled_mm (1 GPU)."""
from __future__ import annotations

import pytest
import torch

from flux_layers.devtools import oracle
from tests.gpu.gpu_support import needs_gpus, poison_outputs, stream_k_active

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
SCALES = [("tensor", "tensor"), ("row", "row"), ("tensor", "row"), ("row", "tensor")]
SHAPES = [(1024, 1024, 1024), (1000, 528, 1040), (8, 144, 272), (4104, 4112, 512), (300, 2064, 128)]  # (M, N, K)
# Tile configurations with an FP8 instance (csrc/kernels/gemm_dispatch.cu): split accumulation 128 x 128 only.
TILES = {("split", E4M3, E4M3): (2,), ("fast", E4M3, E4M3): (0, 1, 2)}


def tiles_of(accum, a, b):
    return TILES.get((accum, a, b), (2,) if accum == "split" else (1,))


@pytest.fixture(autouse=True)
def _poison():
    poison_outputs()


def fp8_operands(m, n, k, pair, modes, gen, with_bias=False):
    """x [M, K] and W [N, K] quantized with the scale modes (values spread over a range that FP8 resolves), and the
    fp32 reference of their dequantized product."""
    from flux_layers.ops.fp8 import dequantize, quantize
    x32 = torch.randn(m, k, generator=gen, device="cuda") * torch.rand(m, 1, generator=gen, device="cuda").add(0.1)
    w32 = torch.randn(n, k, generator=gen, device="cuda") * torch.rand(n, 1, generator=gen, device="cuda").add(0.1)
    xq = quantize(x32, pair[0], rowwise=modes[0] == "row")
    wq = quantize(w32, pair[1], rowwise=modes[1] == "row")
    w_scale = wq.scale.reshape(1, n) if modes[1] == "row" else wq.scale
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16) if with_bias else None
    ref = dequantize(xq) @ dequantize(wq).t()
    if bias is not None:
        ref = ref + bias.float()
    return xq.data, wq.data, xq.scale, w_scale, bias, ref


def scaled_mm(x, w, x_scale, w_scale, bias, fast_accum):
    """torch._scaled_mm on the same operands (row-wise form where either scale is row-wise)."""
    m, n = x.shape[0], w.shape[0]
    if x_scale.numel() == 1 and w_scale.numel() == 1:
        sa, sb = x_scale, w_scale
    else:
        sa = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
        sb = w_scale.reshape(1, -1).expand(1, n).contiguous()
    return torch._scaled_mm(x, w.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def assert_fp8_close(out, ref, cublas, what, ratio=1.25):
    assert out.shape == ref.shape and out.dtype == torch.bfloat16, f"{what}: {out.shape} {out.dtype}"
    nan = torch.isnan(out).sum().item()
    assert nan == 0, f"{what}: {nan} elements were not written (still NaN)"
    err, base = oracle.rel_error(out, ref), oracle.rel_error(cublas, ref)
    limit = ratio * max(base, 2.0**-10)
    assert err <= limit, f"{what}: relative error {err:.3e} > {limit:.3e} ({ratio}x _scaled_mm's {base:.3e})"


@pytest.mark.parametrize("accum", ["split", "fast"])
@pytest.mark.parametrize("modes", SCALES)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace("torch.float8_", ""))
@pytest.mark.parametrize("mnk", SHAPES)
def test_fp8_gemm_matches_dequantized_reference(mnk, pair, modes, accum):
    from flux_layers.ops import fused_gemm
    m, n, k = mnk
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    for with_bias in (False, True):
        x, w, xs, ws, b, ref = fp8_operands(m, n, k, pair, modes, gen, with_bias)
        cublas = scaled_mm(x, w, xs, ws, b, accum == "fast")
        for tile in tiles_of(accum, *pair):
            out = fused_gemm.gemm(x, w, b, x_scale=xs, w_scale=ws, fast_accum=accum == "fast", tile=tile)
            assert_fp8_close(out, ref, cublas, f"fp8 gemm {mnk} {pair} {modes} {accum} tile={tile} bias={with_bias}")


@pytest.mark.parametrize("case", [(4096, 4096, 4096, 44), (1000, 1056, 4096, 64), (2048, 3072, 8192, 132)])
def test_fp8_stream_k_tail_matches_reference_and_repeats_bitwise(case):
    from flux_layers.ops import fused_gemm
    m, n, k, sms = case
    assert stream_k_active(m, n, k, 1, 2, sms, max_fill_pct=100, tile_k=128), \
        f"{case}: the stream-K tail would not run"
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x, w, xs, ws, b, ref = fp8_operands(m, n, k, (E4M3, E4M3), ("row", "row"), gen, True)
    cublas = scaled_mm(x, w, xs, ws, b, False)
    first = fused_gemm.gemm(x, w, b, x_scale=xs, w_scale=ws, tile=2, sm_count=sms, stream_k=100)
    assert_fp8_close(first, ref, cublas, f"fp8 stream-K {case}")
    again = fused_gemm.gemm(x, w, b, x_scale=xs, w_scale=ws, tile=2, sm_count=sms, stream_k=100)
    assert torch.equal(first, again), f"fp8 stream-K {case}: two runs differ bitwise"


def test_fp8_scales_are_read_on_the_device_in_graph_replays():
    """A captured FP8 GEMM reads its scales when it runs: changing them in place changes a replay's output."""
    from flux_layers.ops import fused_gemm
    gen = torch.Generator(device="cuda").manual_seed(11)
    x, w, xs, ws, _, ref = fp8_operands(512, 256, 512, (E4M3, E4M3), ("tensor", "tensor"), gen)
    fused_gemm.gemm(x, w, x_scale=xs, w_scale=ws)  # warm-up outside capture (descriptors, attributes)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_gemm.gemm(x, w, x_scale=xs, w_scale=ws)
    graph.replay()
    first = out.clone()
    assert_fp8_close(first, ref, scaled_mm(x, w, xs, ws, None, False), "captured fp8 gemm")
    xs.mul_(2.0)
    graph.replay()
    assert torch.equal(out, (first.float() * 2).to(torch.bfloat16)), "the replay did not read the new x_scale"


def test_fp8_bad_inputs_raise_and_later_calls_work():
    from flux_layers.ops import fused_gemm
    gen = torch.Generator(device="cuda").manual_seed(3)
    x, w, xs, ws, _, ref = fp8_operands(256, 128, 512, (E4M3, E4M3), ("tensor", "tensor"), gen)
    bf = x.to(torch.bfloat16)
    cases = [
        (lambda: fused_gemm.gemm(x.to(E5M2), w.to(E5M2), x_scale=xs, w_scale=ws), "e5m2 x e5m2"),
        (lambda: fused_gemm.gemm(x, w.t().contiguous(), x_scale=xs, w_scale=ws, weight_layout="nn"), "'nt'"),
        (lambda: fused_gemm.gemm(x, w), "x_scale and w_scale"),
        (lambda: fused_gemm.gemm(x, w, x_scale=xs), "x_scale and w_scale"),
        (lambda: fused_gemm.gemm(bf, w, x_scale=xs, w_scale=ws), "both be FP8"),
        (lambda: fused_gemm.gemm(x, w, x_scale=xs.double(), w_scale=ws), "float32"),
        (lambda: fused_gemm.gemm(x, w, x_scale=xs.cpu(), w_scale=ws), "device"),
        (lambda: fused_gemm.gemm(x, w, x_scale=torch.ones(7, 1, device="cuda"), w_scale=ws), "row-wise"),
        (lambda: fused_gemm.gemm(x, w, x_scale=xs, w_scale=torch.ones(128, 2, device="cuda")), "row-wise"),
        (lambda: fused_gemm.gemm(x, w, torch.zeros(128, device="cuda"), x_scale=xs, w_scale=ws), "bias"),
        (lambda: fused_gemm.gemm(x[:, :504], w[:, :504], x_scale=xs, w_scale=ws), "multiples of 16"),
        (lambda: fused_gemm.gemm(x, w, x_scale=xs, w_scale=ws, tile=1), "tile"),
        (lambda: fused_gemm.gemm(bf, bf[:128], x_scale=xs, w_scale=ws), "FP8 operands only"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    out = fused_gemm.gemm(x, w, x_scale=xs, w_scale=ws)
    assert_fp8_close(out, ref, scaled_mm(x, w, xs, ws, None, False), "valid call after bad ones")
