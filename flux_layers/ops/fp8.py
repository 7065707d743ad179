"""FP8 operands of the operators: formats, scales, and the checks every backend shares.

Scales are *dequantization* scales, as ``torch._scaled_mm`` takes them: the real value of an FP8 element ``q`` is
``q * scale``. fp32 device tensors, read by the kernels (no host sync; capturable in CUDA graphs).

| operand | tensor-wise | row-wise |
|---|---|---|
| x [rows, K] | ``x_scale`` with one element | ``x_scale`` [rows, 1] |
| weight [N, K] ('nt') | ``w_scale`` with one element | ``w_scale`` [1, N] or [N, 1] (one per output feature) |

``ag_gemm`` reads its ``x_scale`` as this rank's *shard* scale: a one-element ``x_scale`` is the scale of this
rank's rows only (each rank casts its own sequence shard with its own amax, so no collective precedes the cast), and
the GEMM applies each source rank's scale to that rank's rows. The gathered input it returns for wgrad is a
:class:`ScaledTensor`: the FP8 rows and their scales, ``[tp]`` (one per source rank) or ``[M, 1]`` (row-wise).

Operand pairs: e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3 (e5m2 for gradients); e5m2 x e5m2 is refused, as cuBLASLt
does. FP8 GEMMs write bfloat16, accumulate in fp32 (split accumulation: promoted every k tile; ``fast_accum=True``:
the tensor cores' own accumulation, less precise), take a bfloat16 bias, and need both operands K-major (the 'nt'
layout; the layers keep a transposed FP8 weight for the backward). K and N must be multiples of 16.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPE = torch.bfloat16
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class ScaledTensor(NamedTuple):
    """FP8 data with its dequantization scale (``data.float() * scale`` is the value; the scale broadcasts over rows,
    or over row blocks as described where it is returned)."""
    data: torch.Tensor
    scale: torch.Tensor


def is_fp8(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype in FP8_DTYPES


def scale_mode(name: str, what: str, scale: torch.Tensor, rows: int, like: torch.Tensor,
               row_shapes: tuple[tuple[int, ...], ...]) -> str:
    """'tensor' or 'row' for one scale tensor, or ValueError naming what is wrong with it."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name}: {what} must be float32, got {scale.dtype}")
    if scale.device != like.device:
        raise ValueError(f"{name}: {what} is on {scale.device}, x on {like.device}; scales must be on x's device")
    if not scale.is_contiguous():
        raise ValueError(f"{name}: {what} must be contiguous, got strides {scale.stride()}")
    if scale.numel() == 1 and scale.dim() <= 2:
        return "tensor"
    if tuple(scale.shape) in row_shapes:
        return "row"
    shapes = " or ".join(str(list(s)) for s in row_shapes)
    raise ValueError(f"{name}: {what} must hold one element (tensor-wise) or have shape {shapes} (row-wise), got "
                     f"{list(scale.shape)} (rows={rows})")


def check_fp8_args(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   x_scale: torch.Tensor | None, w_scale: torch.Tensor | None, weight_layout: str,
                   n: int, scales: bool = True) -> tuple[str, str] | None:
    """The FP8 rules of a call (module docstring): None for 16-bit operands without scales, else the scale modes
    (x's, w's), each 'tensor' or 'row'. Raises ValueError/TypeError before anything runs. ``scales`` False: the
    operands' rules only (a call decided before its scales are seen)."""
    fp8_x, fp8_w = is_fp8(x), is_fp8(weight)
    if not fp8_x and not fp8_w:
        if x_scale is not None or w_scale is not None:
            raise ValueError(f"{name}: x_scale and w_scale apply to FP8 operands only (x is {x.dtype})")
        return None
    if fp8_x != fp8_w:
        raise ValueError(f"{name}: x ({x.dtype}) and weight ({weight.dtype}) must both be FP8 or both 16-bit")
    if x.dtype == torch.float8_e5m2 and weight.dtype == torch.float8_e5m2:
        raise ValueError(f"{name}: e5m2 x e5m2 is not supported (one operand must be float8_e4m3fn)")
    if weight_layout != "nt":
        raise ValueError(f"{name}: FP8 GEMMs need both operands K-major, the 'nt' layout (weight [N, K]); got "
                         f"{weight_layout!r}: pass the transposed FP8 weight")
    k = x.shape[1]
    if k % 16 != 0 or n % 16 != 0:
        raise ValueError(f"{name}: FP8 GEMMs need K and N multiples of 16, got K={k}, N={n}")
    if bias is not None and bias.dtype != OUT_DTYPE:
        raise ValueError(f"{name}: FP8 GEMMs take a {OUT_DTYPE} bias (they write {OUT_DTYPE}), got {bias.dtype}")
    if not scales:
        return None
    if x_scale is None or w_scale is None:
        raise ValueError(f"{name}: FP8 operands need x_scale and w_scale (float32 dequantization scales)")
    rows = x.shape[0]
    x_mode = scale_mode(name, "x_scale", x_scale, rows, x, ((rows, 1),))
    w_mode = scale_mode(name, "w_scale", w_scale, n, x, ((1, n), (n, 1)))
    return x_mode, w_mode


def _cast_kernels(t: torch.Tensor) -> bool:
    """Whether the op library's cast kernels take ``t`` (a CUDA bf16/fp16 matrix with 16-byte aligned rows of a
    multiple of 8 elements); they give the same bits as the torch ops below."""
    if not (t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and t.dim() == 2 and t.shape[1] % 8 == 0
            and (t.stride(1) == 1 or t.shape[1] <= 1) and t.data_ptr() % 16 == 0
            and (t.shape[0] <= 1 or t.stride(0) % 8 == 0)):
        return False
    return _library_runs_on(t.device.index)


@functools.cache
def _library_runs_on(device_index: int) -> bool:
    """Whether the op library's kernels run on this GPU (asked once per device: a cast is on the layers' hot
    path)."""
    from flux_layers import _library
    with torch.cuda.device(device_index):
        return _library.unavailable_reason() is None


@functools.cache
def _two_pass_casts() -> bool:
    """FLUX_LAYERS_FP8_CAST=two_pass: the CUDA casts run the amax and cast kernels instead of the one-pass ones (read
    once; :func:`reload_settings` reads it again)."""
    from flux_layers import _env
    return _env.get("FP8_CAST") == "two_pass"


def reload_settings() -> None:
    """Read FLUX_LAYERS_FP8_CAST again at the next cast (:func:`flux_layers.ops.refresh_settings` calls it)."""
    _two_pass_casts.cache_clear()


def _check_cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{name}: dtype must be one of {FP8_DTYPES}, got {dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name}: t must be 2-D, got shape {tuple(t.shape)}")


def quantize(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = False,
             margin: int = 0) -> ScaledTensor:
    """``t`` cast to FP8 with current scaling: scale = amax * 2^margin / FP8 max over the whole tensor (or per row,
    ``rowwise``; ``margin`` leaves 2^margin of headroom below the format's max, as megatron's ``fp8_margin``),
    data = t * (1 / scale) (the inverse rounded to fp32 once, as the kernels do) saturated to the format's range.
    An all-zero tensor (or row) gets scale 1. On CUDA, one kernel that reads ``t`` once (tensor-wise: what the GPU
    holds on chip once, the rest twice) or, with ``FLUX_LAYERS_FP8_CAST=two_pass``, an amax and a cast kernel; no
    host sync, capturable in CUDA graphs."""
    _check_cast("quantize", t, dtype)
    if _cast_kernels(t):
        data, scale, _ = torch.ops.flux_layers.quantize_fp8(t, dtype, rowwise, 2.0**margin, False, _two_pass_casts())
        return ScaledTensor(data, scale)
    return quantize_torch(t, dtype, rowwise=rowwise, margin=margin)


def quantize_torch(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = False,
                   margin: int = 0) -> ScaledTensor:
    """:func:`quantize` in torch ops on ``t``'s device: the path for inputs the kernels do not take, and the
    reference the kernels' bits are tested against."""
    fmax = FP8_MAX[dtype]
    src = t.float()
    amax = src.abs().amax(dim=1, keepdim=True) if rowwise else src.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax * 2.0**margin / fmax, torch.ones_like(amax))
    data = (src * (1.0 / (scale if rowwise else scale[0]))).clamp_(-fmax, fmax).to(dtype)
    return ScaledTensor(data, scale.contiguous())


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 1] (or [1, 1] for one element) of a scale that is one element, one per row, or one per block of
    rows / len(scale) rows (an all-gather's per-shard scales)."""
    scale = scale.reshape(-1)
    if scale.numel() in (1, rows):
        return scale.reshape(-1, 1)
    if rows % scale.numel() != 0:
        raise ValueError(f"{scale.numel()} scales do not divide {rows} rows into blocks")
    return scale.repeat_interleave(rows // scale.numel()).reshape(rows, 1)


def dequantize(q: ScaledTensor) -> torch.Tensor:
    """fp32 values of a ScaledTensor whose scale is one element, one per row or one per block of rows."""
    return q.data.float() * row_scales(q.scale, q.data.shape[0])


def quantize_with_transpose(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *,
                            margin: int = 0) -> tuple[ScaledTensor, ScaledTensor]:
    """:func:`quantize` (tensor-wise) of ``t`` [M, K] and of its transpose [K, M] with the same scale: the two
    K-major operands a backward needs from one tensor (dgrad reads ``t``, wgrad its transpose). On CUDA one kernel
    takes the amax and writes both (as :func:`quantize`)."""
    _check_cast("quantize_with_transpose", t, dtype)
    if _cast_kernels(t):
        data, scale, data_t = torch.ops.flux_layers.quantize_fp8(t, dtype, False, 2.0**margin, True,
                                                                 _two_pass_casts())
        return ScaledTensor(data, scale), ScaledTensor(data_t, scale)
    q = quantize(t, dtype, margin=margin)
    return q, ScaledTensor(q.data.t().contiguous(), q.scale)


def transpose_blocks_to_common_scale(q: ScaledTensor) -> ScaledTensor:
    """The transpose [K, M] of FP8 rows [M, K] whose scale is one per block of M/len(scale) rows (an all-gather's
    per-shard scales), re-cast to one common scale, the blocks' largest: a wgrad reduces over M, where the GEMM
    cannot apply a scale per block. Blocks with a smaller scale lose the low bits that the rescale shifts out."""
    blocks = q.scale.numel()
    m = q.data.shape[0]
    if m % blocks != 0:
        raise ValueError(f"transpose_blocks_to_common_scale: {m} rows do not split into {blocks} scale blocks")
    data = q.data
    if (data.is_cuda and data.is_contiguous() and data.shape[1] % 8 == 0 and data.data_ptr() % 8 == 0
            and q.scale.is_contiguous() and _library_runs_on(data.device.index)):
        out, common = torch.ops.flux_layers.transpose_fp8_to_common_scale(data, q.scale.reshape(-1))
        return ScaledTensor(out, common)
    common = q.scale.reshape(-1).amax().reshape(1)
    if blocks == 1:
        return ScaledTensor(data.t().contiguous(), common)
    ratio = row_scales(q.scale / common, m)
    fmax = FP8_MAX[data.dtype]
    recast = (data.float() * ratio).clamp_(-fmax, fmax).to(data.dtype)
    return ScaledTensor(recast.t().contiguous(), common)
