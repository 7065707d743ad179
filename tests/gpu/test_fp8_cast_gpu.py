"""The op library's FP8 cast kernels give the same bits as the torch ops on the CPU (flux_layers/ops/fp8.py), 1 GPU."""
from __future__ import annotations

import pytest
import torch

from flux_layers.ops import fp8
from tests.gpu.gpu_support import needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

SHAPES = [(4096, 4096), (1000, 520), (3, 8), (257, 11008)]


def _input(rows, cols, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(rows, cols, generator=gen, device="cuda") * torch.rand(rows, 1, generator=gen, device="cuda") * 30
    return t.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    if a.dtype in fp8.FP8_DTYPES:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    diff = (a.cpu() != b.cpu()).sum().item()
    assert diff == 0, f"{what}: {diff} elements differ"


@pytest.mark.parametrize("margin", [0, 1])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("fmt", fp8.FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_kernel_matches_torch_bitwise(shape, dtype, fmt, rowwise, margin):
    t = _input(*shape, dtype, seed=shape[0] + shape[1])
    assert fp8._cast_kernels(t), "the kernels should take this input"
    got = fp8.quantize(t, fmt, rowwise=rowwise, margin=margin)
    want = fp8.quantize(t.cpu(), fmt, rowwise=rowwise, margin=margin)
    _same(got.scale, want.scale, f"scale {shape} {dtype} {fmt} rowwise={rowwise}")
    _same(got.data, want.data, f"data {shape} {dtype} {fmt} rowwise={rowwise}")


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_with_transpose_matches_torch_bitwise(shape):
    t = _input(*shape, torch.bfloat16, seed=7)
    got, got_t = fp8.quantize_with_transpose(t, torch.float8_e5m2)
    want, want_t = fp8.quantize_with_transpose(t.cpu(), torch.float8_e5m2)
    _same(got.data, want.data, "rows")
    _same(got_t.data, want_t.data, "transposed")
    _same(got_t.scale, want_t.scale, "scale")


def test_quantize_strided_view_and_zeros():
    big = _input(512, 1024, torch.bfloat16, seed=3)
    view = big[:, 256:768]
    _same(fp8.quantize(view).data, fp8.quantize(view.cpu()).data, "strided view")
    zero = fp8.quantize(torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16), rowwise=True)
    assert torch.equal(zero.scale.cpu(), torch.ones(64, 1)) and not zero.data.float().any()


@pytest.mark.parametrize("blocks", [1, 2, 4, 8])
@pytest.mark.parametrize("fmt", fp8.FP8_DTYPES)
def test_transpose_to_common_scale_matches_torch_bitwise(fmt, blocks):
    rows, cols = 1024, 776
    shards = [fp8.quantize(_input(rows // blocks, cols, torch.bfloat16, seed=b), fmt) for b in range(blocks)]
    q = fp8.ScaledTensor(torch.cat([s.data for s in shards]), torch.cat([s.scale for s in shards]))
    got = fp8.transpose_blocks_to_common_scale(q)
    want = fp8.transpose_blocks_to_common_scale(fp8.ScaledTensor(q.data.cpu(), q.scale.cpu()))
    _same(got.scale, want.scale, "common scale")
    _same(got.data, want.data, f"transposed {fmt} blocks={blocks}")
    assert got.scale.item() == q.scale.max().item()
