"""Plot an end-to-end comparison record (``benchmarks/results/e2e_gpt_<tag>.json``, written by
``examples/pretrain_gpt.py --compare``): loss curves of the implementations (two, or three with ``--fp8``) and their
per-iteration throughput.

Usage: ``python -m flux_layers.devtools.plot benchmarks/results/e2e_gpt_<tag>.json [out.png]``
"""
from __future__ import annotations

import argparse
import json
import os


def plot_compare(record: dict, png_path: str) -> str:
    """Write the two-panel figure of ``record`` to ``png_path``; raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = record["config"]["micro_batch_size"] * record["config"]["num_microbatches"] * \
        record["config"]["seq_length"]
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (impl, r), style in zip(record["results"].items(), ("-", "--", ":")):
        iters = range(1, len(r["losses"]) + 1)
        ax_loss.plot(iters, r["losses"], style, label=impl)
        ax_tput.plot(iters, [tokens / (ms / 1e3) for ms in r["step_times_ms"]], style,
                     label=f"{impl} (median {r['tokens_per_s']:,.0f} tok/s)")
    ax_loss.set(xlabel="iteration", ylabel="training loss (nats)", title="loss")
    ax_tput.set(xlabel="iteration", ylabel="tokens/s", title="throughput")
    ax_tput.axvline(record["timing_warmup_iters"] + 0.5, color="grey", linestyle=":", linewidth=1,
                    label="end of timing warm-up")
    for ax in (ax_loss, ax_tput):
        ax.grid(alpha=0.3)
        ax.legend()
    where = f"{record['gpu_count']} x {record['gpu_model']}" if record["gpu_model"] else "CPU (throughput meaningless)"
    if record.get("fp8"):
        speed = (f"flux FP8 {record['fp8']['fp8']} {record['speedup_over_bf16']:.3f}x vs megatron bf16, "
                 f"{record['speedup_over_fp8_reference']:.3f}x vs the FP8 reference path")
    else:
        speed = f"flux {record['speedup']:.3f}x vs megatron"
    fig.suptitle(f"GPT {record['model']}, TP={record['tensor_parallel']}, {where}: {speed}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", help="JSON written by examples/pretrain_gpt.py --compare")
    parser.add_argument("png", nargs="?", help="output PNG (default: the JSON's path with .png)")
    args = parser.parse_args()
    with open(args.record) as f:
        record = json.load(f)
    print(plot_compare(record, args.png or os.path.splitext(args.record)[0] + ".png"))


if __name__ == "__main__":
    main()
