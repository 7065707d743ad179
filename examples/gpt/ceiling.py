"""The example's GPT training with megatron-core's linears, with flux's, and with megatron-core's again but their
collectives as local copies (flux_layers/devtools/no_comm.py), back to back in one launch: how much faster a step
can get when the linears' communication costs nothing and their GEMMs run at cuBLAS speed, and how much of that flux
gets.

    python -m examples.gpt.ceiling --model h8192 --train-iters 40 --out benchmarks/results/e2e_ceiling_h200x2.json

Takes the example's options (examples/pretrain_gpt.py); --linear-impl, --compare, --save and --load are not
allowed (each run takes its own). The no-communication run's losses are meaningless (each rank trains on its own
shard only). Without GPUs it runs the tiny model on CPU, which checks the plumbing and measures nothing. Where
nvidia-smi is present, rank 0 samples every GPU's SM clock and power, and each run gets their means over its
iterations (`gpus`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import torch
import torch.distributed as dist

from flux_layers.devtools.gpu_monitor import GpuSampler
from flux_layers.devtools.no_comm import megatron_collectives_as_local_copies
from flux_layers.devtools.records import environment, write_json

from . import pretrain

# (name, --linear-impl, context): in this order, each from the same seed.
RUNS = (("megatron", "megatron", contextlib.nullcontext), ("flux", "flux", contextlib.nullcontext),
        ("megatron_no_comm", "megatron", megatron_collectives_as_local_copies))


def _ceiling_runs(args, cfg, device) -> None:
    """Every rank (pretrain.run_rank's body): the three trainings, then rank 0 reports."""
    _, peak = pretrain.device_peak(args, device)
    results = {}
    windows = []
    sampling = dist.get_rank() == 0 and device.type == "cuda" and GpuSampler.available()
    with contextlib.ExitStack() as stack:
        sampler = stack.enter_context(GpuSampler(interval_ms=200)) if sampling else None
        for name, impl, context in RUNS:
            if dist.get_rank() == 0:
                print(f"--- {name} ---", flush=True)
            began = time.time()
            with context():
                results[name] = pretrain.train_fresh(args, cfg, impl, device, peak)
            windows.append((name, began, time.time()))
    if dist.get_rank() != 0:
        return
    if sampler is not None:
        for g in range(torch.cuda.device_count()):
            for name, clocks in sampler.summary(windows, g).items():
                results[name].setdefault("gpus", {})[g] = clocks
        for name, r in results.items():
            print(f"  {name}: " + ", ".join(f"GPU {g} {v['sm_clock_mhz']:.0f} MHz {v['power_w']:.0f} W"
                                            for g, v in r["gpus"].items() if v["samples"]), flush=True)
    base, free = results["megatron"]["median_step_ms"], results["megatron_no_comm"]["median_step_ms"]
    flux = results["flux"]["median_step_ms"]
    share = (base - flux) / (base - free) if base > free else None
    print(f"megatron {base:.1f} ms/it, flux {flux:.1f} ms/it ({base / flux:.3f}x), megatron without "
          f"communication {free:.1f} ms/it: ceiling {base / free:.3f}x"
          + (f", flux takes {100 * share:.0f}% of it" if share is not None else ""), flush=True)
    if args.ceiling_out:
        write_json(args.ceiling_out, {
            **environment(args.tp), "command": "python -m examples.gpt.ceiling " + " ".join(sys.argv[1:]),
            "model": args.model, "config": dataclasses.asdict(cfg), "timing_warmup_iters": args.timing_warmup,
            "method": "median wall-clock step time after the timing warm-up, each run from the same seed, back to "
                      "back in one launch",
            "results": results, "ceiling_speedup": base / free, "flux_speedup": base / flux,
            "flux_share_of_ceiling": share})


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = ""
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        del argv[i:i + 2]
    for banned in ("--linear-impl", "--compare", "--save", "--load"):
        if banned in argv:
            raise SystemExit(f"e2e_ceiling: {banned} is not an option here (the runs choose their linears)")
    pretrain.set_process_env()
    args, cfg = pretrain.resolve_args(pretrain.build_parser(), argv)
    args.ceiling_out = out
    if args.device != "cuda":
        print("e2e_ceiling: CPU run (gloo, reference backend): the step times and the ceiling mean nothing here",
              flush=True)
    return pretrain.spawn(args, cfg, body=_ceiling_runs)


if __name__ == "__main__":
    sys.exit(main())
