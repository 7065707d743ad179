"""The op library's GEMM against cuBLAS (torch.matmul), same process, same inputs, both weight layouts.

    python -m benchmarks.bench_gemm --shapes 8192x8192x8192,4096x8192x4096 --out benchmarks/results/gemm_h200.json

Shapes are MxKxN. Each row reports cuBLAS and every configuration of ours (tile shape, swizzle panel, with and
without the stream-K tail), TFLOP/s, and ours/cuBLAS for the best configuration and for the default one; the
implementation that ran is named in each row. Variants are timed in interleaved rounds (order rotated per round).
"""
from __future__ import annotations

import argparse
from statistics import median

import torch

from benchmarks.harness import cuda_kernels_of, parse_shapes, print_table, time_interleaved
from flux_layers.devtools.records import environment, write_json
from flux_layers.runtime.schedules import DEFAULT_STREAM_K_FILL, SPLIT_TILE_CONFIGS

DEFAULT_SHAPES = "8192x8192x8192,4096x8192x4096,8192x8192x14336,8192x28672x8192"
TILE_NAMES = {0: "256x128_c2", 1: "128x256_c2"}
SWIZZLES = (8, 16)
# Stream-K tail fill limit (percent of the grid a last wave may keep busy and still be split; 0: whole tiles).
# 'sk' is the default limit; 'sk100' splits every partial last wave (built for 128 x 256 tiles only).
STREAM_K = {"sk": DEFAULT_STREAM_K_FILL, "dp": 0, "sk100": 100}


def _stream_k_modes(tile: int) -> dict[str, int]:
    return {name: fill for name, fill in STREAM_K.items() if fill in (0, DEFAULT_STREAM_K_FILL)
            or tile in SPLIT_TILE_CONFIGS}


def bench_shape(m, k, n, layout, dtype, reps, rounds, sets=2):
    from flux_layers.ops import fused_gemm
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    xs = [torch.randn(m, k, generator=gen, device="cuda").to(dtype) for _ in range(sets)]
    ws = [(torch.randn(n, k, generator=gen, device="cuda") if layout == "nt"
           else torch.randn(k, n, generator=gen, device="cuda")).to(dtype) for _ in range(sets)]

    def cublas(i):
        x, w = xs[i % sets], ws[i % sets]
        return x @ (w.t() if layout == "nt" else w)

    row = {"m": m, "k": k, "n": n, "layout": layout, "dtype": str(dtype).replace("torch.", "")}
    ref = cublas(0).float()
    for tile, name in TILE_NAMES.items():
        for sk_name, sk in _stream_k_modes(tile).items():
            out = fused_gemm.gemm(xs[0], ws[0], weight_layout=layout, tile=tile, stream_k=sk)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not (err < 1e-2):
                raise RuntimeError(f"flux gemm {name} {sk_name} disagrees with cuBLAS on {m}x{k}x{n} {layout}: "
                                   f"rel err {err}")
    flop = 2.0 * m * n * k
    # Every variant is timed in each of `rounds` rounds, the order rotated per round, so drift (clocks, power)
    # hits all of them alike; each figure is the median over all rounds' samples.
    configs = {f"{name}_swz{swizzle}_{sk_name}": (tile, swizzle, fill)  # '128x256_c2_swz16_sk' -> its settings
               for tile, name in TILE_NAMES.items() for swizzle in SWIZZLES
               for sk_name, fill in _stream_k_modes(tile).items()}
    variants = {"cublas": cublas}
    for key, (tile, swizzle, fill) in configs.items():
        variants[key] = (lambda i, tile=tile, swizzle=swizzle, fill=fill: fused_gemm.gemm(
            xs[i % sets], ws[i % sets], weight_layout=layout, tile=tile, swizzle=swizzle, stream_k=fill))
    samples = time_interleaved(variants, reps=reps, rounds=rounds)
    timed = {key: median(samples[key]) for key in configs}
    for key, tv in timed.items():
        row[f"flux_{key}_ms"] = tv
        row[f"flux_{key}_tflops"] = flop / tv / 1e9
    t = median(samples["cublas"])
    row["cublas_ms"], row["cublas_tflops"] = t, flop / t / 1e9
    row["cublas_kernels"] = cuda_kernels_of(lambda: cublas(0))
    best = min(timed, key=timed.get)
    row["flux_best"] = best
    row["flux_best_tflops"] = flop / timed[best] / 1e9
    row["flux_over_cublas"] = row["cublas_ms"] / timed[best]
    from flux_layers.runtime import tuning
    default = tuning.resolve_kernel("gemm", dtype=dtype, tp=1, mkn=(m, k, n))
    d_key = next((key for key, cfg in configs.items()
                  if cfg == (default.tile, default.swizzle, default.stream_k_fill)), None)
    if d_key is not None:
        row["flux_default"] = tuning.kernel_name(default)
        row["flux_default_over_cublas"] = row["cublas_ms"] / timed[d_key]
    row["implementation"] = "flux_layers._C gemm (persistent sm90, CUTLASS collective mainloop) vs torch.matmul"
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--layouts", default="nt,nn")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per variant per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (variant order rotated per round)")
    ap.add_argument("--out", default="", help="JSON path (default: print only)")
    args = ap.parse_args()
    from flux_layers import _library
    _library.require()
    dtype = getattr(torch, args.dtype)
    rows = []
    for (m, k, n) in parse_shapes(args.shapes):
        for layout in args.layouts.split(","):
            rows.append(bench_shape(m, k, n, layout, dtype, args.reps, args.rounds))
            print(f"  {m}x{k}x{n} {layout}: cuBLAS {rows[-1]['cublas_tflops']:.0f}  flux "
                  f"{rows[-1]['flux_best_tflops']:.0f} TFLOP/s ({rows[-1]['flux_best']})", flush=True)
    print_table(rows, [("m", "M", ""), ("k", "K", ""), ("n", "N", ""), ("layout", "layout", ""),
                       ("cublas_tflops", "cuBLAS TF/s", ".0f"), ("flux_best_tflops", "flux TF/s", ".0f"),
                       ("flux_best", "best config", ""), ("flux_over_cublas", "best/cuBLAS", ".3f"),
                       ("flux_default_over_cublas", "default/cuBLAS", ".3f")])
    if args.out:
        write_json(args.out, {**environment(1), "method": f"CUDA events, {args.rounds} interleaved rounds of "
                              f"{args.reps} reps per variant after warm-up (order rotated per round), median of "
                              "all samples, 2 rotated random input sets", "results": rows})


if __name__ == "__main__":
    main()
