"""The example's GPT training with megatron-core's linears, then the same with their collectives as local copies
(benchmarks/no_comm.py), in one launch: how much faster a step can get when the linears' communication costs
nothing and their GEMMs run at cuBLAS speed.

    python -m benchmarks.e2e_ceiling --model h8192 --train-iters 30 --out benchmarks/results/e2e_ceiling_h200x2.json

Takes the example's options (examples/pretrain_gpt.py); --linear-impl, --compare, --save and --load are not
allowed. The no-communication run's losses are meaningless (each rank trains on its own shard only). Without
GPUs it runs the tiny model on CPU, which checks the plumbing and measures nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys

import torch
import torch.distributed as dist

from benchmarks.harness import environment, write_json
from benchmarks.no_comm import megatron_collectives_as_local_copies

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _rank_body(local_rank: int, args, cfg, out: str) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    sys.path.insert(0, EXAMPLES)
    from _gpt_model import build_model, init_distributed, seed_everything
    from _gpt_report import summarize
    from _gpt_train import RunOptions, train

    os.environ["FLUX_LAYERS_BACKEND"] = args.backend
    device = init_distributed(args.device, local_rank)
    results = {}
    try:
        for name, context in (("megatron", contextlib.nullcontext), ("megatron_no_comm",
                                                                     megatron_collectives_as_local_copies)):
            if dist.get_rank() == 0:
                print(f"--- {name} ---", flush=True)
            seed_everything(cfg.seed)
            model = build_model(cfg, "megatron", device, args.tp_comm_overlap)
            with context():
                history = train(model, cfg, RunOptions(linear_impl="megatron", log_interval=args.log_interval),
                                device)
            results[name] = summarize(history, cfg, args.timing_warmup, args.tp, None, {})
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            base, free = results["megatron"]["median_step_ms"], results["megatron_no_comm"]["median_step_ms"]
            print(f"megatron {base:.1f} ms/it, without communication {free:.1f} ms/it: ceiling {base / free:.3f}x",
                  flush=True)
            if out:
                write_json(out, {**environment(args.tp),
                                 "command": "python -m benchmarks.e2e_ceiling " + " ".join(sys.argv[1:]),
                                 "model": args.model, "config": dataclasses.asdict(cfg),
                                 "timing_warmup_iters": args.timing_warmup,
                                 "method": "median wall-clock step time after the timing warm-up, each run from the "
                                           "same seed, back to back in one launch",
                                 "results": results, "ceiling_speedup": base / free})
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    sys.path.insert(0, EXAMPLES)
    import pretrain_gpt
    argv = list(sys.argv[1:] if argv is None else argv)
    out = ""
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        del argv[i:i + 2]
    for banned in ("--linear-impl", "--compare", "--save", "--load"):
        if banned in argv:
            raise SystemExit(f"e2e_ceiling: {banned} is not an option here (both runs use megatron-core's linears)")
    pretrain_gpt.set_process_env()
    args, cfg = pretrain_gpt.resolve_args(pretrain_gpt.build_parser(), argv)
    if args.device != "cuda":
        print("e2e_ceiling: CPU run (gloo, reference backend): the step times and the ceiling mean nothing here",
              flush=True)
    import torch.multiprocessing as mp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pretrain_gpt._free_port()), WORLD_SIZE=str(args.tp),
                      LOCAL_WORLD_SIZE=str(args.tp))
    mp.start_processes(_rank_body, args=(args, cfg, out), nprocs=args.tp, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
