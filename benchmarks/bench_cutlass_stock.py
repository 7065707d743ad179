"""Stock CUTLASS 3 sm90 kernel schedules beside cuBLAS and the flux_layers GEMM, same process, same inputs.

    bash benchmarks/cutlass_stock/build.sh     # C-ABI libraries of the stock kernels (needs nvcc, nvidia-cutlass)
    python -m benchmarks.bench_cutlass_stock --out benchmarks/results/gemm_stock_cutlass_h200.json
    python -m benchmarks.bench_cutlass_stock --fp8 --out gemm_stock_cutlass_fp8.json

Shapes are MxKxN, layout nt (x @ W^T), bf16. The stock kernels (benchmarks/cutlass_stock/stock_gemm.cu) are
CUTLASS's own GemmUniversal kernels: cooperative with the TMA epilogue, ping-pong, stream-K. Variants are timed
in interleaved rounds (drift hits them alike); each figure is the median over all rounds.

With --fp8: e4m3 x e4m3 -> bf16 with tensor-wise scales (benchmarks/cutlass_stock/stock_gemm_fp8.cu): cuBLASLt's
_scaled_mm and the flux_layers FP8 GEMM (default configuration), each with split and fast accumulation, beside the
stock FP8 kernels (split: CUTLASS's FP8 mainloop, promoted every 4 MMAs; fast); each is compared with cuBLASLt of
its own accumulation. The stock kernels take the scales' product as a host scalar, the others read device scales.
"""
from __future__ import annotations

import argparse
import ctypes
import os
from statistics import median

import torch

from benchmarks.harness import parse_shapes, positive_ints, print_table, time_interleaved
from flux_layers.devtools.records import environment, write_json

DEFAULT_SHAPES = "8192x8192x8192,4096x8192x4096,8192x8192x14336,8192x28672x8192"
DEFAULT_FP8_SHAPES = "4096x2048x4096,4096x4096x6144,8192x4096x4096,4096x8192x4096,8192x8192x14336"
_BUILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "cutlass_stock")
DEFAULT_LIB = os.path.join(_BUILD, "libstock_gemm.so")
DEFAULT_FP8_LIB = os.path.join(_BUILD, "libstock_gemm_fp8.so")


class StockKernels:
    """The kernels of one stock library built by cutlass_stock/build.sh: bf16 (stock_gemm.cu, ``stock_*``) or, with
    ``fp8``, FP8 (stock_gemm_fp8.cu, ``stock_fp8_*``: an alpha argument, and an accumulation per kernel, which its
    name here ends with)."""

    def __init__(self, path: str, fp8: bool = False):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: build it with bash benchmarks/cutlass_stock/build.sh")
        self.lib, self.fp8 = ctypes.CDLL(path), fp8
        prefix = "stock_fp8" if fp8 else "stock"
        name, self._run = getattr(self.lib, f"{prefix}_name"), getattr(self.lib, f"{prefix}_run")
        name.restype = ctypes.c_char_p
        self._run.argtypes = ([ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_int, ctypes.c_int] + ([ctypes.c_float] if fp8 else [])
                              + [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                 ctypes.c_void_p])
        count = getattr(self.lib, f"{prefix}_count")()
        self.names = [name(i).decode() for i in range(count)]
        self.accums = [None] * count
        if fp8:
            accum = self.lib.stock_fp8_accum
            accum.restype = ctypes.c_char_p
            self.accums = [accum(i).decode() for i in range(count)]
            self.names = [f"{n}_{a}" for n, a in zip(self.names, self.accums)]
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def run(self, index: int, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, swizzle: int,
            alpha: float = 1.0) -> None:
        needed = ctypes.c_size_t(0)
        rc = self._run(index, x.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0], w.shape[0], x.shape[1],
                       *([alpha] if self.fp8 else []), swizzle, self.workspace.data_ptr(), self.workspace.numel(),
                       ctypes.byref(needed), torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"stock kernel {self.names[index]} failed with code {rc} (workspace needed "
                               f"{needed.value} bytes)")


def time_into(row, variants, m, k, n, reps, rounds):
    """Times the variants in interleaved rounds and writes each one's median ``<name>_ms`` and ``<name>_tflops``
    into ``row``; returns the names timed."""
    samples = time_interleaved(variants, reps=reps, rounds=rounds)
    flop = 2.0 * m * n * k
    for name, s in samples.items():
        row[f"{name}_ms"] = median(s)
        row[f"{name}_tflops"] = flop / median(s) / 1e9
    return list(samples)


def bench_shape_fp8(stock, m, k, n, reps, rounds, swizzles, sets=2):
    from benchmarks.bench_gemm_fp8 import operands, rel_error
    from flux_layers.ops import fused_gemm
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    ops_ = [operands(m, k, n, "tensor", gen) for _ in range(sets)]
    alphas = [float(o[2]) * float(o[3]) for o in ops_]  # host scalars for the stock kernels, read before timing
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
    variants, accum_of = {}, {}
    for accum in ("split", "fast"):
        fast = accum == "fast"
        variants[f"cublas_{accum}"] = lambda i, fast=fast: torch._scaled_mm(
            ops_[i % sets][0], ops_[i % sets][1].t(), ops_[i % sets][2], ops_[i % sets][3],
            out_dtype=torch.bfloat16, use_fast_accum=fast)
        variants[f"flux_{accum}"] = lambda i, fast=fast: fused_gemm.gemm(
            ops_[i % sets][0], ops_[i % sets][1], x_scale=ops_[i % sets][2], w_scale=ops_[i % sets][3],
            fast_accum=fast)
        accum_of[f"cublas_{accum}"] = accum_of[f"flux_{accum}"] = accum
    for idx, name in enumerate(stock.names):
        for swz in swizzles:
            def call(i, idx=idx, swz=swz):
                stock.run(idx, ops_[i % sets][0], ops_[i % sets][1], outs[i % sets], swz, alpha=alphas[i % sets])
                return outs[i % sets]
            key = f"cutlass_{name}_swz{swz}"
            variants[key], accum_of[key] = call, stock.accums[idx]

    ref = ops_[0][4] @ ops_[0][5].t()
    row = {"m": m, "k": k, "n": n, "layout": "nt", "dtype": "e4m3xe4m3", "scale": "tensor"}
    for name, fn in variants.items():  # every variant right before anything is timed (NaN-poisoned outputs)
        for o in outs:
            o.fill_(float("nan"))
        err = rel_error(fn(0), ref)
        row[f"{name}_rel_error"] = err
        if not err < 3 * row.get(f"cublas_{accum_of[name]}_rel_error", err) + 1e-3 or err != err:
            raise RuntimeError(f"{name} on {m}x{k}x{n}: relative error {err} against the dequantized fp32 reference")
    for name in time_into(row, variants, m, k, n, reps, rounds):
        row[f"{name}_over_cublas"] = row[f"cublas_{accum_of[name]}_ms"] / row[f"{name}_ms"]
    for accum in ("split", "fast"):
        stock_keys = [key for key in variants if key.startswith("cutlass_") and accum_of[key] == accum]
        best = min(stock_keys, key=lambda key: row[f"{key}_ms"])
        row[f"best_stock_{accum}"] = best
        row[f"best_stock_{accum}_over_cublas"] = row[f"{best}_over_cublas"]
    row["implementation"] = ("torch._scaled_mm (cuBLASLt); flux_layers._C gemm (FP8, default configuration); stock "
                             "CUTLASS GemmUniversal FP8 kernels from benchmarks/cutlass_stock/stock_gemm_fp8.cu")
    return row


def bench_shape(stock, m, k, n, reps, rounds, swizzles, sets=2):
    from flux_layers.ops import fused_gemm
    from flux_layers.runtime import tuning
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    xs = [torch.randn(m, k, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
    ws = [torch.randn(n, k, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
    out = torch.empty(m, n, dtype=dtype, device="cuda")
    ref = (xs[0].float() @ ws[0].float().t())

    variants = {"cublas": lambda i: torch.matmul(xs[i % sets], ws[i % sets].t())}
    default = tuning.resolve_kernel("gemm", dtype=dtype, tp=1, mkn=(m, k, n))
    flux_name = "flux_" + tuning.kernel_name(default)
    variants[flux_name] = lambda i: fused_gemm.gemm(xs[i % sets], ws[i % sets], weight_layout="nt")
    for idx, name in enumerate(stock.names):
        for swz in swizzles:
            def call(i, idx=idx, swz=swz):
                stock.run(idx, xs[i % sets], ws[i % sets], out, swz)
                return out
            variants[f"cutlass_{name}_swz{swz}"] = call

    row = {"m": m, "k": k, "n": n, "layout": "nt", "dtype": "bfloat16"}
    for name, fn in variants.items():  # every variant must be right before anything is timed (NaN-poisoned out)
        out.fill_(float("nan"))
        got = fn(0).float()
        err = ((got - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise RuntimeError(f"{name} on {m}x{k}x{n}: relative error {err} against the fp32 reference")
    time_into(row, variants, m, k, n, reps, rounds)
    best_stock = min((n_ for n_ in variants if n_.startswith("cutlass_")), key=lambda n_: row[f"{n_}_ms"])
    row["flux_kernel"] = flux_name
    row["flux_over_cublas"] = row["cublas_ms"] / row[f"{flux_name}_ms"]
    row["best_stock"] = best_stock
    row["best_stock_over_cublas"] = row["cublas_ms"] / row[f"{best_stock}_ms"]
    row["best_stock_over_flux"] = row[f"{flux_name}_ms"] / row[f"{best_stock}_ms"]
    row["implementation"] = ("torch.matmul (cuBLAS); flux_layers._C gemm (default configuration); stock CUTLASS "
                             "GemmUniversal kernels from benchmarks/cutlass_stock/stock_gemm.cu")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help=f"comma-separated MxKxN (default {DEFAULT_SHAPES}; with --fp8 "
                    f"{DEFAULT_FP8_SHAPES})")
    ap.add_argument("--fp8", action="store_true", help="the FP8 kernels (e4m3 x e4m3 -> bf16, tensor-wise scales)")
    ap.add_argument("--lib", default="", help="the stock-kernel library built by cutlass_stock/build.sh")
    ap.add_argument("--swizzles", type=positive_ints, default="1,8", help="CUTLASS max_swizzle_size values to time")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="", help="JSON path (default: print only)")
    args = ap.parse_args()
    from flux_layers import _library
    _library.require()
    swizzles = args.swizzles
    rows = []
    if args.fp8:
        stock = StockKernels(args.lib or DEFAULT_FP8_LIB, fp8=True)
        for (m, k, n) in parse_shapes(args.shapes or DEFAULT_FP8_SHAPES):
            row = bench_shape_fp8(stock, m, k, n, args.reps, args.rounds, swizzles)
            rows.append(row)
            print(f"  {m}x{k}x{n}: " + "  ".join(f"{key[:-12]} {v:.3f}" for key, v in row.items()
                                               if key.endswith("_over_cublas") and not key.startswith("best")),
                  flush=True)
        print_table(rows, [("m", "M", ""), ("k", "K", ""), ("n", "N", ""),
                           ("cublas_split_tflops", "cuBLASLt split TF/s", ".0f"),
                           ("flux_split_over_cublas", "flux split", ".3f"),
                           ("best_stock_split", "best stock split", ""),
                           ("best_stock_split_over_cublas", "stock split", ".3f"),
                           ("flux_fast_over_cublas", "flux fast", ".3f"),
                           ("best_stock_fast_over_cublas", "stock fast", ".3f")])
        if args.out:
            write_json(args.out, {**environment(1), "method": f"CUDA events, {args.rounds} interleaved rounds of "
                                  f"{args.reps} reps after warm-up, median, 2 rotated random operand sets; each "
                                  "variant over cuBLASLt of its own accumulation; errors against an fp32 matmul of "
                                  "the dequantized operands", "results": rows})
        return
    stock = StockKernels(args.lib or DEFAULT_LIB)
    for (m, k, n) in parse_shapes(args.shapes or DEFAULT_SHAPES):
        row = bench_shape(stock, m, k, n, args.reps, args.rounds, swizzles)
        rows.append(row)
        print(f"  {m}x{k}x{n}: " + "  ".join(f"{key[:-7]} {v:.0f}" for key, v in row.items()
                                           if key.endswith("_tflops")), flush=True)
    print_table(rows, [("m", "M", ""), ("k", "K", ""), ("n", "N", ""),
                       ("cublas_tflops", "cuBLAS TF/s", ".0f"), ("flux_over_cublas", "flux/cuBLAS", ".3f"),
                       ("best_stock", "best stock", ""), ("best_stock_over_cublas", "stock/cuBLAS", ".3f"),
                       ("best_stock_over_flux", "stock/flux", ".3f")])
    if args.out:
        write_json(args.out, {**environment(1), "method": f"CUDA events, {args.rounds} interleaved rounds of "
                              f"{args.reps} reps after warm-up, median, 2 rotated random input sets",
                              "results": rows})


if __name__ == "__main__":
    main()
