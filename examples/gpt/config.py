"""Run configuration of the example GPT pretraining: model configs from ``configs/models/<name>.yaml``, command-line
overrides for every field, and the checks that turn a bad combination into an error naming the fields.

A model YAML holds any subset of :class:`GPTRunConfig`'s fields; the ones it leaves out keep the defaults below,
except the model shape (:data:`REQUIRED_FIELDS`), which every YAML must give. Each field is also a flag
(``num_layers`` -> ``--num-layers``) that overrides the YAML.

The model is fixed to the modern GPT recipe: pre-norm RMSNorm, SwiGLU MLP, RoPE, no linear biases, untied input and
output embeddings, no dropout. Sequence parallelism is on whenever tp > 1.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS_DIR = os.path.join(REPO_ROOT, "configs", "models")


def _f(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass
class GPTRunConfig:
    # model shape
    num_layers: int = _f(None, "transformer layers")
    hidden_size: int = _f(None, "model width h")
    ffn_hidden_size: int = _f(None, "SwiGLU inner width (fc1 produces 2x this, fc2 consumes it)")
    num_attention_heads: int = _f(None, "attention heads")
    num_query_groups: int = _f(0, "key/value head groups for grouped-query attention; 0 means one per head (MHA)")
    vocab_size: int = _f(None, "vocabulary size of the synthetic data (the embedding is split over TP ranks)")
    seq_length: int = _f(None, "tokens per sample")
    init_method_std: float = _f(0.02, "standard deviation of the normal weight initialisation")
    # batch
    micro_batch_size: int = _f(1, "samples per forward/backward pass")
    num_microbatches: int = _f(1, "micro-batches accumulated per optimizer step")
    # optimisation
    train_iters: int = _f(100, "optimizer steps")
    lr: float = _f(3.0e-4, "peak learning rate")
    min_lr: float = _f(3.0e-5, "learning rate at the end of the cosine decay")
    lr_warmup_iters: int = _f(10, "linear warm-up steps from 0 to --lr")
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norm weights)")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.95, "AdamW beta2")
    adam_eps: float = _f(1.0e-8, "AdamW epsilon")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this value (0 disables clipping)")
    seed: int = _f(1234, "seed of the initialisation and of the synthetic data")
    # data
    data_jump_prob: float = _f(0.05, "synthetic data: probability that a token jumps to a random one instead of "
                                     "following the hidden cycle (sets the loss floor)")

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def tokens_per_iter(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.seq_length


FIELDS = {f.name: f for f in dataclasses.fields(GPTRunConfig)}
REQUIRED_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size", "seq_length")
# The fields that fix the shape of the weights: a checkpoint only loads into a run that agrees on all of them.
SHAPE_FIELDS = REQUIRED_FIELDS + ("num_query_groups",)


def available_models() -> list[str]:
    return sorted(n[:-len(".yaml")] for n in os.listdir(MODELS_DIR) if n.endswith(".yaml"))


def model_config_path(model: str) -> str:
    """``model`` is a name in configs/models/ or a path to a YAML file."""
    if model.endswith((".yaml", ".yml")) and os.path.isfile(model):
        return model
    path = os.path.join(MODELS_DIR, f"{model}.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"unknown model {model!r}: choose one of {available_models()} or give a path to a .yaml file")
    return path


def load_model_config(model: str, overrides: dict | None = None) -> GPTRunConfig:
    """The config named ``model`` with ``overrides`` (field -> value, None entries ignored) applied."""
    path = model_config_path(model)
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of field: value, got {type(values).__name__}")
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown fields {unknown}; known fields: {sorted(FIELDS)}")
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    missing = [k for k in REQUIRED_FIELDS if values.get(k) is None]
    if missing:
        raise ValueError(f"{path}: fields {missing} must be set (in the YAML or on the command line)")
    for name, value in values.items():
        values[name] = _coerce(name, value, path)
    return GPTRunConfig(**values)


def _coerce(name: str, value, where: str):
    kind = FIELDS[name].type
    try:
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name}={value!r} is not a valid {kind}") from None


def add_config_flags(parser) -> None:
    """One flag per :class:`GPTRunConfig` field; each overrides the model YAML."""
    group = parser.add_argument_group("model and training fields (override the model YAML)")
    for f in dataclasses.fields(GPTRunConfig):
        default = "" if f.default is None else f" (default {f.default})"
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                           type=int if f.type == "int" else float, metavar="N" if f.type == "int" else "X",
                           help=f.metadata["help"] + default)


def overrides_from_args(args) -> dict:
    return {name: getattr(args, name) for name in FIELDS}


def validate(cfg: GPTRunConfig, tp: int) -> None:
    """Raise ValueError naming the fields of the first bad combination (for a run on ``tp`` TP ranks)."""
    positive = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                "micro_batch_size", "num_microbatches", "train_iters")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if tp < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {tp}")
    if cfg.hidden_size % tp:
        raise ValueError(f"hidden_size ({cfg.hidden_size}) must be divisible by the tensor-parallel size ({tp})")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"hidden_size ({cfg.hidden_size}) must be divisible by num_attention_heads "
                         f"({cfg.num_attention_heads})")
    if (cfg.hidden_size // cfg.num_attention_heads) % 2:
        raise ValueError(f"the head size hidden_size / num_attention_heads = "
                         f"{cfg.hidden_size // cfg.num_attention_heads} must be even for rotary embeddings")
    if cfg.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) must be divisible by the tensor-parallel "
                         f"size ({tp})")
    if cfg.num_query_groups < 0 or cfg.num_attention_heads % cfg.query_groups or cfg.query_groups % tp:
        raise ValueError(f"num_query_groups ({cfg.num_query_groups}) must divide num_attention_heads "
                         f"({cfg.num_attention_heads}) and be divisible by the tensor-parallel size ({tp}) "
                         f"(0 means one group per head)")
    if cfg.ffn_hidden_size % tp:
        raise ValueError(f"ffn_hidden_size ({cfg.ffn_hidden_size}) must be divisible by the tensor-parallel size "
                         f"({tp})")
    if cfg.vocab_size % tp:
        raise ValueError(f"vocab_size ({cfg.vocab_size}) must be divisible by the tensor-parallel size ({tp})")
    if tp > 1 and cfg.seq_length % tp:
        raise ValueError(f"seq_length ({cfg.seq_length}) must be divisible by the tensor-parallel size ({tp}) under "
                         f"sequence parallelism")
    if not 0 < cfg.lr or not 0 <= cfg.min_lr <= cfg.lr:
        raise ValueError(f"need 0 < lr and 0 <= min_lr <= lr; got lr={cfg.lr}, min_lr={cfg.min_lr}")
    if not 0 <= cfg.lr_warmup_iters < cfg.train_iters:
        raise ValueError(f"lr_warmup_iters ({cfg.lr_warmup_iters}) must be in [0, train_iters={cfg.train_iters})")
    if cfg.clip_grad < 0 or cfg.weight_decay < 0:
        raise ValueError(f"clip_grad ({cfg.clip_grad}) and weight_decay ({cfg.weight_decay}) must be >= 0")
    if not 0 <= cfg.data_jump_prob <= 1:
        raise ValueError(f"data_jump_prob ({cfg.data_jump_prob}) must be in [0, 1]")


FP8_ALIGN = 16  # FP8 GEMMs need K and N multiples of 16 (flux_layers/ops/fp8.py)


def validate_fp8(cfg: GPTRunConfig, tp: int) -> None:
    """Raise ValueError naming the fields whose per-rank features an FP8 GEMM cannot take (``--fp8``): every linear's
    input and output features on one of ``tp`` ranks must be multiples of 16."""
    head = cfg.hidden_size // cfg.num_attention_heads
    per_rank = {
        "hidden_size (qkv and fc1 inputs, proj and fc2 outputs)": cfg.hidden_size,
        "hidden_size / tp (proj input)": cfg.hidden_size // tp,
        "(num_attention_heads + 2 * query groups) * head size / tp (qkv output)":
            (cfg.num_attention_heads + 2 * cfg.query_groups) * head // tp,
        "2 * ffn_hidden_size / tp (fc1 output)": 2 * cfg.ffn_hidden_size // tp,
        "ffn_hidden_size / tp (fc2 input)": cfg.ffn_hidden_size // tp,
    }
    bad = {name: value for name, value in per_rank.items() if value % FP8_ALIGN}
    if bad:
        raise ValueError(f"--fp8 needs every linear's features per rank to be multiples of {FP8_ALIGN} (FP8 GEMMs); "
                         f"at tensor-parallel size {tp}: " + ", ".join(f"{k} = {v}" for k, v in bad.items()))
