"""Stock CUTLASS 3 sm90 kernel schedules beside cuBLAS and the flux_layers GEMM, same process, same inputs.

    bash benchmarks/cutlass_stock/build.sh            # C-ABI library of the stock kernels (needs nvcc, nvidia-cutlass)
    python -m benchmarks.bench_cutlass_stock --out benchmarks/results/gemm_stock_cutlass_h200.json

Shapes are MxKxN, layout nt (x @ W^T), bf16. The stock kernels (benchmarks/cutlass_stock/stock_gemm.cu) are
CUTLASS's own GemmUniversal kernels: cooperative with the TMA epilogue, ping-pong, stream-K. Variants are timed
in interleaved rounds (drift hits them alike); each figure is the median over all rounds.
"""
from __future__ import annotations

import argparse
import ctypes
import os
from statistics import median

import torch

from benchmarks.harness import parse_shapes, print_table, time_interleaved
from flux_layers.devtools.records import environment, write_json

DEFAULT_SHAPES = "8192x8192x8192,4096x8192x4096,8192x8192x14336,8192x28672x8192"
DEFAULT_LIB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "cutlass_stock",
                           "libstock_gemm.so")


class StockKernels:
    def __init__(self, path: str):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: build it with bash benchmarks/cutlass_stock/build.sh")
        self.lib = ctypes.CDLL(path)
        self.lib.stock_name.restype = ctypes.c_char_p
        self.lib.stock_run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
        self.names = [self.lib.stock_name(i).decode() for i in range(self.lib.stock_count())]
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def run(self, index: int, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, swizzle: int) -> None:
        needed = ctypes.c_size_t(0)
        rc = self.lib.stock_run(index, x.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0], w.shape[0],
                                x.shape[1], swizzle, self.workspace.data_ptr(), self.workspace.numel(),
                                ctypes.byref(needed), torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"stock kernel {self.names[index]} failed with code {rc} (workspace needed "
                               f"{needed.value} bytes)")


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
    samples = time_interleaved(variants, reps=reps, rounds=rounds)
    flop = 2.0 * m * n * k
    for name, s in samples.items():
        row[f"{name}_ms"] = median(s)
        row[f"{name}_tflops"] = flop / median(s) / 1e9
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
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--lib", default=DEFAULT_LIB, help="the stock-kernel library built by cutlass_stock/build.sh")
    ap.add_argument("--swizzles", default="1,8", help="CUTLASS max_swizzle_size values to time")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="", help="JSON path (default: print only)")
    args = ap.parse_args()
    from flux_layers import _library
    _library.require()
    stock = StockKernels(args.lib)
    swizzles = [int(s) for s in args.swizzles.split(",")]
    rows = []
    for (m, k, n) in parse_shapes(args.shapes):
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
