"""Launches of the op library's FP8 GEMM (its default configuration for the shape, or another swizzle panel with
``--swizzle``) and of ``torch._scaled_mm`` (cuBLASLt) on the same operands, for a profiler to pick up: ``--launches``
of ours, then as many of cuBLASLt's, e4m3 x e4m3 -> bf16 'nt', one scale mode and accumulation. Both outputs are
checked against an fp32 matmul of the dequantized operands before anything is launched for the profiler.

    ncu --clock-control none --kernel-name regex:'gemm_kernel|nvjet' --launch-skip 2 --launch-count 4 ... \\
        python -m experiments.fp8_gemm_launches --shape 8192x8192x14336 --scale tensor --launches 3
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_gemm_fp8 import operands, rel_error
from benchmarks.harness import parse_shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192x8192x14336", help="MxKxN")
    ap.add_argument("--scale", default="tensor", choices=["tensor", "row"])
    ap.add_argument("--accum", default="split", choices=["split", "fast"])
    ap.add_argument("--launches", type=int, default=3, help="launches of each GEMM")
    ap.add_argument("--swizzle", type=int, default=None,
                    help="our kernel's swizzle panel (tiles along M visited together; default: the tuned one)")
    args = ap.parse_args()
    shapes = parse_shapes(args.shape)
    if args.swizzle is not None and args.swizzle < 1:
        ap.error(f"--swizzle takes a positive panel size, got {args.swizzle}")
    if len(shapes) != 1 or args.launches < 1:
        ap.error(f"one shape and at least one launch, got --shape {args.shape!r} --launches {args.launches}")
    from flux_layers.ops import fused_gemm
    (m, k, n), = shapes
    fast = args.accum == "fast"
    x, w, xs, ws, xd, wd = operands(m, k, n, args.scale, torch.Generator(device="cuda").manual_seed(m + k + n))

    def ours():
        return fused_gemm.gemm(x, w, x_scale=xs, w_scale=ws, fast_accum=fast, swizzle=args.swizzle)

    def cublas():
        return torch._scaled_mm(x, w.t(), xs, ws, out_dtype=torch.bfloat16, use_fast_accum=fast)

    ref = xd @ wd.t()
    errors = {"ours": rel_error(ours(), ref), "cublas": rel_error(cublas(), ref)}
    if not errors["ours"] < 3 * errors["cublas"] + 1e-3:
        raise RuntimeError(f"the op library's FP8 GEMM disagrees on {args.shape}: {errors}")
    torch.cuda.synchronize()
    for _ in range(args.launches):
        ours()
    for _ in range(args.launches):
        cublas()
    torch.cuda.synchronize()
    print(f"{args.shape} {args.scale} {args.accum}: {args.launches} launches each, rel errors {errors}")


if __name__ == "__main__":
    main()
