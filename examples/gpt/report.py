"""``--compare`` output: a table on stdout, ``benchmarks/results/e2e_gpt_<tag>.json`` and a PNG plot beside it.

Step times are the median over the iterations after ``timing_warmup``; tokens/s, TFLOP/s per GPU and MFU are derived
from that median with the FLOP formula of ``sizing``. The speedup is megatron's median step time over flux's.
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
            "that both implementations train and agree.")


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


def format_table(results: dict, speedup: float) -> str:
    rows = [("impl", "step ms (median)", "tokens/s", "TFLOP/s/GPU", "MFU", "first loss", "last loss")]
    for impl, r in results.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        rows.append((impl, f"{r['median_step_ms']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflops_per_gpu']:.1f}",
                     mfu, f"{r['losses'][0]:.4f}", f"{r['losses'][-1]:.4f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    flux, base = results["flux"]["losses"], results["megatron"]["losses"]
    max_diff = max(abs(a - b) for a, b in zip(flux, base))
    lines.append(f"speedup flux vs megatron (median step time): {speedup:.3f}x; "
                 f"max |loss difference| over {len(flux)} iterations: {max_diff:.3g}")
    return "\n".join(lines)


def write_compare(results: dict, cfg: GPTRunConfig, *, model: str, tag: str, results_dir: str, device: str,
                  device_name: str, gpus: int, backend: str, timing_warmup: int,
                  cuda_graphs: bool = False) -> tuple[str, str | None]:
    """Print the table, write the JSON and the plot; returns (json path, png path or None without matplotlib)."""
    on_gpu = device == "cuda"
    speedup = results["megatron"]["median_step_ms"] / results["flux"]["median_step_ms"]
    print(format_table(results, speedup), flush=True)
    if not on_gpu:
        print("NOTE: " + CPU_NOTE, flush=True)
    record = {
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv),
        "git_commit": git_commit(),
        "device": device, "gpu_model": device_name if on_gpu else None, "gpu_count": gpus if on_gpu else 0,
        "processes": gpus, "tensor_parallel": gpus, "sequence_parallel": gpus > 1,
        "backend": backend, "cuda_graphs": cuda_graphs, "model": model, "config": dataclasses.asdict(cfg),
        "timing_warmup_iters": timing_warmup, "speedup": speedup, "results": results,
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
