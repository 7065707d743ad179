"""Model FLOPs (for TFLOP/s and MFU) and a per-GPU memory estimate, from the run config alone.

FLOPs (multiply-add = 2 FLOPs), per token of one forward pass, with d = h / heads, g = query groups:

| part | FLOPs per token |
|---|---|
| QKV projection | 2 h (h + 2 g d) |
| attention scores and values, causal | 2 s h  (QK^T and PV are 2 * 2 s h each, half of it masked) |
| output projection | 2 h^2 |
| SwiGLU MLP | 6 h f  (fc1: 2 h * 2f, fc2: 2 f h) |
| logits | 2 h V  (once, after the last layer) |

training FLOPs per iteration = 3 x forward (backward = 2 x forward: dgrad + wgrad) x tokens per iteration; no
activation recomputation is done, so none is counted. TFLOP/s per GPU = that / step time / GPUs; MFU = TFLOP/s per
GPU / the GPU's dense peak (H100/H200 SXM: 989 TFLOP/s bf16).

Memory per GPU, tp ranks, sequence parallel, micro-batch b, bf16 weights:
- states, 18 bytes per parameter: bf16 weight 2 + bf16 grad 2 + fp32 master weight 4 + fp32 master grad 4
  + AdamW moments 8. The bf16 grad of a parameter is freed as its fp32 copy is made, so the two grads never both
  exist for all parameters at once (fp32 runs: 16 bytes: weight 4 + grad 4 + moments 8).
- activations kept for backward per layer, in elements of s*b/tp (bf16): norm inputs 2h, norm outputs 2h (the linears
  keep the sequence shard and all-gather again in backward), q/k/v (h + 2 g d), attention output h, fc1 output 2f,
  silu output f, fc2 input f: 6h + 2gd + 4f.
- logits: the output layer's bf16 logits and the cross entropy's fp32 softmax, s*b*V/tp * (2 + 4) bytes, plus one
  fp32 copy in flight: + 4.
- a fixed reserve for the CUDA context, NCCL and communication workspaces and allocator slack: 8 GiB.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import GPTRunConfig

GiB = 1024 ** 3
RESERVE_BYTES = 8 * GiB
# Dense bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0}


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_TFLOPS_BF16.items():
        if key in device_name:
            return value
    return None


def forward_flops_per_token(cfg: GPTRunConfig) -> float:
    h, f, s, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.seq_length, cfg.vocab_size
    kv = cfg.query_groups * (h // cfg.num_attention_heads)
    per_layer = 2 * h * (h + 2 * kv) + 2 * s * h + 2 * h * h + 6 * h * f
    return cfg.num_layers * per_layer + 2 * h * v


def train_flops_per_iter(cfg: GPTRunConfig) -> float:
    return 3.0 * forward_flops_per_token(cfg) * cfg.tokens_per_iter


def parameters(cfg: GPTRunConfig) -> tuple[int, int]:
    """(parameters in the transformer layers, parameters in the embedding + output layer), whole model."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    kv = cfg.query_groups * (h // cfg.num_attention_heads)
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    return cfg.num_layers * per_layer + h, 2 * cfg.vocab_size * h


@dataclass(frozen=True)
class MemoryEstimate:
    states: float        # bytes: weights, grads, master weights, optimizer moments
    activations: float   # bytes kept for backward, all layers
    logits: float        # bytes of logits and cross-entropy buffers
    reserve: float       # bytes: CUDA context, communication buffers, allocator slack

    @property
    def total(self) -> float:
        return self.states + self.activations + self.logits + self.reserve

    def describe(self) -> str:
        return (f"states {self.states / GiB:.1f} GiB + activations {self.activations / GiB:.1f} GiB + logits "
                f"{self.logits / GiB:.1f} GiB + reserve {self.reserve / GiB:.1f} GiB = {self.total / GiB:.1f} GiB")


def estimate_memory_per_gpu(cfg: GPTRunConfig, tp: int, bf16: bool = True) -> MemoryEstimate:
    layer_params, embed_params = parameters(cfg)
    state_bytes = (18 if bf16 else 16) * (layer_params + embed_params) / tp
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    kv = cfg.query_groups * (h // cfg.num_attention_heads)
    tokens = cfg.seq_length * cfg.micro_batch_size / tp
    act_bytes = 2 if bf16 else 4
    activations = cfg.num_layers * tokens * (6 * h + 2 * kv + 4 * f) * act_bytes
    logits = tokens * cfg.vocab_size * (act_bytes + 4 + 4)
    return MemoryEstimate(state_bytes, activations, logits, RESERVE_BYTES if bf16 else 0)
