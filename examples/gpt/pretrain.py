"""Pretrain a megatron-core GPTModel with tensor + sequence parallelism whose linears come from flux_layers (or,
for comparison, from megatron-core), on a learnable synthetic token stream.

The example's driver: flags, process start-up (spawn or torchrun), the single run and ``--compare``. Run it as
``python examples/pretrain_gpt.py`` (see that file and examples/README.md). ``examples/gpt/ceiling.py`` runs its
own trainings through :func:`spawn`, :func:`run_rank` and :func:`train_fresh`.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from flux_layers.devtools.launch import free_port

from .config import (
    REPO_ROOT,
    GPTRunConfig,
    add_config_flags,
    available_models,
    load_model_config,
    overrides_from_args,
    validate,
    validate_fp8,
)
from .train import checkpoint_path

COMPARE_ORDER = ("megatron", "flux")
# --compare --fp8: (result name, linears, FP8 format or None, FLUX_LAYERS_BACKEND or None for --backend's)
FP8_COMPARE_RUNS = (("megatron", "megatron", False, None), ("flux_fp8_reference", "flux", True, "reference"),
                    ("flux_fp8", "flux", True, None))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help=f"model config: one of {available_models()} (configs/models/) or a .yaml path; "
                        f"default gpt-1b on GPUs, tiny on CPU")
    p.add_argument("--linear-impl", choices=("flux", "megatron"), default=None,
                   help="flux: flux_layers' fused linears; megatron: megatron-core's linears (default flux)")
    p.add_argument("--compare", action="store_true",
                   help="train megatron then flux with the same config and seed (with --fp8: three runs, see "
                        "--fp8); print a table and write e2e_gpt_<tag>.json and .png into --results-dir")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto (default): CUDA if a GPU is visible, else CPU")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size = number of processes (default: every GPU of the node; 2 on CPU; "
                        "the launcher's world size under torchrun)")
    p.add_argument("--backend", choices=("auto", "fused", "reference"), default=None,
                   help="FLUX_LAYERS_BACKEND for the flux linears (default auto on GPU, reference on CPU)")
    p.add_argument("--no-tp-comm-overlap", dest="tp_comm_overlap", action="store_false",
                   help="turn megatron's tp_comm_overlap switch off: the flux linears then take the sequential path "
                        "(collective, then GEMM) instead of the fused kernels")
    p.add_argument("--fp8", choices=("e4m3", "hybrid"), default=None,
                   help="FP8 linears through megatron-core's own settings (TransformerConfig.fp8 with "
                        "fp8_recipe='tensorwise': current scaling): e4m3 everywhere, or hybrid (e4m3 forward, e5m2 "
                        "gradients); the flux linears run it, megatron-core's ignore it (a warning says so). With "
                        "--compare: flux FP8, the same recipe on the flux layers' reference path, megatron's bf16 "
                        "linears")
    p.add_argument("--fp8-wgrad", action=argparse.BooleanOptionalAction, default=True,
                   help="with --fp8: weight gradients in FP8 (default), or in 16 bits (--no-fp8-wgrad)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture each transformer layer's forward and backward as CUDA graphs after the first "
                        "iteration (megatron-core's local CUDA graphs; both linears in --compare), so that the "
                        "layers' calls cost no host time; shapes must stay static (CUDA only)")
    p.add_argument("--save", metavar="DIR", help="write checkpoints here")
    p.add_argument("--save-interval", type=int, default=0, metavar="N",
                   help="checkpoint every N iterations (always at the end and at --exit-interval)")
    p.add_argument("--load", metavar="DIR", help="resume from the latest checkpoint in DIR")
    p.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="with --load: resume from the checkpoint of iteration N instead of the latest")
    p.add_argument("--exit-interval", type=int, default=0, metavar="N",
                   help="stop once the iteration is a multiple of N, saving first when --save is given")
    p.add_argument("--log-interval", type=int, default=10, metavar="N",
                   help="progress line every N iterations (default 10)")
    p.add_argument("--metrics-out", metavar="PATH", help="write per-iteration loss, lr, grad norm, step time (JSON)")
    p.add_argument("--results-dir", default=os.path.join(REPO_ROOT, "benchmarks", "results"),
                   help="where --compare writes its JSON and PNG (default benchmarks/results)")
    p.add_argument("--tag", help="--compare output name e2e_gpt_<tag> (default <model>_<device>x<tp>)")
    p.add_argument("--timing-warmup", type=int, default=5, metavar="N",
                   help="iterations left out of the median step time (default 5)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak per GPU for MFU (default from the GPU name: H100/H200 989)")
    add_config_flags(p)
    return p


def resolve_args(parser: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, GPTRunConfig]:
    """Parse, fill the device-dependent defaults and check every combination; errors exit through the parser."""
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if launched():
        world = int(os.environ["WORLD_SIZE"])
        if args.tp is not None and args.tp != world:
            parser.error(f"--tp {args.tp} differs from the launcher's world size {world} (TP spans every process)")
        args.tp = world
    elif args.tp is None:
        args.tp = gpus if args.device == "cuda" else 2
    if args.device == "cuda" and not launched() and args.tp > gpus:
        parser.error(f"--tp {args.tp} needs {args.tp} GPUs, {gpus} visible")
    args.model = args.model or ("gpt-1b" if args.device == "cuda" else "tiny")
    args.backend = args.backend or ("auto" if args.device == "cuda" else "reference")
    if args.backend == "fused" and args.device == "cpu":
        parser.error("--backend fused needs CUDA GPUs; the CPU run uses the reference backend")
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    if args.compare and (args.linear_impl or args.save or args.load):
        parser.error("--compare trains both implementations from scratch: drop --linear-impl, --save and --load")
    args.linear_impl = args.linear_impl or "flux"
    for name in ("save_interval", "exit_interval", "timing_warmup"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.log_interval < 1:
        parser.error("--log-interval must be >= 1")
    if args.save_interval and not args.save:
        parser.error("--save-interval needs --save DIR")
    if args.ckpt_step is not None and not args.load:
        parser.error("--ckpt-step needs --load DIR")
    if args.load:
        try:
            checkpoint_path(args.load, args.ckpt_step)
        except FileNotFoundError as exc:
            parser.error(str(exc))
    try:
        cfg = load_model_config(args.model, overrides_from_args(args))
        validate(cfg, args.tp)
        if args.fp8:
            validate_fp8(cfg, args.tp)
    except ValueError as exc:
        parser.error(str(exc))
    if args.compare and args.timing_warmup >= cfg.train_iters:
        parser.error(f"--timing-warmup {args.timing_warmup} leaves no timed iteration of train_iters "
                     f"{cfg.train_iters}")
    args.tag = args.tag or (f"{os.path.splitext(os.path.basename(args.model))[0]}_{args.device}x{args.tp}"
                            + (f"_fp8_{args.fp8}" if args.fp8 else ""))
    return args, cfg


def describe_run(args, cfg: GPTRunConfig, device: torch.device) -> str:
    from .sizing import GiB, estimate_memory_per_gpu, parameters
    layer_params, embed_params = parameters(cfg)
    where = (f"{args.tp} x {torch.cuda.get_device_name(device)} (nccl), bf16, CUDA_DEVICE_MAX_CONNECTIONS="
             f"{os.environ['CUDA_DEVICE_MAX_CONNECTIONS']}" if device.type == "cuda"
             else f"{args.tp} CPU processes (gloo), fp32")
    lines = [
        f"GPT {args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, SwiGLU ffn {cfg.ffn_hidden_size}, "
        f"{cfg.num_attention_heads} heads ({cfg.query_groups} KV groups), seq {cfg.seq_length}, vocab "
        f"{cfg.vocab_size}: {(layer_params + embed_params) / 1e6:,.1f}M parameters",
        f"TP={args.tp}{' + SP' if args.tp > 1 else ''} on {where}; FLUX_LAYERS_BACKEND={args.backend}; "
        f"linears: {describe_linears(args)}"
        f"{'; layers as CUDA graphs from iteration 2' if args.cuda_graphs else ''}",
        f"{cfg.micro_batch_size} x {cfg.num_microbatches} micro-batches x {cfg.seq_length} = {cfg.tokens_per_iter:,} "
        f"tokens/iteration; {cfg.train_iters} iterations; lr {cfg.lr:g} (warm-up {cfg.lr_warmup_iters}, cosine to "
        f"{cfg.min_lr:g}); clip {cfg.clip_grad:g}",
    ]
    estimate = estimate_memory_per_gpu(cfg, args.tp, bf16=device.type == "cuda")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        lines.append(f"memory estimate per GPU: {estimate.describe()} of {total / GiB:.1f} GiB")
        if estimate.total > total:
            lines.append("WARNING: the estimate exceeds the GPU's memory; lower --num-layers or --micro-batch-size")
    else:
        lines.append("NOTE: CPU run — throughput, TFLOP/s and MFU below mean nothing; it checks that the model "
                     "trains (the loss falls) and that checkpoints resume.")
    return "\n".join(lines)


def describe_linears(args) -> str:
    fp8 = (f"FP8 {args.fp8} (tensorwise, wgrad in {'FP8' if args.fp8_wgrad else '16 bits'})" if args.fp8
           else None)
    if args.compare and fp8:
        return f"megatron bf16, flux {fp8} on the reference path, flux {fp8} (--compare)"
    if args.compare:
        return "megatron then flux (--compare)"
    return args.linear_impl + (f", {fp8}" if fp8 else "")


def fp8_settings(args) -> dict | None:
    """The FP8 fields of the run's TransformerConfig (None without --fp8)."""
    return {"fp8": args.fp8, "fp8_recipe": "tensorwise", "fp8_wgrad": args.fp8_wgrad} if args.fp8 else None


def run_single(args, cfg: GPTRunConfig, device: torch.device) -> None:
    from .model import build_model, seed_everything
    from .train import RunOptions, train
    seed_everything(cfg.seed, args.cuda_graphs)
    model = build_model(cfg, args.linear_impl, device, args.tp_comm_overlap, args.cuda_graphs, fp8_settings(args))
    opts = RunOptions(linear_impl=args.linear_impl, save=args.save, save_interval=args.save_interval, load=args.load,
                      ckpt_step=args.ckpt_step, exit_interval=args.exit_interval, log_interval=args.log_interval,
                      peak_tflops=args.peak_tflops, cuda_graphs=args.cuda_graphs)
    history = train(model, cfg, opts, device)
    if dist.get_rank() != 0:
        return
    if history.peak_memory_bytes:
        print(f"peak memory allocated: {history.peak_memory_bytes / 2 ** 30:.1f} GiB", flush=True)
    if args.metrics_out:
        record = {"model": args.model, "linear_impl": args.linear_impl, "tp": args.tp, "device": args.device,
                  "cuda_graphs": args.cuda_graphs, "fp8": fp8_settings(args),
                  "iterations": history.iterations, "losses": history.losses, "lrs": history.lrs,
                  "grad_norms": history.grad_norms, "step_times_ms": [1e3 * t for t in history.step_times_s]}
        with open(args.metrics_out, "w") as f:
            json.dump(record, f, indent=1)


def device_peak(args, device: torch.device) -> tuple[str, float | None]:
    """The device's name and the peak TFLOP/s per GPU that MFU is taken against (--peak-tflops or the known one)."""
    from .sizing import peak_tflops
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return name, args.peak_tflops or peak_tflops(name)


def train_fresh(args, cfg: GPTRunConfig, impl: str, device: torch.device, peak: float | None,
                fp8: dict | None = None) -> dict:
    """A new model with ``impl``'s linears (``fp8``: the config's FP8 fields), trained from the config's seed; its
    summary (the model is freed)."""
    from .model import build_model, linear_paths, seed_everything
    from .report import summarize
    from .train import RunOptions, train
    seed_everything(cfg.seed, args.cuda_graphs)
    model = build_model(cfg, impl, device, args.tp_comm_overlap, args.cuda_graphs, fp8)
    opts = RunOptions(linear_impl=impl, log_interval=args.log_interval, peak_tflops=peak, cuda_graphs=args.cuda_graphs)
    history = train(model, cfg, opts, device)
    result = summarize(history, cfg, args.timing_warmup, args.tp, peak, linear_paths(model))
    del model
    if args.cuda_graphs:
        # megatron-core keeps "graphs created" process-wide: the next model records and captures its own.
        from megatron.core.transformer.cuda_graphs import delete_cuda_graphs
        delete_cuda_graphs()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


@contextlib.contextmanager
def ops_backend(backend: str):
    """FLUX_LAYERS_BACKEND=``backend`` for the ops' calls inside (decisions taken under another one are dropped)."""
    from flux_layers import ops
    before = os.environ["FLUX_LAYERS_BACKEND"]
    os.environ["FLUX_LAYERS_BACKEND"] = backend
    ops.refresh_settings()
    try:
        yield
    finally:
        os.environ["FLUX_LAYERS_BACKEND"] = before
        ops.refresh_settings()


def run_compare(args, cfg: GPTRunConfig, device: torch.device) -> None:
    from .report import write_compare
    name, peak = device_peak(args, device)
    results = {}
    if args.fp8:
        for result, impl, fp8, backend in FP8_COMPARE_RUNS:
            backend = backend or args.backend
            if dist.get_rank() == 0:
                print(f"--- {result}: {impl} linears, " + (f"FP8 {args.fp8}, backend {backend}" if fp8 else "bf16")
                      + " ---", flush=True)
            with ops_backend(backend):
                results[result] = train_fresh(args, cfg, impl, device, peak, fp8_settings(args) if fp8 else None)
    else:
        for impl in COMPARE_ORDER:
            if dist.get_rank() == 0:
                print(f"--- {impl} linears ---", flush=True)
            results[impl] = train_fresh(args, cfg, impl, device, peak)
    if dist.get_rank() == 0:
        write_compare(results, cfg, model=args.model, tag=args.tag, results_dir=args.results_dir,
                      device=args.device, device_name=name, gpus=args.tp, backend=args.backend,
                      timing_warmup=args.timing_warmup, cuda_graphs=args.cuda_graphs, fp8=fp8_settings(args))


def run_rank(args, cfg: GPTRunConfig, body=None) -> None:
    """Body of every process: join the groups, train (or compare), leave. ``body(args, cfg, device)`` replaces
    the training (examples/gpt/ceiling.py runs its own set of trainings this way)."""
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine|transformer_engine).*")
    os.environ["FLUX_LAYERS_BACKEND"] = args.backend
    from .model import init_distributed
    device = init_distributed(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    try:
        if body is None:
            if dist.get_rank() == 0:
                print(describe_run(args, cfg, device), flush=True)
            body = run_compare if args.compare else run_single
        body(args, cfg, device)
    finally:
        dist.destroy_process_group()


def _spawned_rank(local_rank: int, args, cfg: GPTRunConfig, body) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    run_rank(args, cfg, body)


def spawn(args, cfg: GPTRunConfig, body=None) -> int:
    """Start ``args.tp`` local processes (what torchrun would do) running ``run_rank(args, cfg, body)``; returns
    the exit status."""
    import torch.multiprocessing as mp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.tp),
                      LOCAL_WORLD_SIZE=str(args.tp))
    try:
        mp.start_processes(_spawned_rank, args=(args, cfg, body), nprocs=args.tp, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        print(f"pretrain_gpt.py: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"pretrain_gpt.py: {exc}", file=sys.stderr)
        return 1
    return 0


def set_process_env() -> None:
    """Environment every rank inherits; set before any CUDA context exists."""
    # NOTE: with one hardware queue kernels start in launch order, which megatron-core's sequence-parallel
    # communication/compute ordering relies on. An explicit setting in the environment is kept (for experiments).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # NOTE: NVLink multicast (NVLS) is not used by this project; keep NCCL and symmetric memory off it.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def launched() -> bool:
    """Whether a launcher (torchrun) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv=None) -> int:
    set_process_env()
    args, cfg = resolve_args(build_parser(), argv)
    if launched():
        run_rank(args, cfg)
        return 0
    return spawn(args, cfg)
