"""Sequence-parallel RMSNorm/LayerNorm and the norm + column-parallel linear of TE's ``LayerNormLinear`` shape.

Under sequence parallelism a norm runs on this rank's sequence shard [s/tp, b, h]; its weight is replicated, so
every rank holds a partial gradient (the sum over its own tokens). The weights carry
``sequence_parallel = config.sequence_parallel``, which is what megatron-core's ``finalize_model_grads``
looks for when it all-reduces those gradients over the tensor-parallel group. (megatron-core's torch fallback
``WrappedTorchNorm`` refuses sequence parallelism; TE's ``TENorm`` needs TE.)

Constructors take megatron's norm-spec arguments ``(config, hidden_size, eps)``. Statistics are computed in
float32 (or the input's dtype if wider) and the output has the input's dtype, as TE's kernels do.
``config.layernorm_zero_centered_gamma`` stores gamma - 1 (initialised to zero).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from flux_layers.config import OverlapConfig
from flux_layers.layers.linear import ColumnParallelLinear

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _check_normalization(where: str, normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{where}: config.normalization={normalization!r} is not supported; expected one of "
                         f"{NORMALIZATIONS}")


def _norm_param(config, hidden_size: int, fill: float) -> torch.nn.Parameter:
    device = "cpu" if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())
    p = torch.nn.Parameter(torch.full((hidden_size,), fill, dtype=config.params_dtype, device=device))
    setattr(p, "sequence_parallel", config.sequence_parallel)
    return p


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * gamma over the last dimension."""
    dtype = _compute_dtype(x)
    gamma = weight.to(dtype) + 1 if zero_centered_gamma else weight.to(dtype)
    return F.rms_norm(x.to(dtype), (x.shape[-1],), gamma, eps).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               zero_centered_gamma: bool = False) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last dimension."""
    dtype = _compute_dtype(x)
    gamma = weight.to(dtype) + 1 if zero_centered_gamma else weight.to(dtype)
    return F.layer_norm(x.to(dtype), (x.shape[-1],), gamma, bias.to(dtype), eps).to(x.dtype)


class _SequenceShardNorm(torch.nn.Module):
    """Common part of the norms: megatron's norm constructor, a ``weight`` [h] tagged for sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = ""):
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma or config.layernorm_zero_centered_gamma
        self.weight = _norm_param(config, hidden_size, 0.0 if self.zero_centered_gamma else 1.0)


class RMSNorm(_SequenceShardNorm):
    """RMSNorm over the hidden dimension that runs on a sequence shard. Parameter: ``weight`` [h]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)


class LayerNorm(_SequenceShardNorm):
    """LayerNorm over the hidden dimension that runs on a sequence shard. Parameters: ``weight``, ``bias`` [h]."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        super().__init__(config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        self.bias = _norm_param(config, hidden_size, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class Norm:
    """Builds :class:`RMSNorm` or :class:`LayerNorm` from ``config.normalization`` (like megatron's ``TENorm``);
    use it in specs wherever a norm class is expected."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        _check_normalization("Norm", config.normalization)
        norm_cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
        return norm_cls(config, hidden_size, eps, **kwargs)


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """Norm, then :class:`ColumnParallelLinear`: the signature of megatron-core's
    ``TELayerNormColumnParallelLinear``, so it can be an attention ``linear_qkv`` or MLP ``linear_fc1`` (with
    ``IdentityOp`` as the separate input norm).

    The norm comes from ``config.normalization`` ('RMSNorm' or 'LayerNorm') with ``config.layernorm_epsilon``.
    Parameters: ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm) [h], named as in TE so that
    checkpoints interchange; ``weight``, ``bias`` as in :class:`ColumnParallelLinear`.

    | pass | this rank |
    |---|---|
    | fprop | x_shard_m [s/tp, b, h] -> norm -> AG + GEMM -> [s, b, N/tp] |
    | dgrad | GEMM + RS -> d(norm out) [s/tp, b, h] -> norm backward -> dx_shard_m |
    | wgrad | dW = dY^T @ AG(norm out); d(gamma), d(beta): partial sums over this rank's tokens |
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable, gather_output: bool,
                 bias: bool, skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: Optional[str] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None, stride: int = 1,
                 overlap: Optional[OverlapConfig] = None, name: Optional[str] = None):
        _check_normalization("LayerNormColumnParallelLinear", config.normalization)
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         gather_output=gather_output, stride=stride, skip_bias_add=skip_bias_add,
                         skip_weight_param_allocation=skip_weight_param_allocation, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, overlap=overlap, name=name)
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.layer_norm_weight = _norm_param(config, input_size, 0.0 if self.zero_centered_gamma else 1.0)
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = _norm_param(config, input_size, 0.0)
        else:
            self.register_parameter("layer_norm_bias", None)

    def norm_for_all_gather(self, x_shard_m: torch.Tensor) -> torch.Tensor:
        """The norm of this rank's sequence shard, which the AG+GEMM then gathers.

        NOTE: a fresh tensor. The push all-gather (the default) copies the shard to the peers straight from it;
        only the pull mode would save a copy if the norm wrote into the workspace (``AgWorkspace.input_buffer``).
        """
        if self.normalization == "RMSNorm":
            return rms_norm(x_shard_m, self.layer_norm_weight, self.eps, self.zero_centered_gamma)
        return layer_norm(x_shard_m, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        """input_ [s(/tp), b, h] -> (output [s, b, N/tp], bias or None)."""
        return super().forward(self.norm_for_all_gather(input_), weight, runtime_gather_output)

    def __repr__(self):
        return (f"{type(self).__name__}({self.normalization}, in_features={self.input_size}, "
                f"out_features={self.output_size}, bias={self.bias is not None}, TP={self.tp_size}, "
                f"SP={self.sequence_parallel})")
