"""The one-pass FP8 casts (csrc/kernels/fp8_cast_onepass.cu, fp8_cast_rowwise.cu) give the bits of the torch math
(flux_layers.ops.fp8.quantize_torch, run on the CPU: a multiply by the inverse scale, as the kernels do) and of the
two-pass kernels: shapes the grid holds on chip and shapes it holds only in part, odd row counts, strided rows, all
zeros, one huge element, back-to-back calls and a CUDA-graph replay. 1 GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flux_layers import _library
from flux_layers.ops import fp8
from tests.gpu.gpu_support import needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (4096, 4096): held on chip whole on an H200 (132 SMs); (4096, 11008), (8192, 8192): larger than the grid holds,
# the rest read twice; odd row counts and columns that are not a multiple of the 64 x 64 tile.
HELD = [(4096, 4096), (1000, 520), (3, 8), (1, 4096), (129, 136)]
LARGER = [(4096, 11008), (8192, 8192), (4095, 11000)]


def _input(rows, cols, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(rows, cols, generator=gen, device="cuda") * torch.rand(rows, 1, generator=gen, device="cuda") * 30
    return t.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor, what: str):
    """Bitwise equal, but for the sign of a NaN: IEEE leaves that of a NaN an operation makes (inf / inf) to the
    machine (x86 sets it, the GPU does not), so NaN matches NaN of either sign."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    a, b = a.cpu(), b.cpu()
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(nan_a, nan_b), f"{what}: NaN in {int(nan_a.sum())} elements against {int(nan_b.sum())}"
    if a.dtype in fp8.FP8_DTYPES:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    diff = ((a != b) & ~nan_a).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def _op(t, fmt, rowwise=False, margin=0, transposed=False, two_pass=False):
    _library.require_library()  # the op is the library's; importing flux_layers does not load it
    return torch.ops.flux_layers.quantize_fp8(t, fmt, rowwise, 2.0**margin, transposed, two_pass)


def _check_tensorwise(t, fmt, margin, transposed, what):
    data, scale, data_t = _op(t, fmt, margin=margin, transposed=transposed)
    want = fp8.quantize_torch(t.cpu(), fmt, margin=margin)
    _same(scale, want.scale, f"scale {what}")
    _same(data, want.data, f"data {what}")
    if transposed:
        _same(data_t, want.data.t().contiguous(), f"transposed {what}")
    return data, scale, data_t


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("shape", HELD + LARGER)
def test_tensorwise_one_pass_matches_torch_bf16(shape, fmt, margin, transposed):
    t = _input(*shape, torch.bfloat16, seed=shape[0] * 7 + shape[1])
    _check_tensorwise(t, fmt, margin, transposed, f"{shape} bf16 {fmt} margin={margin} transposed={transposed}")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(4096, 4096), (129, 136), (4096, 11008)])
def test_tensorwise_one_pass_matches_torch_fp16(shape, fmt, transposed):
    t = _input(*shape, torch.float16, seed=shape[0] + shape[1])
    _check_tensorwise(t, fmt, 1, transposed, f"{shape} fp16 {fmt} transposed={transposed}")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(512, 1024), (4096, 11008)])
def test_strided_rows(shape, transposed):
    rows, cols = shape
    big = _input(rows, cols + 512, torch.bfloat16, seed=5)
    view = big[:, 256:256 + cols]
    assert view.stride(0) != view.shape[1]
    _check_tensorwise(view, E4M3, 0, transposed, f"view of {tuple(big.shape)}")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_all_zero_gets_scale_one(fmt, transposed):
    for shape in [(64, 64), (4096, 11008)]:
        t = torch.zeros(*shape, device="cuda", dtype=torch.bfloat16)
        data, scale, data_t = _check_tensorwise(t, fmt, 0, transposed, f"zeros {shape}")
        assert scale.item() == 1.0 and not data.view(torch.uint8).any()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 8192)])
def test_one_huge_element(shape, fmt, transposed):
    t = _input(*shape, torch.bfloat16, seed=11)
    t[shape[0] - 1, 8] = -3.0e38  # near bfloat16's max: every other element lands far below FP8's normal range
    _, scale, _ = _check_tensorwise(t, fmt, 0, transposed, f"huge element {shape} {fmt}")
    assert scale.item() == pytest.approx(3.0e38 / fp8.FP8_MAX[fmt], rel=1e-2)


def test_non_finite_inputs():
    for bad in (float("inf"), float("nan")):
        t = _input(1024, 2048, torch.bfloat16, seed=13)
        t[700, 33] = bad
        for transposed in (False, True):
            _check_tensorwise(t, E4M3, 0, transposed, f"{bad} element transposed={transposed}")


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("shape", HELD + [(4096, 11008), (64, 40960)])
def test_one_pass_matches_two_pass_kernels(shape, rowwise):
    t = _input(*shape, torch.bfloat16, seed=17)
    for fmt in (E4M3, E5M2):
        one = _op(t, fmt, rowwise=rowwise, margin=2)
        two = _op(t, fmt, rowwise=rowwise, margin=2, two_pass=True)
        _same(one[1], two[1], f"scale {shape} {fmt} rowwise={rowwise}")
        _same(one[0], two[0], f"data {shape} {fmt} rowwise={rowwise}")
    if not rowwise:
        one, two = _op(t, E5M2, transposed=True), _op(t, E5M2, transposed=True, two_pass=True)
        _same(one[2], two[2], f"transposed {shape}")


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4096, 11008), (64, 40960), (1000, 520), (3, 8), (129, 136)])
def test_rowwise_one_pass_matches_torch(shape, dtype, fmt):
    t = _input(*shape, dtype, seed=19)
    t[1 % shape[0]].zero_()  # an all-zero row: scale 1
    data, scale, _ = _op(t, fmt, rowwise=True, margin=1)
    want = fp8.quantize_torch(t.cpu(), fmt, rowwise=True, margin=1)
    _same(scale, want.scale, f"row scales {shape} {dtype} {fmt}")
    _same(data, want.data, f"data {shape} {dtype} {fmt}")


def test_back_to_back_calls_share_no_state():
    """A large amax, then a small one, then the large again, with no sync between: each call's scale is its own (a
    maximum kept from an earlier launch would show here)."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    big = torch.randn(4096, 4096, generator=gen, device="cuda").mul_(1000).to(torch.bfloat16)
    small = torch.randn(4096, 4096, generator=gen, device="cuda").mul_(0.001).to(torch.bfloat16)
    larger = torch.randn(4096, 11008, generator=gen, device="cuda").to(torch.bfloat16)
    inputs = [big, small, larger, small, big]
    outs = [(_op(t, E4M3), _op(t, E5M2, transposed=True)) for t in inputs]
    for i, (t, (a, b)) in enumerate(zip(inputs, outs)):
        want4, want5 = fp8.quantize_torch(t.cpu(), E4M3), fp8.quantize_torch(t.cpu(), E5M2)
        _same(a[1], want4.scale, f"call {i} scale")
        _same(a[0], want4.data, f"call {i} data")
        _same(b[1], want5.scale, f"call {i} scale (transposed call)")
        _same(b[2], want5.data.t().contiguous(), f"call {i} transposed")


@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 11008)])
def test_cuda_graph_capture_and_replay(shape):
    gen = torch.Generator(device="cuda").manual_seed(29)
    static = torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)
    _op(static, E4M3)
    _op(static, E5M2, transposed=True)  # first calls outside the capture, as torch's warm-up does
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = fp8.quantize(static, E4M3)
        q_rows, q_t = fp8.quantize_with_transpose(static, E5M2, margin=2)
    for scale in (3.0, 0.01):
        static.copy_(torch.randn(*shape, generator=gen, device="cuda").mul_(scale).to(torch.bfloat16))
        graph.replay()
        want4, want5 = fp8.quantize_torch(static.cpu(), E4M3), fp8.quantize_torch(static.cpu(), E5M2, margin=2)
        _same(q.scale, want4.scale, f"replayed scale x{scale}")
        _same(q.data, want4.data, f"replayed data x{scale}")
        _same(q_rows.data, want5.data, f"replayed rows x{scale}")
        _same(q_t.data, want5.data.t().contiguous(), f"replayed transpose x{scale}")
        _same(q_t.scale, want5.scale, f"replayed transposed scale x{scale}")


def test_first_cast_of_a_process_inside_a_capture():
    """The one-pass kernels' one-time host setup (device attributes, the shared memory limit) runs inside the capture
    when a process's first cast is captured."""
    code = textwrap.dedent("""
        import torch
        from flux_layers import _library
        from flux_layers.ops import fp8
        _library.require()
        x = torch.randn(4096, 11008, device="cuda").to(torch.float16)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            data, scale, data_t = torch.ops.flux_layers.quantize_fp8(x, torch.float8_e5m2, False, 1.0, True, False)
        graph.replay()
        want = fp8.quantize_torch(x.cpu(), torch.float8_e5m2)
        assert torch.equal(scale.cpu(), want.scale)
        assert torch.equal(data.cpu().view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(data_t.cpu().view(torch.uint8), want.data.t().contiguous().view(torch.uint8))
        print("replayed")
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "replayed" in run.stdout, run.stdout + run.stderr


def test_the_one_pass_kernels_run_and_two_pass_can_be_forced(monkeypatch):
    t = _input(4096, 4096, torch.bfloat16, seed=31)
    names = " ".join(_kernel_names(lambda: fp8.quantize_with_transpose(t)))
    assert "onepass_kernel" in names and "amax_kernel" not in names, names
    names = " ".join(_kernel_names(lambda: fp8.quantize(t, rowwise=True)))
    assert "rowwise_kernel" in names and "amax_kernel" not in names, names
    from flux_layers import ops
    monkeypatch.setenv("FLUX_LAYERS_FP8_CAST", "two_pass")
    ops.refresh_settings()
    try:
        names = " ".join(_kernel_names(lambda: fp8.quantize(t)))
        assert "amax_kernel" in names and "onepass_kernel" not in names, names
    finally:
        monkeypatch.delenv("FLUX_LAYERS_FP8_CAST")
        ops.refresh_settings()
