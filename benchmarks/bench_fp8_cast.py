"""The FP8 casts' kernels on the 7B layer's shapes: the one-pass kernels against the two-pass ones (amax, then cast)
in the same run, 1 GPU.

    python -m benchmarks.bench_fp8_cast --out benchmarks/results/fp8_cast_h200.json

Per shape [rows, cols] (4096x4096, 4096x11008 and its transpose 11008x4096 by default) and cast: ``cast``
(ops.fp8.quantize, tensor-wise), ``cast_t`` (quantize_with_transpose: the rows and the transposed copy) and
``rowwise`` (quantize(rowwise=True)); each ``one_pass`` (the default kernels) and ``two_pass`` (the op's two_pass
argument, as FLUX_LAYERS_FP8_CAST=two_pass sets it). The bits of both are checked equal before timing. Interleaved
rounds, CUDA events after a GPU sleep (launch cost not timed), medians; three random input sets rotate so that an
input does not stay in L2 from one repetition to the next. GB/s: the bytes a cast must move (the input read once,
each output written once) over its time.
"""
from __future__ import annotations

import argparse
from statistics import median

import torch

from benchmarks.harness import cuda_kernels_of, parse_shapes, print_table, time_interleaved
from flux_layers.devtools.records import environment, write_json

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CASTS = {"cast": (False, False), "cast_t": (False, True), "rowwise": (True, False)}  # (rowwise, transposed)


def bench_shape(rows, cols, fmt, casts, reps, rounds, sets=3):
    gen = torch.Generator(device="cuda").manual_seed(rows * 3 + cols)
    xs = [torch.randn(rows, cols, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(sets)]
    op = torch.ops.flux_layers.quantize_fp8
    variants, out_bytes, kernels = {}, {}, {}
    for name in casts:
        rowwise, transposed = CASTS[name]
        for path, two_pass in (("one_pass", False), ("two_pass", True)):
            def call(i, rowwise=rowwise, transposed=transposed, two_pass=two_pass):
                return op(xs[i % sets], fmt, rowwise, 1.0, transposed, two_pass)
            variants[f"{name}/{path}"] = call
            kernels[f"{name}/{path}"] = cuda_kernels_of(lambda call=call: call(0))
        one, two = variants[f"{name}/one_pass"](0), variants[f"{name}/two_pass"](0)
        for a, b, what in zip(one, two, ("data", "scale", "transposed")):
            a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == fmt else (a, b)
            if not torch.equal(a, b):
                raise RuntimeError(f"{rows}x{cols} {name}: one-pass and two-pass {what} differ")
        out_bytes[name] = rows * cols * (2 if transposed else 1)
    samples = time_interleaved(variants, reps=reps, rounds=rounds)
    results = []
    for name in casts:
        moved = rows * cols * 2 + out_bytes[name]
        row = {"rows": rows, "cols": cols, "cast": name, "bytes": moved}
        for path in ("one_pass", "two_pass"):
            ms = median(samples[f"{name}/{path}"])
            row[f"{path}_us"] = ms * 1e3
            row[f"{path}_gbps"] = moved / ms / 1e6
            row[f"{path}_kernels"] = kernels[f"{name}/{path}"]
        row["speedup"] = row["two_pass_us"] / row["one_pass_us"]
        results.append(row)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096", help="ROWSxCOLS,... (bf16 inputs)")
    ap.add_argument("--casts", default=",".join(CASTS), help=f"any of {','.join(CASTS)}")
    ap.add_argument("--format", default="e4m3", choices=sorted(FORMATS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (variant order rotated per round)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    casts = args.casts.split(",")
    for c in casts:
        if c not in CASTS:
            raise SystemExit(f"unknown cast {c!r}; choose from {sorted(CASTS)}")
    from flux_layers import _library
    _library.require()
    rows = []
    for r, c in parse_shapes(args.shapes, "ROWSxCOLS"):
        rows += bench_shape(r, c, FORMATS[args.format], casts, args.reps, args.rounds)
    print_table(rows, [("rows", "rows", ""), ("cols", "cols", ""), ("cast", "cast", ""),
                       ("one_pass_us", "1-pass us", ".1f"), ("two_pass_us", "2-pass us", ".1f"),
                       ("one_pass_gbps", "1-pass GB/s", ".0f"), ("two_pass_gbps", "2-pass GB/s", ".0f"),
                       ("speedup", "2-pass/1-pass", ".2f")])
    if args.out:
        write_json(args.out, {**environment(1), "format": args.format,
                              "method": f"CUDA events around one op call, {args.rounds} interleaved rounds of "
                              f"{args.reps} reps per variant after warm-up (order rotated per round), GPU sleep "
                              "before each rep, medians; 3 rotated bf16 input sets; GB/s = (2 bytes read + 1 byte "
                              "written per element and output) / time", "results": rows})


if __name__ == "__main__":
    main()
