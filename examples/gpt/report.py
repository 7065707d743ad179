"""``--compare`` output: a table on stdout, ``benchmarks/results/e2e_gpt_<tag>.json`` and a PNG plot beside it.

Step times are the median over the iterations after ``timing_warmup``; tokens/s, TFLOP/s per GPU and MFU are derived
from that median with the FLOP formula of ``sizing``. The speedup is megatron's median step time over flux's.

With ``--fp8`` the record holds three runs: ``flux_fp8`` (the FP8 linears on ``--backend``, fused where built),
``flux_fp8_reference`` (the same recipe on the flux layers' reference path: FP8 data through plain collectives,
then ``torch._scaled_mm``) and ``megatron`` (megatron-core's bf16 linears), with ``speedup_over_fp8_reference`` and
``speedup_over_bf16`` (``speedup`` is the latter) and ``final_loss_vs_bf16`` (relative difference of the last
losses).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys

from .config import REPO_ROOT, GPTRunConfig
from .sizing import train_flops_per_iter

CPU_NOTE = ("CPU run (gloo, reference backend): throughput, TFLOP/s and MFU measure nothing here; the run checks "
            "that the implementations train and agree.")


def summarize(history, cfg: GPTRunConfig, timing_warmup: int, gpus: int, peak: float | None,
              paths: dict) -> dict:
    timed = history.step_times_s[timing_warmup:]
    median = statistics.median(timed)
    tflops = train_flops_per_iter(cfg) / median / gpus / 1e12
    return {
        "median_step_ms": 1e3 * median,
        "tokens_per_s": cfg.tokens_per_iter / median,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        "step_times_ms": [1e3 * t for t in history.step_times_s],
        "losses": history.losses,
        "grad_norms": history.grad_norms,
        "peak_memory_gib": history.peak_memory_bytes / 2 ** 30 if history.peak_memory_bytes else None,
        "linear_paths": paths,
    }


def git_commit() -> str:
    """FLUX_LAYERS_COMMIT where a copy of the tree runs without its git history (the GPU machine), else git."""
    if os.environ.get("FLUX_LAYERS_COMMIT"):
        return os.environ["FLUX_LAYERS_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--verify", "--quiet", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def speedups(results: dict, fp8: dict | None) -> dict:
    """The record's speedups: median step times of the baselines over flux's."""
    base = results["megatron"]["median_step_ms"]
    if not fp8:
        return {"speedup": base / results["flux"]["median_step_ms"]}
    fused = results["flux_fp8"]["median_step_ms"]
    return {"speedup": base / fused, "speedup_over_bf16": base / fused,
            "speedup_over_fp8_reference": results["flux_fp8_reference"]["median_step_ms"] / fused}


def final_loss_vs_bf16(results: dict) -> float:
    """(flux FP8's last loss - megatron bf16's) / megatron bf16's."""
    fp8, bf16 = results["flux_fp8"]["losses"][-1], results["megatron"]["losses"][-1]
    return (fp8 - bf16) / bf16


def format_table(results: dict, speedup: float, fp8: dict | None = None, ratios: dict | None = None) -> str:
    rows = [("impl", "step ms (median)", "tokens/s", "TFLOP/s/GPU", "MFU", "first loss", "last loss")]
    for impl, r in results.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        rows.append((impl, f"{r['median_step_ms']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflops_per_gpu']:.1f}",
                     mfu, f"{r['losses'][0]:.4f}", f"{r['losses'][-1]:.4f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    if fp8:
        wgrad = "FP8" if fp8["fp8_wgrad"] else "16-bit"
        lines.append(f"FP8 {fp8['fp8']} ({fp8['fp8_recipe']}, {wgrad} wgrad): flux_fp8 "
                     f"{ratios['speedup_over_fp8_reference']:.3f}x the FP8 reference path, "
                     f"{ratios['speedup_over_bf16']:.3f}x megatron's bf16 linears (median step time); last loss "
                     f"{results['flux_fp8']['losses'][-1]:.4f} vs bf16 {results['megatron']['losses'][-1]:.4f} "
                     f"({100 * final_loss_vs_bf16(results):+.2f}%)")
        return "\n".join(lines)
    flux, base = results["flux"]["losses"], results["megatron"]["losses"]
    max_diff = max(abs(a - b) for a, b in zip(flux, base))
    lines.append(f"speedup flux vs megatron (median step time): {speedup:.3f}x; "
                 f"max |loss difference| over {len(flux)} iterations: {max_diff:.3g}")
    return "\n".join(lines)


def write_compare(results: dict, cfg: GPTRunConfig, *, model: str, tag: str, results_dir: str, device: str,
                  device_name: str, gpus: int, backend: str, timing_warmup: int,
                  cuda_graphs: bool = False, fp8: dict | None = None) -> tuple[str, str | None]:
    """Print the table, write the JSON and the plot; returns (json path, png path or None without matplotlib).
    ``fp8``: the runs' FP8 fields (``--fp8``: the three runs of the module docstring)."""
    on_gpu = device == "cuda"
    ratios = speedups(results, fp8)
    speedup = ratios["speedup"]
    print(format_table(results, speedup, fp8, ratios), flush=True)
    if not on_gpu:
        print("NOTE: " + CPU_NOTE, flush=True)
    record = {
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv),
        "git_commit": git_commit(),
        "device": device, "gpu_model": device_name if on_gpu else None, "gpu_count": gpus if on_gpu else 0,
        "processes": gpus, "tensor_parallel": gpus, "sequence_parallel": gpus > 1,
        "backend": backend, "cuda_graphs": cuda_graphs, "model": model, "config": dataclasses.asdict(cfg),
        "timing_warmup_iters": timing_warmup, **ratios, "fp8": fp8,
        "final_loss_vs_bf16": final_loss_vs_bf16(results) if fp8 else None, "results": results,
        "note": None if on_gpu else CPU_NOTE,
    }
    os.makedirs(results_dir, exist_ok=True)
    json_path = os.path.join(results_dir, f"e2e_gpt_{tag}.json")
    with open(json_path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {json_path}", flush=True)
    from flux_layers.devtools.plot import plot_compare
    try:
        png_path = plot_compare(record, os.path.splitext(json_path)[0] + ".png")
    except ImportError as exc:
        print(f"no plot: {exc} (install matplotlib, then run python -m flux_layers.devtools.plot {json_path})",
              flush=True)
        return json_path, None
    print(f"wrote {png_path}", flush=True)
    return json_path, png_path
