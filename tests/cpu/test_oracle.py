"""The GPU tests' oracle (flux_layers/devtools/oracle.py), on CPU: the bound follows cuBLAS's own error (here the
same product rounded to bfloat16 once), an output rounded twice passes, one with four times the error fails, an
unwritten (NaN) element fails."""
from __future__ import annotations

import torch

from flux_layers.devtools import oracle


def _problem(seed=0, m=64, k=512, n=48):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, b


def test_bound_follows_the_low_precision_product():
    x, w, b = _problem()
    ref = oracle.matmul_fp32(x, w, b, "nt")
    once = ref.to(torch.bfloat16)  # what an fp32-accumulating GEMM that rounds once produces
    ok, err, limit = oracle.verdict(once, ref, once)
    assert ok and 0 < err <= limit == oracle.bound(err, torch.bfloat16)
    partials = [oracle.matmul_fp32(x[:, i::2], w[:, i::2], None, "nt").to(torch.bfloat16) for i in range(2)]
    reduce_scattered = (partials[0].float() + partials[1].float() + b.float()).to(torch.bfloat16)
    assert oracle.verdict(reduce_scattered, ref, once)[0], "partials in bf16 summed in fp32 must pass"
    noisy = (ref + 4 * (once.float() - ref)).to(torch.bfloat16)
    assert not oracle.verdict(noisy, ref, once)[0]
    unwritten = once.clone()
    unwritten[3, 5] = float("nan")
    assert not oracle.verdict(unwritten, ref, once)[0]


def test_layouts_and_errors_on_device_agree():
    x, w, b = _problem(1)
    torch.testing.assert_close(oracle.matmul_fp32(x, w, b, "nt"), oracle.matmul_fp32(x, w.t().contiguous(), b, "nn"))
    torch.testing.assert_close(oracle.matmul_cublas(x, w, None, "nt").float(),
                               oracle.matmul_cublas(x, w.t().contiguous(), None, "nn").float())
    ref = oracle.matmul_fp32(x, w, None, "nt")
    out = ref.to(torch.bfloat16)
    on_device = oracle.errors(out, ref)
    assert on_device.dtype == torch.float64 and on_device.item() == oracle.rel_error(out, ref)


def test_floor_keeps_exact_products_checkable():
    x = torch.ones(8, 16, dtype=torch.bfloat16)
    w = torch.ones(8, 16, dtype=torch.bfloat16)
    ref = oracle.matmul_fp32(x, w, None, "nt")
    exact = oracle.matmul_cublas(x, w, None, "nt")
    assert oracle.rel_error(exact, ref) == 0
    assert oracle.verdict(exact, ref, exact) == (True, 0.0, oracle.RATIO * oracle.FLOOR[torch.bfloat16])
