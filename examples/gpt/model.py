"""Process-group setup and the megatron-core ``GPTModel`` built from a flux or a baseline layer spec.

``--linear-impl flux`` builds the layers from ``flux_layers.layers.spec.get_gpt_layer_flux_spec`` (flux
ColumnParallelLinear / RowParallelLinear / LayerNormColumnParallelLinear); ``megatron`` from
``get_gpt_layer_baseline_spec`` (megatron-core's own linears with the same SP-capable norm and SDPA attention), both
through ``get_gpt_decoder_block_spec``, which adds the SP-capable final norm. Everything else — embedding, output
layer, optimizer — is the same in both, so a difference between the two runs is the linears'.

NOTE: megatron-core (0.16.1 to 0.19.x) assumes CUDA in its tensor-parallel plumbing: the sequence-parallel
collectives allocate with ``device=torch.cuda.current_device()`` (tensor_parallel/mappings.py, layers.py) and the
RNG tracker reads and writes CUDA generators (tensor_parallel/random.py). :func:`enable_megatron_on_cpu` points
both at the CPU, for the CPU (gloo) run only; the model code is the same on both devices.
"""
from __future__ import annotations

import contextlib
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

LINEAR_IMPLS = ("flux", "megatron")


def init_distributed(device: str, local_rank: int) -> torch.device:
    """Join the default process group (launcher env: RANK, WORLD_SIZE, MASTER_ADDR/PORT) and the TP group."""
    from megatron.core import parallel_state
    world_size = int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo")
        enable_megatron_on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    return dev


class _CpuRNGStatesTracker:
    """megatron's named RNG states (``get_cuda_rng_tracker()``) kept as CPU generator states."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise RuntimeError(f"RNG state {name!r} already exists")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def enable_megatron_on_cpu() -> None:
    """Let megatron-core's TP/SP code run on CPU tensors (see the module docstring)."""
    from megatron.core.tensor_parallel import random as mrandom
    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_everything(seed: int, cuda_graphs: bool = False) -> None:
    """Same seed on every rank for the replicated parts; megatron's tracker gives each TP rank its own stream
    (graph-safe generators where the layers are captured as CUDA graphs: megatron-core requires them)."""
    from megatron.core import tensor_parallel
    torch.manual_seed(seed)
    # NOTE: force_reset only where the tracker's kind changes: on the CPU it would replace the CPU tracker that
    # enable_megatron_on_cpu installed.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs,
                                                    force_reset_rng=cuda_graphs)


def build_model(cfg, linear_impl: str, device: torch.device, tp_comm_overlap: bool = True,
                cuda_graphs: bool = False, fp8: dict | None = None):
    """A GPTModel on ``device`` (bf16 on CUDA, fp32 on CPU), TP over the whole world, SP when tp > 1.

    ``tp_comm_overlap`` is megatron's master overlap switch, which the flux linears read: off, they take the
    sequential path (collective, then GEMM) everywhere. megatron-core's own linears ignore it.
    ``cuda_graphs``: megatron-core's local CUDA graphs, one per transformer layer's forward and backward, recorded
    in the first iteration and captured after it (:func:`examples.gpt.train.train_step` calls
    ``create_cudagraphs``); the flux linears then make their workspaces' CUDA-graph twins
    (flux_layers.runtime.workspace). ``fp8``: megatron's FP8 fields of the config (``fp8``, ``fp8_recipe``,
    ``fp8_wgrad``), which the flux linears run (flux_layers/layers/fp8_recipe.py) and megatron-core's ignore."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from flux_layers.layers import _megatron_compat
    from flux_layers.layers.spec import get_gpt_decoder_block_spec

    tp = parallel_state.get_tensor_model_parallel_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.query_groups,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.init_method_std,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype, **(fp8 or {}),
        use_cpu_initialization=device.type == "cpu",
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        # The column layers' dgrad as the fused GEMM+ReduceScatter (megatron-core's own linears ignore the switch):
        # 0.6-1.0% faster per layer-stack step than the GEMM with an NCCL reduce-scatter under the wgrad GEMM in
        # the last four runs (docs/experiments.md).
        tp_comm_overlap=tp_comm_overlap, tp_comm_overlap_rs_dgrad=tp_comm_overlap,
        cuda_graph_impl="local" if cuda_graphs else "none", **_megatron_compat.whole_layer_cuda_graphs(),
    )
    if linear_impl not in LINEAR_IMPLS:
        raise ValueError(f"linear_impl must be one of {LINEAR_IMPLS}, got {linear_impl!r}")
    # The block spec brings the SP-capable final norm (megatron-core's default final norm refuses SP).
    block = get_gpt_decoder_block_spec(config, baseline=linear_impl == "megatron")
    model = GPTModel(config, block, vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    if config.fp8:
        from flux_layers.layers.fp8_recipe import assign_layer_numbers
        assign_layer_numbers(model)  # for first_last_layers_bf16 (megatron does not pass it to linears)
    return model.to(device)


def linear_paths(model: torch.nn.Module) -> dict:
    """``last_paths`` (which path fprop/dgrad/wgrad took on the last call) of every layer that reports it, keyed by
    module name with the layer index as ``*`` where all layers agree."""
    by_name: dict[str, list] = {}
    for name, module in model.named_modules():
        if getattr(module, "last_paths", None) is not None:
            by_name.setdefault(re.sub(r"\.layers\.\d+\.", ".layers.*.", name), []).append(
                _jsonable(module.last_paths))
    out = {}
    for key, values in by_name.items():
        distinct = [v for i, v in enumerate(values) if v not in values[:i]]
        out[key] = distinct[0] if len(distinct) == 1 else distinct
    return out


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    return str(value)
