"""A megatron-core transformer layer stack, forward + backward: flux spec vs baseline spec, one run.

    python -m benchmarks.bench_layer --out benchmarks/results/layer_h200x2.json

Both stacks are built from flux_layers.layers.spec.get_gpt_decoder_block_spec (the baseline with megatron-core's
own ColumnParallelLinear/RowParallelLinear), with the same sequence-parallel RMSNorm and SDPA attention, so
they differ only in the linear layers. TP over all visible GPUs with sequence parallelism, bf16, SwiGLU, no
biases. One step = forward of the block on a random [seq/tp, batch, hidden] input + backward of a random
gradient; every variant is built at once and timed in interleaved rounds; the figure is the median step time
over all repetitions (each the max over ranks). Each variant's settings (FLUX_LAYERS_RS_TRANSPORT) are applied
before its warm-up step, so the library decides its calls there and the timed steps only run them. Each variant's
record says what ran as the library reports it: every flux linear's path per GEMM and, for the fused ones, the
transport, all-gather direction and order and kernel configuration resolved for that call (``ran``;
``rs_transport``: the reduce-scatter transports among them).

`baseline_no_comm` is the baseline stack with megatron-core's all-gathers and reduce-scatters replaced by local
copies (flux_layers/devtools/no_comm.py): wrong numbers, no communication, the same computation.
baseline / baseline_no_comm is the most that hiding the linears' communication can gain with GEMMs at cuBLAS speed
(`ceiling_speedup`). Where nvidia-smi is present, rank 0 samples every GPU's SM clock and power during the run and
each variant gets their means over its repetitions (`gpus`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
from statistics import median

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import env_override, spawn_ranks, time_interleaved
from flux_layers.devtools.gpu_monitor import GpuSampler
from flux_layers.devtools.no_comm import megatron_collectives_as_local_copies
from flux_layers.devtools.records import environment, write_json


def build_block(args, baseline: bool, rs_dgrad: bool = False):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from flux_layers.layers import _megatron_compat
    from flux_layers.layers.spec import get_gpt_decoder_block_spec

    tp = dist.get_world_size()
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads, tensor_model_parallel_size=tp, sequence_parallel=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tp_comm_overlap=True, tp_comm_overlap_rs_dgrad=rs_dgrad,
        **_megatron_compat.whole_layer_cuda_graphs(),
    )
    spec = get_gpt_decoder_block_spec(config, baseline=baseline)
    return TransformerBlock(config, spec).cuda()


def linear_paths(block) -> dict:
    paths = {}
    for name, module in block.named_modules():
        lp = getattr(module, "last_paths", None)
        if lp is not None:
            paths[name] = {k: (v.path if hasattr(v, "path") else v) for k, v in dict(lp).items()}
    return paths


def what_ran(block, tp: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per flux linear of ``block`` and GEMM ('fprop', 'dgrad', 'wgrad'): the path of its last call as the layer
    reports it (``last_paths``) and, for a fused GEMM, what the library resolves for that call (its per-rank key,
    ``last_gemms``) under the settings in force: the transport, the all-gather's direction and order, the kernel
    configuration. Call it under the variant's settings, after a step."""
    from flux_layers import _env
    from flux_layers.ops import backend
    from flux_layers.runtime import topology, tuning
    ran = {}
    for name, module in block.named_modules():
        paths = getattr(module, "last_paths", None)
        if paths is None:
            continue
        gemms = getattr(module, "last_gemms", {})
        ran[name] = {}
        for gemm, choice in paths.items():
            row = {"path": choice.path, "reason": choice.reason}
            decided = gemms.get(gemm)
            if choice.path == "fused" and decided is not None:
                op, mkn = decided
                row.update(op=op, mkn=list(mkn), config=tuning.kernel_name(
                    tuning.resolve_kernel(op, dtype=dtype, tp=tp, mkn=mkn)))
                if op == "gemm_rs":
                    row["transport"] = (backend.rs_host_transport(module.tp_group)
                                        or tuning.rs_transport(dtype=dtype, tp=tp, mkn=mkn))
                else:
                    row["transport"] = backend.ag_transport(module.tp_group)
                    if row["transport"] == "copy_engine":
                        row.update(ag_mode=_env.get("AG_MODE"),
                                   ag_order=topology.ag_order(backend._group_devices(tp)))
            ran[name][gemm] = row
    return ran


def rs_transports(ran: dict) -> list[str] | None:
    """The reduce-scatter transports the fused GEMM+ReduceScatter calls of :func:`what_ran` took (None: none ran)."""
    seen = sorted({row["transport"] for gemms in ran.values() for row in gemms.values()
                   if row.get("op") == "gemm_rs" and "transport" in row})
    return seen or None


# name -> (baseline spec, tp_comm_overlap_rs_dgrad, FLUX_LAYERS_RS_TRANSPORT or None for the library default).
# flux: column dgrad GEMM with its NCCL reduce-scatter under the wgrad GEMM (tp_comm_overlap_rs_dgrad=False,
# Megatron's default); flux_rs_dgrad: column dgrad as the fused GEMM+ReduceScatter; the _ce ones name the
# copy-engine transport.
VARIANTS = {"baseline": (True, False, None), "flux": (False, False, None), "flux_rs_dgrad": (False, True, None),
            "flux_ce": (False, False, "copy_engine"), "flux_rs_dgrad_ce": (False, True, "copy_engine")}
CEILING = ("baseline_no_comm", (True, False, None))


def variant_steps(blocks: dict, variants: dict, inp: torch.Tensor, dy: torch.Tensor) -> tuple[dict, dict]:
    """(step per variant: forward of its block on ``inp`` + backward of ``dy``; settings per variant: a context
    manager factory applying its FLUX_LAYERS_RS_TRANSPORT, and for baseline_no_comm megatron's collectives as local
    copies). The settings are entered around a variant's warm-up and timed steps together
    (harness.time_interleaved), so each call is decided in the warm-up and the timed steps only run."""
    def step_of(block):
        def step(i):
            inp.grad = None
            out = block(inp, attention_mask=None)
            out.backward(dy)
        return step

    def settings_of(name):
        no_comm = megatron_collectives_as_local_copies if name == CEILING[0] else contextlib.nullcontext

        @contextlib.contextmanager
        def applied():
            with env_override(RS_TRANSPORT=variants[name][2]), no_comm():
                yield
        return applied
    return {name: step_of(blocks[name]) for name in variants}, {name: settings_of(name) for name in variants}


def setup_ranks(tp):
    """Megatron's model-parallel state for TP over every rank, with its seeded RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)


def step_tensors(rank, tp, args) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's random input and output gradient of one step, [seq/tp, batch, hidden] bf16."""
    rows = args.seq // tp
    gen = torch.Generator(device="cuda").manual_seed(99 + rank)
    x = torch.randn(rows, args.batch, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    dy = torch.randn(rows, args.batch, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    return x, dy


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The stack's shape and the launch (shared with benchmarks/profile_layer.py)."""
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--ffn", type=int, default=28672)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nprocs", type=int, default=0)
    ap.add_argument("--out", default="")


def run(rank, tp, args):
    from megatron.core import parallel_state

    setup_ranks(tp)
    results, summary = measure(rank, tp, args)
    if rank == 0 and args.out:
        write_json(args.out, {**environment(tp), "shape": vars(args), "method": METHOD,
                              "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                              "results": results, **summary})
    parallel_state.destroy_model_parallel()


METHOD = ("CUDA events around fwd+bwd of the block, GPU sleep + NCCL all-reduce before each repetition, each "
          "repetition the max over ranks; all variants built at once and timed in interleaved rounds (rotating "
          "order), each variant's settings applied before its warm-up step, so its calls are decided there and not "
          "in the timed steps; median over all repetitions")


def measure(rank, tp, args) -> tuple[dict, dict]:
    """Every variant of the stack of ``args``' shape timed in interleaved rounds (model-parallel state set up):
    (results per variant, summary: speedups over the baseline, the ceiling, peak memory)."""
    x, dy = step_tensors(rank, tp, args)
    variants = dict(VARIANTS)
    if args.ceiling:
        variants[CEILING[0]] = CEILING[1]

    # Every variant is built once and timed in interleaved rounds (the order rotating each round), so that the
    # machine's drift over the run falls on all variants alike.
    blocks = {name: build_block(args, baseline, rs_dgrad) for name, (baseline, rs_dgrad, _) in variants.items()}
    inp = x.clone().requires_grad_(True)
    names = list(variants)
    steps, settings = variant_steps(blocks, variants, inp, dy)

    def report(rnd, samples):
        if rank == 0:
            print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(f"{n} {median(samples[n]):.2f}" for n in names),
                  flush=True)

    # One step of each first, so that first-call set-up (communicators, workspaces) stays out of the timed rounds'
    # clock and power windows; what each variant ran is read there, under its settings.
    ran = {}
    for name in names:
        with settings[name]():
            steps[name](0)
            ran[name] = what_ran(blocks[name], tp)
    torch.cuda.synchronize()
    windows = []
    sampling = rank == 0 and GpuSampler.available()
    with GpuSampler() if sampling else contextlib.nullcontext() as sampler:
        samples = time_interleaved(steps, reps=max(1, args.reps // args.rounds), rounds=args.rounds, warmup=1,
                                   group=dist.group.WORLD, on_round=report, windows=windows, settings=settings)
    gpus = {g: sampler.summary(windows, g) for g in range(torch.cuda.device_count())} if sampling else None
    tokens = args.seq * args.batch
    results = {}
    for name, (baseline, _, _) in variants.items():
        ms = median(samples[name])
        results[name] = {"step_ms": ms, "tokens_per_s": tokens / ms * 1e3, "samples_ms": samples[name],
                         "paths": linear_paths(blocks[name]) if not baseline else
                         "megatron-core linears (cuBLAS, collectives as local copies)" if name == "baseline_no_comm"
                         else "megatron-core linears (NCCL + cuBLAS)",
                         "ran": None if baseline else ran[name],
                         "rs_transport": None if baseline else rs_transports(ran[name]),
                         "gpus": {g: per[name] for g, per in gpus.items()} if gpus else None}
        if rank == 0:
            clocks = "".join(f", GPU {g} {v['sm_clock_mhz']:.0f} MHz {v['power_w']:.0f} W"
                             for g, v in (results[name]["gpus"] or {}).items() if v["samples"])
            print(f"  {name}: {ms:.2f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s{clocks}", flush=True)
    base = results["baseline"]["step_ms"]
    summary = {f"speedup_{name}": base / results[name]["step_ms"] for name in names
               if name not in ("baseline", "baseline_no_comm")}
    if "baseline_no_comm" in results:
        summary["ceiling_speedup"] = base / results["baseline_no_comm"]["step_ms"]
    summary["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        print("speedup over the baseline: " + ", ".join(f"{n[8:]} {v:.3f}x" for n, v in summary.items()
                                                        if n.startswith("speedup_")), flush=True)
        if "ceiling_speedup" in summary:
            print(f"ceiling (baseline without communication): {summary['ceiling_speedup']:.3f}x", flush=True)
    return results, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--reps", type=int, default=20, help="repetitions per variant, over all rounds")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="leave out baseline_no_comm (the baseline with its collectives as local copies)")
    args = ap.parse_args()
    os.environ.setdefault("FLUX_LAYERS_BACKEND", "auto")
    spawn_ranks(run, args.nprocs or torch.cuda.device_count(), args)


if __name__ == "__main__":
    main()
