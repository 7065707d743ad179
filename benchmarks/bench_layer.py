"""A megatron-core transformer layer stack, forward + backward: flux spec vs baseline spec, one run.

    python -m benchmarks.bench_layer --out benchmarks/results/layer_h200x2.json

Both stacks are built from flux_layers.layers.spec.get_gpt_decoder_block_spec (the baseline with megatron-core's
own ColumnParallelLinear/RowParallelLinear), with the same sequence-parallel RMSNorm and SDPA attention, so
they differ only in the linear layers. TP over all visible GPUs with sequence parallelism, bf16, SwiGLU, no
biases. One step = forward of the block on a random [seq/tp, batch, hidden] input + backward of a random
gradient; the figure is the median step time over the repetitions, max over ranks.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import environment, spawn_ranks, time_ms, write_json


def build_block(args, baseline: bool, rs_dgrad: bool = False):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

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
        cuda_graph_scope=[],
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


def run(rank, tp, args):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    rows = args.seq // tp
    gen = torch.Generator(device="cuda").manual_seed(99 + rank)
    x = torch.randn(rows, args.batch, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    dy = torch.randn(rows, args.batch, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    results = {}
    # flux: column dgrad GEMM with its NCCL reduce-scatter under the wgrad GEMM (tp_comm_overlap_rs_dgrad=False,
    # Megatron's default); flux_rs_dgrad: column dgrad as the fused GEMM+ReduceScatter. The GEMM+ReduceScatter
    # transport is the library default (FLUX_LAYERS_RS_TRANSPORT) unless the variant names one (the _ce ones).
    default_transport = os.environ.get("FLUX_LAYERS_RS_TRANSPORT")
    variants = (("baseline", True, False, None), ("flux", False, False, None),
                ("flux_rs_dgrad", False, True, None), ("flux_ce", False, False, "copy_engine"),
                ("flux_rs_dgrad_ce", False, True, "copy_engine"), ("baseline_again", True, False, None))
    for name, baseline, rs_dgrad, transport in variants:
        if transport is not None:
            os.environ["FLUX_LAYERS_RS_TRANSPORT"] = transport
        elif default_transport is None:
            os.environ.pop("FLUX_LAYERS_RS_TRANSPORT", None)
        else:
            os.environ["FLUX_LAYERS_RS_TRANSPORT"] = default_transport
        block = build_block(args, baseline, rs_dgrad)
        inp = x.clone().requires_grad_(True)

        def step(i):
            out = block(inp, attention_mask=None)
            out.backward(dy)

        ms = time_ms(step, reps=args.reps, warmup=3, group=dist.group.WORLD)
        tokens = args.seq * args.batch
        results[name] = {"step_ms": ms, "tokens_per_s": tokens / ms * 1e3,
                         "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                         "paths": linear_paths(block) if not baseline else "megatron-core linears (NCCL + cuBLAS)",
                         "rs_transport": None if baseline else os.environ.get("FLUX_LAYERS_RS_TRANSPORT", "direct")}
        if rank == 0:
            print(f"  {name}: {ms:.2f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s", flush=True)
        block = None  # free the parameters before the next variant is built
        torch.cuda.empty_cache()
    base = min(results["baseline"]["step_ms"], results["baseline_again"]["step_ms"])
    summary = {"speedup_vs_best_baseline": base / results["flux"]["step_ms"],
               "speedup_rs_dgrad_vs_best_baseline": base / results["flux_rs_dgrad"]["step_ms"],
               "speedup_ce_vs_best_baseline": base / results["flux_ce"]["step_ms"],
               "speedup_rs_dgrad_ce_vs_best_baseline": base / results["flux_rs_dgrad_ce"]["step_ms"],
               "baseline_drift": results["baseline_again"]["step_ms"] / results["baseline"]["step_ms"]}
    if rank == 0:
        print(f"flux / baseline speedup: {summary['speedup_vs_best_baseline']:.3f}x, with fused column dgrad "
              f"{summary['speedup_rs_dgrad_vs_best_baseline']:.3f}x; copy-engine reduce-scatter transport "
              f"{summary['speedup_ce_vs_best_baseline']:.3f}x / {summary['speedup_rs_dgrad_ce_vs_best_baseline']:.3f}x "
              f"(baseline drift between its two runs {summary['baseline_drift']:.3f})", flush=True)
        if args.out:
            write_json(args.out, {**environment(tp), "shape": vars(args), "method":
                                  "CUDA events around fwd+bwd of the block, GPU sleep + NCCL all-reduce before each "
                                  "repetition, median, max over ranks; baseline timed before and after flux",
                                  "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                                  "results": results, **summary})
    parallel_state.destroy_model_parallel()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--ffn", type=int, default=28672)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--nprocs", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("FLUX_LAYERS_BACKEND", "auto")
    spawn_ranks(run, args.nprocs or torch.cuda.device_count(), args)


if __name__ == "__main__":
    main()
