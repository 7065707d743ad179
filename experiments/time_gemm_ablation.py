"""Timing only: cuBLAS and the op library's default GEMM ('nt', bf16) in interleaved rounds; no correctness check.

    FLUX_LAYERS_OPS_LIB=<instrumented build> python -m experiments.time_gemm_ablation 16384x2048x4096,... OUT.json

For ablations: an instrumented op library (e.g. one whose epilogue is switched off) computes wrong results on
purpose, which bench_gemm would reject. Run it with the packaged library before and after, in one session, and
compare flux/cuBLAS ratios (cuBLAS anchors the machine's drift). Shapes are MxKxN.
"""
from __future__ import annotations

import os
import sys
from statistics import median

import torch

from benchmarks.harness import parse_shapes, time_interleaved
from flux_layers.devtools.records import environment, write_json


def main():
    from flux_layers.ops import fused_gemm
    shapes, out = sys.argv[1], sys.argv[2]
    rows = []
    for m, k, n in parse_shapes(shapes):
        gen = torch.Generator(device="cuda").manual_seed(m + k + n)
        xs = [torch.randn(m, k, generator=gen, device="cuda").bfloat16() for _ in range(2)]
        ws = [torch.randn(n, k, generator=gen, device="cuda").bfloat16() for _ in range(2)]
        variants = {"cublas": lambda i: xs[i % 2] @ ws[i % 2].t(),
                    "flux": lambda i: fused_gemm.gemm(xs[i % 2], ws[i % 2])}
        t = {key: median(s) for key, s in time_interleaved(variants, reps=10, rounds=3).items()}
        rows.append({"m": m, "k": k, "n": n, "cublas_ms": t["cublas"], "flux_ms": t["flux"],
                     "flux_over_cublas_time": t["flux"] / t["cublas"]})
        print(f"{m}x{k}x{n}: cublas {t['cublas']:.4f} flux {t['flux']:.4f} ratio {t['flux'] / t['cublas']:.3f}",
              flush=True)
    write_json(out, {**environment(1), "ops_lib": os.environ.get("FLUX_LAYERS_OPS_LIB", "packaged"),
                     "results": rows})


if __name__ == "__main__":
    main()
