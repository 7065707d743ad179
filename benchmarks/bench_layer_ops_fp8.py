"""The 7B layer's six GEMM calls in FP8 against bf16 at TP=1 (no communication), activation and gradient casts
counted, 1 GPU.

    python -m benchmarks.bench_layer_ops_fp8 --out benchmarks/results/layer_ops_7b_fp8_h200.json

The calls of benchmarks/bench_layer_ops.py at TP=1 (hidden 4096, SwiGLU ffn 11008, seq 4096): qkv, fc1, proj, fc2
forward (x cast to e4m3, tensor-wise) and proj, fc2 dgrad (dY cast to e5m2, 'hybrid'; the FP8 GEMM reads the
transposed FP8 weight, cast once per optimizer step and not counted here). Per call: bf16 cuBLAS (torch.matmul), the
cast (flux_layers.ops.fp8.quantize: the op library's one-pass cast kernel; FLUX_LAYERS_FP8_CAST=two_pass for its
amax and cast kernels), the FP8 GEMM of the op library (its default
configuration, split accumulation) and torch._scaled_mm on the same operands; ``fp8`` = cast + flux FP8
GEMM; ``fp8_auto`` = cast + ``ops.gemm`` as dispatched (``auto``: at TP=1 these calls have no communication, so
ops/backend.fp8_gemm_choice takes cuBLASLt unless the op library's kernel measured faster; ``auto_path`` says which
ran). At TP > 1 these calls are the fused AG+GEMM / GEMM+RS, which run the op library's kernel: ``fp8`` is theirs.
Interleaved rounds, CUDA events after a GPU sleep, medians: GPU time. Then ``loop_ms``: the six calls in sequence,
steps issued back to back with no sleep (bf16, fp8, fp8_auto), per step: host cost included where the CPU cannot keep
ahead. ``cast_share`` divides the casts by the op library's FP8 GEMMs, ``cast_share_auto`` by the GEMMs as dispatched.
"""
from __future__ import annotations

import argparse
from statistics import median

import torch

from benchmarks.harness import print_table, time_interleaved, time_loops_interleaved
from flux_layers.devtools.records import environment, write_json

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LOOP_KEYS = ("bf16", "fp8", "fp8_auto")


def layer_calls(hidden: int, ffn: int, seq: int) -> list[dict]:
    """(name, M, K, N, input format) of the six calls; K is the GEMM's reduction, x [M, K], W [N, K] in FP8."""
    return [
        dict(name="qkv_fprop", m=seq, k=hidden, n=3 * hidden, fmt=E4M3),
        dict(name="fc1_fprop", m=seq, k=hidden, n=2 * ffn, fmt=E4M3),
        dict(name="proj_fprop", m=seq, k=hidden, n=hidden, fmt=E4M3),
        dict(name="fc2_fprop", m=seq, k=ffn, n=hidden, fmt=E4M3),
        dict(name="proj_dgrad", m=seq, k=hidden, n=hidden, fmt=E5M2),
        dict(name="fc2_dgrad", m=seq, k=hidden, n=ffn, fmt=E5M2),
    ]


def call_variants(c, sets=2):
    """The variants of one call, keyed as in the JSON (each ``fn(i)``), checked against an fp32 reference of the
    dequantized operands first; and the figures of the check."""
    from flux_layers import ops
    from flux_layers.ops import fp8, fused_gemm
    m, k, n, fmt = c["m"], c["k"], c["n"], c["fmt"]
    gen = torch.Generator(device="cuda").manual_seed(m + 3 * k + 7 * n)
    xs = [torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(sets)]
    ws = [torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).to(torch.bfloat16) for _ in range(sets)]
    wq = [fp8.quantize(w, E4M3) for w in ws]  # once per optimizer step: not timed
    xq = [fp8.quantize(x, fmt) for x in xs]

    def bf16(i):
        return xs[i % sets] @ ws[i % sets].t()

    def cast(i):
        return fp8.quantize(xs[i % sets], fmt)

    def flux_gemm(i):
        q, w = xq[i % sets], wq[i % sets]
        return fused_gemm.gemm(q.data, w.data, x_scale=q.scale, w_scale=w.scale)

    def scaled_mm(i):
        q, w = xq[i % sets], wq[i % sets]
        return torch._scaled_mm(q.data, w.data.t(), q.scale, w.scale, out_dtype=torch.bfloat16)

    def fp8_call(i):
        q, w = cast(i), wq[i % sets]
        return fused_gemm.gemm(q.data, w.data, x_scale=q.scale, w_scale=w.scale)

    def fp8_auto(i):
        q, w = cast(i), wq[i % sets]
        return ops.gemm(q.data, w.data, x_scale=q.scale, w_scale=w.scale)

    auto = ops.decide("gemm", xq[0].data, wq[0].data)
    ref = (xq[0].data.float() * xq[0].scale) @ (wq[0].data.float() * wq[0].scale).t()
    err = ((flux_gemm(0).float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise RuntimeError(f"{c['name']}: flux FP8 GEMM relative error {err}")
    auto_err = ((fp8_auto(0).float() - ref).norm() / ref.norm()).item()
    if not auto_err < 1e-2:
        raise RuntimeError(f"{c['name']}: ops.gemm ({auto.path}) relative error {auto_err}")
    variants = {"bf16": bf16, "cast": cast, "flux_fp8_gemm": flux_gemm, "scaled_mm": scaled_mm, "fp8": fp8_call,
                "fp8_auto": fp8_auto}
    return variants, {"err": err, "auto": auto}


def bench_call(c, variants, checked, reps, rounds):
    m, k, n, fmt = c["m"], c["k"], c["n"], c["fmt"]
    err, auto = checked["err"], checked["auto"]
    samples = time_interleaved(variants, reps=reps, rounds=rounds)
    t = {key: median(v) for key, v in samples.items()}
    flop = 2.0 * m * n * k
    return {"name": c["name"], "m": m, "k": k, "n": n, "format": str(fmt).replace("torch.", ""),
            "bf16_ms": t["bf16"], "cast_ms": t["cast"], "flux_fp8_gemm_ms": t["flux_fp8_gemm"],
            "scaled_mm_ms": t["scaled_mm"], "fp8_ms": t["fp8"], "cast_share": t["cast"] / t["flux_fp8_gemm"],
            "bf16_tflops": flop / t["bf16"] / 1e9, "flux_fp8_tflops": flop / t["flux_fp8_gemm"] / 1e9,
            "speedup": t["bf16"] / t["fp8"], "flux_fp8_rel_error": err, "fp8_auto_ms": t["fp8_auto"],
            "auto_path": auto.path, "auto_reason": auto.reason, "speedup_auto": t["bf16"] / t["fp8_auto"]}


def _dispatched_gemm_ms(rows: list[dict]) -> float:
    """The six FP8 GEMMs' time as dispatched: the kernel ``auto`` picked for each call."""
    return sum(r["scaled_mm_ms"] if r["auto_path"] == "reference" else r["flux_fp8_gemm_ms"] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop-calls", type=int, default=20, help="steps per back-to-back loop")
    ap.add_argument("--loop-rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from flux_layers import _library
    _library.require()
    calls = layer_calls(args.hidden, args.ffn, args.seq)
    made = [call_variants(c) for c in calls]
    rows = [bench_call(c, variants, checked, args.reps, args.rounds) for c, (variants, checked) in zip(calls, made)]
    sums = {key: sum(r[f"{key}_ms"] for r in rows)
            for key in ("bf16", "cast", "flux_fp8_gemm", "scaled_mm", "fp8", "fp8_auto")}
    # The six calls one after another, issued back to back: what a training step sees, host cost included.
    loops = {key: (lambda i, key=key: [variants[key](i) for variants, _ in made]) for key in LOOP_KEYS}
    loop_samples = time_loops_interleaved(loops, calls=args.loop_calls, rounds=args.loop_rounds)
    loop_ms = {key: median(v) for key, v in loop_samples.items()}
    print_table(rows, [("name", "call", ""), ("m", "M", ""), ("k", "K", ""), ("n", "N", ""),
                       ("bf16_ms", "bf16 ms", ".3f"), ("cast_ms", "cast ms", ".3f"),
                       ("flux_fp8_gemm_ms", "fp8 gemm ms", ".3f"), ("scaled_mm_ms", "_scaled_mm ms", ".3f"),
                       ("fp8_ms", "cast+gemm ms", ".3f"), ("speedup", "bf16/fp8", ".2f"),
                       ("fp8_auto_ms", "cast+auto ms", ".3f"), ("auto_path", "auto", "")])
    print(f"six calls: bf16 {sums['bf16']:.3f} ms, fp8 {sums['fp8']:.3f} ms (casts {sums['cast']:.3f} ms = "
          f"{sums['cast'] / sums['flux_fp8_gemm']:.1%} of the FP8 GEMMs), {sums['bf16'] / sums['fp8']:.2f}x; "
          f"as dispatched at TP=1 {sums['fp8_auto']:.3f} ms, {sums['bf16'] / sums['fp8_auto']:.2f}x")
    print(f"the six back to back, per step: bf16 {loop_ms['bf16']:.3f} ms, fp8 {loop_ms['fp8']:.3f} ms "
          f"({loop_ms['bf16'] / loop_ms['fp8']:.2f}x), as dispatched {loop_ms['fp8_auto']:.3f} ms "
          f"({loop_ms['bf16'] / loop_ms['fp8_auto']:.2f}x)")
    if args.out:
        write_json(args.out, {**environment(1), "method": f"CUDA events, {args.rounds} interleaved rounds of "
                              f"{args.reps} reps per variant after warm-up, medians; TP=1, no communication",
                              "sum_ms": sums, "speedup": sums["bf16"] / sums["fp8"],
                              "speedup_auto": sums["bf16"] / sums["fp8_auto"],
                              "cast_share": sums["cast"] / sums["flux_fp8_gemm"],
                              "cast_share_auto": sums["cast"] / _dispatched_gemm_ms(rows),
                              "loop_method": f"the six calls in sequence, {args.loop_calls} steps back to back "
                              f"(CUDA events around the loop, no sleep), per step; median of {args.loop_rounds} "
                              "interleaved rounds",
                              "loop_ms": loop_ms, "loop_speedup": loop_ms["bf16"] / loop_ms["fp8"],
                              "loop_speedup_auto": loop_ms["bf16"] / loop_ms["fp8_auto"], "results": rows})


if __name__ == "__main__":
    main()
