"""The op library's FP8 GEMM against torch._scaled_mm (cuBLASLt), same process, same operands (1 GPU).

    python -m benchmarks.bench_gemm_fp8 --out benchmarks/results/gemm_fp8_h200.json

For every shape (MxKxN, e4m3 x e4m3 -> bf16, 'nt'), scale mode (tensor-wise, row-wise) and accumulation (split:
promoted to fp32 every k tile; fast): cuBLASLt and every configuration of ours that has an instance (tile, swizzle,
stream-K tail), TFLOP/s, ours/cuBLASLt for the best configuration and for the default one (what a call without
arguments takes, flux_layers/runtime/tuning.py), and the relative error of both against an fp32 matmul of the
dequantized operands. Variants are timed in interleaved rounds (order rotated per round), CUDA events after a GPU
sleep, medians; two random operand sets rotate.
"""
from __future__ import annotations

import argparse
from statistics import median

import torch

from benchmarks.harness import cuda_kernels_of, parse_shapes, positive_ints, print_table, time_interleaved
from flux_layers.devtools.records import environment, write_json
from flux_layers.runtime.schedules import DEFAULT_STREAM_K_FILL, SPLIT_TILE_CONFIGS

# ../shared/fp8.md's eight shapes, then the 7B layer's per-rank GEMMs at TP=2 (hidden 4096, SwiGLU ffn 11008, seq
# 4096: qkv, fc1, proj forward; fc2's, 4096x5504x4096, is among the eight).
DEFAULT_SHAPES = ("4096x8192x4096,8192x8192x14336,4096x4096x5504,4096x5504x4096,8192x4096x4096,16384x8192x1024,"
                  "8192x28672x8192,8192x8192x28672,4096x4096x6144,4096x4096x11008,4096x2048x4096")
TILE_NAMES = {0: "256x128", 1: "128x256", 2: "128x128"}
# Instances (csrc/kernels/gemm_dispatch.cu): split accumulation holds two accumulator fragments, 128 x 128 only.
# Only SPLIT_TILE_CONFIGS have a stream-K tail: the others are timed whole-tile ('dp') only, where an 'sk' variant
# would time the same kernel again.
TILES = {"split": (2,), "fast": (0, 1, 2)}
SWIZZLES = (8, 16)
STREAM_K = {"dp": 0, "sk": DEFAULT_STREAM_K_FILL}


def operands(m, k, n, mode, gen):
    from flux_layers.ops.fp8 import dequantize, quantize
    x32 = torch.randn(m, k, generator=gen, device="cuda") * torch.rand(m, 1, generator=gen, device="cuda").add(0.1)
    w32 = torch.randn(n, k, generator=gen, device="cuda") * torch.rand(n, 1, generator=gen, device="cuda").add(0.1)
    xq = quantize(x32, rowwise=mode == "row")
    wq = quantize(w32, rowwise=mode == "row")
    w_scale = wq.scale.reshape(1, n) if mode == "row" else wq.scale
    return xq.data, wq.data, xq.scale, w_scale, dequantize(xq), dequantize(wq)


def rel_error(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_case(m, k, n, mode, accum, reps, rounds, sets=2, bound=False, swizzles=SWIZZLES):
    from flux_layers.ops import fused_gemm
    from flux_layers.runtime import tuning
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    ops_ = [operands(m, k, n, mode, gen) for _ in range(sets)]
    fast = accum == "fast"

    def cublas(i):
        x, w, xs, ws = ops_[i % sets][:4]
        return torch._scaled_mm(x, w.t(), xs, ws, out_dtype=torch.bfloat16, use_fast_accum=fast)

    configs = {f"{TILE_NAMES[t]}_swz{s}_{sk}": (t, s, f) for t in TILES[accum] for s in swizzles
               for sk, f in STREAM_K.items() if f == 0 or t in SPLIT_TILE_CONFIGS}

    def flux(cfg):
        tile, swizzle, fill = cfg
        return lambda i: fused_gemm.gemm(*ops_[i % sets][:2], x_scale=ops_[i % sets][2], w_scale=ops_[i % sets][3],
                                         fast_accum=fast, tile=tile, swizzle=swizzle, stream_k=fill)

    x, w, xs, ws, xd, wd = ops_[0]
    ref = xd @ wd.t()
    row = {"m": m, "k": k, "n": n, "scale": mode, "accum": accum, "dtype": "e4m3xe4m3", "layout": "nt",
           "cublas_rel_error": rel_error(cublas(0), ref)}
    errors = {}
    for key, cfg in configs.items():
        errors[key] = rel_error(flux(cfg)(0), ref)
        if not bound and not errors[key] < 3 * row["cublas_rel_error"] + 1e-3:
            raise RuntimeError(f"flux fp8 gemm {key} disagrees on {m}x{k}x{n} {mode} {accum}: rel err {errors[key]}")
    variants = {"cublas": cublas, **{key: flux(cfg) for key, cfg in configs.items()}}
    samples = time_interleaved(variants, reps=reps, rounds=rounds)
    flop = 2.0 * m * n * k
    timed = {key: median(samples[key]) for key in configs}
    t_cublas = median(samples["cublas"])
    row["cublas_ms"], row["cublas_tflops"] = t_cublas, flop / t_cublas / 1e9
    row["cublas_kernels"] = cuda_kernels_of(lambda: cublas(0))
    row["configs"] = {key: {"ms": tv, "tflops": flop / tv / 1e9, "rel_error": errors[key]} for key, tv in timed.items()}
    best = min(timed, key=timed.get)
    row["config"] = best
    row["flux_tflops"] = flop / timed[best] / 1e9
    row["flux_best_over_cublas"] = t_cublas / timed[best]
    default = tuning.resolve_kernel("gemm", dtype=x.dtype, tp=1, mkn=(m, k, n), fast_accum=fast)
    d_fill = default.stream_k_fill if default.tile in SPLIT_TILE_CONFIGS else 0  # what the kernel runs
    d_key = next((key for key, cfg in configs.items() if cfg == (default.tile, default.swizzle, d_fill)), None)
    row["flux_default"] = tuning.kernel_name(default)
    row["flux_default_over_cublas"] = t_cublas / timed[d_key] if d_key is not None else None
    row["flux_default_rel_error"] = errors.get(d_key)
    row["error_over_cublas"] = (errors[d_key] / row["cublas_rel_error"]) if d_key is not None else None
    row["implementation"] = ("flux_layers._C gemm (persistent sm90, CUTLASS FP8 mainloop, scales in the epilogue) "
                             "vs torch._scaled_mm")
    if bound:
        row["implementation"] += ("; BOUND: the op library computes something else (errors recorded, not checked), "
                                  "a time bound, not a kernel")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--scales", default="tensor,row")
    ap.add_argument("--accums", default="split,fast")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per variant per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (variant order rotated per round)")
    ap.add_argument("--out", default="", help="JSON path (default: print only)")
    ap.add_argument("--bound", action="store_true",
                    help="the op library (FLUX_LAYERS_OPS_LIB) is a timing bound that computes something else: record "
                         "its errors without refusing it, and mark every row as a bound")
    ap.add_argument("--swizzles", type=positive_ints, default=",".join(map(str, SWIZZLES)),
                    help="comma-separated swizzle panels (tiles along M visited together) to time for every tile; the "
                         "default/cuBLASLt ratio is reported only when the default configuration's panel is among them")
    args = ap.parse_args()
    from flux_layers import _library
    _library.require()
    record = environment(1)  # once: commit() runs git, and the date is the run's start
    method = (f"CUDA events, {args.rounds} interleaved rounds of {args.reps} reps per variant after warm-up (order "
              "rotated per round), median of all samples, 2 rotated random operand sets; errors against an fp32 "
              "matmul of the dequantized operands")

    def save(rows, complete):
        # Written after every row as well, so that a run cut short by a time limit keeps the rows it finished.
        if args.out:
            write_json(args.out, {**record, "method": method, "complete": complete, "results": rows},
                       announce=complete)

    rows = []
    for (m, k, n) in parse_shapes(args.shapes):
        for mode in args.scales.split(","):
            for accum in args.accums.split(","):
                r = bench_case(m, k, n, mode, accum, args.reps, args.rounds, bound=args.bound, swizzles=args.swizzles)
                rows.append(r)
                print(f"  {m}x{k}x{n} {mode} {accum}: cuBLASLt {r['cublas_tflops']:.0f}  flux {r['flux_tflops']:.0f} "
                      f"TFLOP/s ({r['config']}), default {r['flux_default']} "
                      f"{r['flux_default_over_cublas'] or float('nan'):.3f}x, err {r['flux_default_rel_error']:.2e} "
                      f"vs {r['cublas_rel_error']:.2e}", flush=True)
                save(rows, complete=False)
    print_table(rows, [("m", "M", ""), ("k", "K", ""), ("n", "N", ""), ("scale", "scale", ""), ("accum", "accum", ""),
                       ("cublas_tflops", "cuBLASLt TF/s", ".0f"), ("flux_tflops", "flux TF/s", ".0f"),
                       ("config", "best config", ""), ("flux_best_over_cublas", "best/cuBLASLt", ".3f"),
                       ("flux_default_over_cublas", "default/cuBLASLt", ".3f"),
                       ("error_over_cublas", "err ratio", ".2f")])
    save(rows, complete=True)


if __name__ == "__main__":
    main()
