"""The layer stack over the model sizes people train: flux's defaults against megatron-core and the ceiling.

    python -m benchmarks.bench_sweep --out benchmarks/results/layer_sweep_h200x2.json

For each shape (hidden / ffn / heads / seq, 4 layers; 2 at hidden 8192) benchmarks/bench_layer.py's variants are
built and timed in interleaved rounds in one process group: ``baseline`` (megatron-core's linears, NCCL +
cuBLAS), ``flux`` (flux's linears with Megatron's default switches: what a user gets), the other flux switches,
and ``baseline_no_comm`` (the ceiling: megatron-core's collectives as local copies). Per shape the JSON holds
``baseline_ms``, ``flux_ms`` (the default), ``ceiling_ms``, ``speedup``, ``ceiling_speedup``, the share of the
ceiling's gain flux takes, every variant's figures and, where nvidia-smi is present, clocks and power.
"""
from __future__ import annotations

import argparse
import copy
import os

import torch

from benchmarks.bench_layer import METHOD, measure, setup_ranks
from benchmarks.harness import spawn_ranks
from flux_layers.devtools.records import environment, write_json

# (model, hidden, ffn, heads, seq, layers): the shapes of the model-size sweep.
SHAPES = (
    ("gpt-1b-like", 2048, 5632, 16, 16384, 4),
    ("llama-7b", 4096, 11008, 32, 4096, 4),
    ("llama3-8b-like", 4096, 14336, 32, 8192, 4),
    ("llama-13b-like", 5120, 13824, 40, 4096, 4),
    ("h8192", 8192, 28672, 64, 8192, 2),
)
DEFAULT_VARIANT = "flux"  # the layers' defaults: Megatron's tp_comm_overlap switches (tp_comm_overlap_rs_dgrad off)


def parse_shapes(text: str) -> list[tuple]:
    """'model:hidden:ffn:heads:seq:layers,...' -> SHAPES-like tuples (empty: SHAPES)."""
    if not text:
        return list(SHAPES)
    shapes = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 6:
            raise ValueError(f"shape {item!r} is not model:hidden:ffn:heads:seq:layers")
        shapes.append((parts[0], *(int(p) for p in parts[1:])))
    return shapes


def sweep_row(model, hidden, ffn, heads, seq, layers, results: dict, summary: dict) -> dict:
    """One shape's row of layer_sweep_*.json from bench_layer.measure's results."""
    base = results["baseline"]["step_ms"]
    flux = results[DEFAULT_VARIANT]["step_ms"]
    ceiling = results["baseline_no_comm"]["step_ms"] if "baseline_no_comm" in results else None
    row = {"model": model, "hidden": hidden, "ffn": ffn, "heads": heads, "seq": seq, "layers": layers,
           "baseline_ms": base, "flux_ms": flux, "ceiling_ms": ceiling, "speedup": base / flux,
           "ceiling_speedup": base / ceiling if ceiling else None}
    gain = (row["ceiling_speedup"] or 1.0) - 1.0
    row["share_of_ceiling_gain"] = (row["speedup"] - 1.0) / gain if gain > 0 else None
    row["variants"] = {name: {"step_ms": r["step_ms"], "speedup": base / r["step_ms"], "gpus": r["gpus"],
                              "paths": r["paths"], "rs_transport": r["rs_transport"]} for name, r in results.items()}
    row["peak_mem_gib"] = summary.get("peak_mem_gib")
    return row


def run(rank, tp, args):
    from megatron.core import parallel_state

    rows = []
    for model, hidden, ffn, heads, seq, layers in parse_shapes(args.shapes):
        shape = copy.copy(args)
        shape.hidden, shape.ffn, shape.heads, shape.seq, shape.layers = hidden, ffn, heads, seq, layers
        if rank == 0:
            print(f"{model}: hidden {hidden}, ffn {ffn}, heads {heads}, seq {seq}, {layers} layers", flush=True)
        setup_ranks(tp)
        results, summary = measure(rank, tp, shape)
        parallel_state.destroy_model_parallel()
        rows.append(sweep_row(model, hidden, ffn, heads, seq, layers, results, summary))
        torch.cuda.empty_cache()
    if rank == 0:
        for r in rows:
            share = "-" if r["share_of_ceiling_gain"] is None else f"{r['share_of_ceiling_gain']:.0%}"
            print(f"{r['model']:16s} flux {r['speedup']:.3f}x  ceiling {r['ceiling_speedup'] or float('nan'):.3f}x  "
                  f"share {share}", flush=True)
        if args.out:
            write_json(args.out, {**environment(tp), "method": METHOD, "default_variant": DEFAULT_VARIANT,
                                  "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                                  "results": rows})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help="model:hidden:ffn:heads:seq:layers,... (default: the five)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20, help="repetitions per variant, over all rounds")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds")
    ap.add_argument("--nprocs", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.ceiling = True
    os.environ.setdefault("FLUX_LAYERS_BACKEND", "auto")
    spawn_ranks(run, args.nprocs or torch.cuda.device_count(), args)


if __name__ == "__main__":
    main()
