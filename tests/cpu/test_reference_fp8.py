"""FP8 operands on the reference backend (CPU, gloo) against an fp32 matmul of the same dequantized operands: every
scale mode and operand pair, per-shard all-gather scales, the gathered FP8 rows and scales, and bad inputs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flux_layers import ops
from flux_layers.devtools.launch import run_distributed
from flux_layers.ops.fp8 import FP8_MAX, ScaledTensor, dequantize, quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
MODES = [("tensor", "tensor"), ("row", "row"), ("tensor", "row"), ("row", "tensor")]
BF16_REL = 2.0**-7  # one bfloat16 rounding of the output (relative, Frobenius): well above 2^-9 per element


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def _operand(rows, cols, dtype, rowwise, gen, spread=True):
    t = torch.randn(rows, cols, generator=gen)
    if spread:  # rows of different magnitudes, so that row-wise scales differ
        t = t * torch.rand(rows, 1, generator=gen).add(0.05) * 10
    return quantize(t, dtype, rowwise=rowwise)


def _w_scale(q: ScaledTensor, mode: str) -> torch.Tensor:
    return q.scale.reshape(1, -1) if mode == "row" else q.scale


def test_quantize_scales_saturate_and_round_trip():
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(64, 48, generator=gen) * 7
    for dtype in (E4M3, E5M2):
        q = quantize(t, dtype)
        assert q.data.dtype == dtype and q.scale.shape == (1,)
        assert q.data.float().abs().max().item() == FP8_MAX[dtype]  # the amax element maps to the format's max
        assert _rel(dequantize(q), t) < (0.04 if dtype == E4M3 else 0.08)
        rows = quantize(t, dtype, rowwise=True)
        assert rows.scale.shape == (64, 1)
        assert torch.equal(rows.data.float().abs().amax(dim=1), torch.full((64,), FP8_MAX[dtype]))
    margin = quantize(t, E4M3, margin=2)
    assert margin.data.float().abs().max().item() == FP8_MAX[E4M3] / 4
    zero = quantize(torch.zeros(4, 16), E4M3, rowwise=True)
    assert torch.equal(zero.scale, torch.ones(4, 1)) and not zero.data.float().any()


def test_fp8_cast_setting_is_read_again_on_refresh(monkeypatch):
    from flux_layers.ops import fp8
    monkeypatch.setenv("FLUX_LAYERS_FP8_CAST", "two_pass")
    ops.refresh_settings()
    assert fp8._two_pass_casts()
    monkeypatch.setenv("FLUX_LAYERS_FP8_CAST", "one_pass")
    ops.refresh_settings()
    with pytest.raises(ValueError, match="FLUX_LAYERS_FP8_CAST"):
        fp8._two_pass_casts()
    monkeypatch.delenv("FLUX_LAYERS_FP8_CAST")
    ops.refresh_settings()
    assert not fp8._two_pass_casts()


@pytest.mark.parametrize("modes", MODES)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace("torch.float8_", ""))
def test_gemm_fp8_matches_dequantized_reference(pair, modes):
    gen = torch.Generator().manual_seed(7)
    xq = _operand(40, 96, pair[0], modes[0] == "row", gen)
    wq = _operand(48, 96, pair[1], modes[1] == "row", gen)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    ref = dequantize(xq) @ dequantize(wq).t() + bias.float()
    out = ops.gemm(xq.data, wq.data, bias, x_scale=xq.scale, w_scale=_w_scale(wq, modes[1]))
    assert out.dtype == torch.bfloat16 and out.shape == (40, 48)
    assert _rel(out, ref) < BF16_REL
    # The scales are applied: a wrong scale is not absorbed anywhere.
    doubled = ops.gemm(xq.data, wq.data, None, x_scale=xq.scale * 2, w_scale=_w_scale(wq, modes[1]))
    assert _rel(doubled, 2 * (ref - bias.float())) < BF16_REL


def _check_ag_gemm_fp8(rank, tp, mode, pair):
    """Each rank casts its own shard with its own scale (no collective before the cast); the GEMM applies every
    source rank's scale to that rank's rows; the gathered FP8 rows and scales come back exactly."""
    gen = torch.Generator().manual_seed(11)
    m, k, n = 8 * tp, 64, 32
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 20, m).reshape(m, 1)
    w = quantize(torch.randn(n * tp, k, generator=gen), pair[1])
    shards = [quantize(s, pair[0], rowwise=mode == "row") for s in x.chunk(tp)]
    mine = shards[rank]
    w_shard_n = w.data.chunk(tp)[rank].contiguous()
    out, gathered = ops.ag_gemm(mine.data, w_shard_n, None, group=dist.group.WORLD, return_gathered=True,
                                x_scale=mine.scale, w_scale=w.scale)
    ref = torch.cat([dequantize(s) for s in shards]) @ (w_shard_n.float() * w.scale).t()
    assert _rel(out, ref) < BF16_REL, f"rank {rank} {mode}: rel error {_rel(out, ref):.3e}"
    assert isinstance(gathered, ScaledTensor)
    assert torch.equal(gathered.data.view(torch.uint8), torch.cat([s.data for s in shards]).view(torch.uint8))
    want_scale = torch.cat([s.scale.reshape(1) for s in shards]) if mode == "tensor" else \
        torch.cat([s.scale for s in shards])
    assert torch.equal(gathered.scale, want_scale)
    if mode == "tensor":
        assert len(set(want_scale.tolist())) == tp, "the shards' scales should differ (the test would not see a mixup)"


@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("tp", [2, 4])
def test_ag_gemm_fp8_per_shard_scales(tp, mode, pair):
    run_distributed(_check_ag_gemm_fp8, tp, mode, pair)


def _check_gemm_rs_fp8(rank, tp, mode):
    gen = torch.Generator().manual_seed(13)
    m, k, n = 8 * tp, 32 * tp, 48
    x = torch.randn(m, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    xq = quantize(x.chunk(tp, dim=1)[rank].contiguous(), E4M3, rowwise=mode == "row")
    wq = quantize(w.chunk(tp, dim=1)[rank].contiguous(), E4M3, rowwise=mode == "row")
    out = ops.gemm_rs(xq.data, wq.data, bias, group=dist.group.WORLD, x_scale=xq.scale,
                      w_scale=_w_scale(wq, mode))
    # The oracle: every rank's dequantized partial, summed in fp32.
    partial = dequantize(xq) @ dequantize(wq).t()
    total = partial.clone()
    dist.all_reduce(total, group=dist.group.WORLD)
    ref = total.chunk(tp)[rank] + bias.float()
    assert out.shape == (m // tp, n) and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 2 * BF16_REL, f"rank {rank} {mode}: rel error {_rel(out, ref):.3e}"


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("tp", [2, 4])
def test_gemm_rs_fp8(tp, mode):
    run_distributed(_check_gemm_rs_fp8, tp, mode)


def test_fp8_bad_inputs_are_refused_with_the_rule():
    gen = torch.Generator().manual_seed(5)
    x = _operand(32, 64, E4M3, False, gen)
    w = _operand(48, 64, E4M3, False, gen)
    one = torch.ones(1)
    cases = [
        (lambda: ops.gemm(x.data.to(E5M2), w.data.to(E5M2), x_scale=one, w_scale=one), "e5m2 x e5m2"),
        (lambda: ops.gemm(x.data, w.data.t().contiguous(), x_scale=one, w_scale=one, weight_layout="nn"), "'nt'"),
        (lambda: ops.gemm(x.data, w.data), "need x_scale and w_scale"),
        (lambda: ops.gemm(x.data, w.data, x_scale=one), "need x_scale and w_scale"),
        (lambda: ops.gemm(x.data.to(torch.bfloat16), w.data, x_scale=one, w_scale=one), "both be FP8"),
        (lambda: ops.gemm(x.data, w.data, x_scale=one.double(), w_scale=one), "float32"),
        (lambda: ops.gemm(x.data, w.data, x_scale=torch.ones(7, 1), w_scale=one), r"\[32, 1\]"),
        (lambda: ops.gemm(x.data, w.data, x_scale=torch.ones(32, 2)[:, :1], w_scale=one), "contiguous"),
        (lambda: ops.gemm(x.data, w.data, x_scale=one, w_scale=torch.ones(48, 2)), r"\[1, 48\] or \[48, 1\]"),
        (lambda: ops.gemm(x.data, w.data, torch.zeros(48), x_scale=one, w_scale=one), "bias"),
        (lambda: ops.gemm(x.data[:, :40].contiguous(), w.data[:, :40].contiguous(), x_scale=one, w_scale=one),
         "multiples of 16"),
        (lambda: ops.gemm(x.data.to(torch.bfloat16), w.data.to(torch.bfloat16), x_scale=one, w_scale=one),
         "FP8 operands only"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
