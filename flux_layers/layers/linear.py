"""Megatron-compatible ``ColumnParallelLinear`` and ``RowParallelLinear`` on top of the fused operators.

Constructor keywords, parameter shapes, tensor-parallel attributes, initialisation (same seed, same weights),
``(output, bias)`` return and ``sharded_state_dict`` are those of the installed megatron-core (0.16.1 to 0.19.x;
where they differ, :mod:`flux_layers.layers._megatron_compat` decides), so either layer can replace
``megatron.core.tensor_parallel.ColumnParallelLinear`` / ``RowParallelLinear`` in a spec and checkpoints
interchange. Tensors are [s, b, h] (sequence first; any leading dims work) and flattened sequence-major to
[s*b, h] for the 2-D ops, so a sequence shard is a contiguous block of rows.

| layer, mode | fprop | dgrad | wgrad |
|---|---|---|---|
| column, SP, TP > 1 | ``ops.ag_gemm`` [s/tp,b,K] -> [s,b,N/tp] | ``ops.gemm_rs`` 'nn' -> [s/tp,b,K] | dY^T @ AG(x) -> [N/tp,K] |
| row, SP, TP > 1 | ``ops.gemm_rs`` [s,b,K/tp] -> [s/tp,b,N] | ``ops.ag_gemm`` 'nn' -> [s,b,K/tp] | AG(dY)^T @ x -> [N,K/tp] |
| column, no SP | GEMM [s,b,K] -> [s,b,N/tp] | GEMM, all-reduce dX | dY^T @ x |
| row, no SP | GEMM, all-reduce Y -> [s,b,N] | GEMM | dY^T @ x |

Without sequence parallelism, at TP = 1, and for MoE experts with explicit expert communication the layers do
what megatron-core's do, with two deliberate differences: a frozen weight keeps its bias gradient (megatron's
``LinearWithFrozenWeight`` drops it), and the tensor-parallel attributes are set even when
``perform_initialization`` is False (as megatron-core sets them too from 0.18 on).

Which path a sequence-parallel GEMM takes is up to :class:`~flux_layers.config.OverlapConfig` (from the
config's ``tp_comm_overlap*`` fields unless ``overlap=`` is given) and ops' dispatcher (``ops.backend.choose``,
what ``ops.plan`` asks). The layer decides all three GEMMs of a step at fprop and hands the decision to the
backward, so ``layer.last_paths`` ('fprop', 'dgrad', 'wgrad' -> :class:`ops.Choice`) is what runs: path
'fused' or 'reference' for the ops, 'local' for a plain GEMM (whose collective, if any, runs separately, as in
Megatron). ``layer.last_gemms`` ('fprop', 'dgrad' -> (op, (M, K, N)) or None) names the op of each
sequence-parallel GEMM and the per-rank GEMM its path was decided under (the tuning table's key,
flux_layers/runtime/tuning.py); None where an overlap switch sent it down the reference path undecided. Under
torch.compile the decision is taken once per shape at trace time (a constant in the graph).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none
from torch.fx.experimental.symbolic_shapes import guard_scalar
from torch.nn.parameter import Parameter

from flux_layers import ops
from flux_layers.config import OverlapConfig
from flux_layers.layers import _megatron_compat
from flux_layers.layers.autograd import (
    AllGatherLinear,
    GatherLastDim,
    LocalLinear,
    ReduceScatterLinear,
    ScatterLastDim,
)
from flux_layers.layers.fp8_autograd import column_parallel_forward, row_parallel_forward
from flux_layers.layers.fp8_recipe import call_recipe, setup_layer
from flux_layers.ops import Choice
from flux_layers.runtime import tuning

_LOCAL_NO_SP = "no sequence parallelism: plain GEMM, Megatron's collective separately"
_LOCAL_TP1 = "tensor-parallel size 1: no communication"
_LOCAL_EXPERT = "expert layer: communication is the token dispatcher's"


@torch.compiler.assume_constant_result
def _choose(op: str, device: torch.device, dtype: torch.dtype, x_shape: tuple[int, int], w_shape: tuple[int, int],
            weight_layout: str, group, backend: Optional[str]) -> tuple[str, str]:
    """ops' decision (``ops.decide``) for a call of ``op`` with an input of ``x_shape`` and a weight of ``w_shape``,
    as (path, reason): decided once per shape and kept. It depends only on static facts (op, shapes, dtype, device,
    group, settings), so torch.compile takes it as a constant instead of tracing the dispatcher."""
    decision = ops.decide(op, x_shape, w_shape, group=group, weight_layout=weight_layout, backend=backend,
                          dtype=dtype, device=device)
    return decision.path, decision.reason


def _divide(name: str, value: int, tp: int) -> int:
    if value % tp != 0:
        raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size {tp}")
    return value // tp


def _check_config(layer: str, config, is_expert: bool) -> None:
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError(f"{layer}: config.defer_embedding_wgrad_compute=True is not supported; keep "
                         f"megatron-core's ColumnParallelLinear for the output layer that uses it")
    if getattr(config, "cpu_offloading", False):
        raise ValueError(f"{layer}: config.cpu_offloading=True is not supported")
    shards = _megatron_compat.weight_shards_beyond_tp(config, is_expert)
    if shards > 1:
        field = "expert_tensor_parallel_num_weight_shards" if is_expert else "tensor_parallel_num_weight_shards"
        raise ValueError(f"{layer}: generalized tensor parallelism (config.{field}: weights sharded {shards} ways "
                         f"beyond tensor parallelism) is not supported")


def cuda_graphs_requested(config) -> bool:
    """Whether megatron's config asks for CUDA graphs (``cuda_graph_impl``, or the older ``enable_cuda_graph``)."""
    return bool(getattr(config, "enable_cuda_graph", False)) or getattr(config, "cuda_graph_impl", "none") != "none"


def _device(config) -> torch.device:
    return torch.device("cpu") if config.use_cpu_initialization else torch.device("cuda",
                                                                                 torch.cuda.current_device())


def _init_weight(weight: Parameter, config, *, full_out: int, full_in: int, per_partition: int, partition_dim: int,
                 init_method: Callable, stride: int, keep_master_weight_for_test: bool, rank: int, world_size: int,
                 is_expert: bool, master_dtype: torch.dtype):
    """Megatron's initialisation: the whole master weight on CPU, or the per-rank RNG-tracker fork on GPU.

    NOTE: megatron-core before 0.18 leaves the tensor-parallel attributes unset when ``perform_initialization``
    is False (so its grad-norm would count such a weight as a TP duplicate); these layers always set them.
    """
    if not config.perform_initialization:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
        return None
    if config.use_cpu_initialization:
        return _initialize_affine_weight_cpu(
            weight, full_out, full_in, per_partition, partition_dim, init_method, stride=stride,
            return_master_weight=keep_master_weight_for_test, params_dtype=master_dtype, rank=rank,
            world_size=world_size)
    _initialize_affine_weight_gpu(weight, init_method, partition_dim=partition_dim, stride=stride,
                                  is_expert=is_expert)
    return None


class _ParallelLinear(torch.nn.Module):
    """What the two layers share: groups, switches, the gradient-accumulation check, extra state."""

    def _setup(self, config, tp_group, is_expert: bool, tp_comm_buffer_name, overlap) -> tuple[int, int]:
        _check_config(type(self).__name__, config, is_expert)
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        # The parameters' ``allreduce`` attribute: False where megatron reduces their gradients over the expert
        # data-parallel group (its DistributedDataParallel and grad-norm read it).
        self._params_allreduce = not _megatron_compat.grads_reduced_over_expert_dp(config, is_expert)
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        world_size, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        self.tp_size = world_size
        self.explicit_expert_comm = is_expert and (world_size > 1 or self.expert_parallel)
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if overlap is not None and not isinstance(overlap, OverlapConfig):
            raise TypeError(f"overlap must be a flux_layers.OverlapConfig or None, got {type(overlap).__name__}")
        self.overlap = overlap if overlap is not None else OverlapConfig.from_megatron(config, tp_comm_buffer_name)
        self.last_paths: dict[str, Choice] = {}
        self.last_gemms: dict[str, tuple[str, tuple[int, int, int]] | None] = {}
        if cuda_graphs_requested(config):
            # The fused ops' workspaces need their CUDA-graph twins, created with them before any capture.
            from flux_layers.runtime import workspace
            workspace.enable_cuda_graphs()
        # Megatron: a default empty _extra_state so that checkpoints from TE layers load.
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))
        setup_layer(self, config, is_expert)  # FP8 from megatron's fp8 fields (flux_layers/layers/fp8_recipe.py)
        return world_size, rank

    def _check_main_grad(self, weight: torch.Tensor) -> None:
        if (self.gradient_accumulation_fusion and weight.requires_grad and torch.is_grad_enabled()
                and not hasattr(weight, "main_grad") and not hasattr(weight, "__fsdp_param__")):
            raise RuntimeError(f"{type(self).__name__}: config.gradient_accumulation_fusion=True needs "
                               f"weight.main_grad (allocated by megatron's DistributedDataParallel); the weight "
                               f"has none")

    def _plan(self, op: str, x: torch.Tensor, rows: int, k: int, n: int, weight_layout: str,
              dgrad: bool = False) -> tuple[Choice, tuple[str, tuple[int, int, int]] | None]:
        """The path of one sequence-parallel GEMM, a call of ``op`` with an input [rows, k] (``x``'s dtype and
        device) and an [n, k] ('nt') or [k, n] ('nn') weight, and what it was decided under ((op, the per-rank GEMM
        the tuning table is keyed by), None where undecided): the reference path where this layer's overlap switch
        is off, else what ops decides. ``dgrad``: the column dgrad's GEMM+RS, which has its own switch."""
        kind = "gemm_rs_dgrad" if dgrad else op
        switch = self.overlap.off_switch(kind)
        if switch is not None:
            return Choice("reference", f"overlap switch {switch}=False"), None
        # NOTE: the path may depend on the shape (tuning table), so under torch.compile with dynamic shapes
        # guard_scalar specialises the sizes: one graph per shape, each with its own path.
        rows, k, n = (guard_scalar(d) for d in (rows, k, n))
        w_shape = (n, k) if weight_layout == "nt" else (k, n)
        choice = Choice(*_choose(op, x.device, x.dtype, (rows, k), w_shape, weight_layout, self.tp_group,
                                 self.overlap.backend_for(kind)))
        return choice, (op, tuning.table_key(op, rows, k, n, self.tp_size))

    def _local_paths(self, reason: str) -> None:
        local = Choice("local", reason)
        self.last_paths = {"fprop": local, "dgrad": local, "wgrad": local}
        self.last_gemms = {}

    def set_extra_state(self, state: Any):
        """Extra state is ignored."""

    def get_extra_state(self) -> None:
        """Keeps the state dict compatible with TE's."""
        return None

    def backward_dw(self) -> None:
        """Delayed wgrad is not supported (like megatron-core's local layers): does nothing."""

    def set_layer_number(self, layer_number: int) -> None:
        """This linear's transformer layer (1-based, global), which ``config.first_last_layers_bf16`` needs and
        megatron-core does not pass to linears (``fp8_recipe.assign_layer_numbers`` tells a whole model's)."""
        if self.fp8_state is not None:
            self.fp8_state.layer_number = layer_number


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A [output_size, input_size] split along its rows (output features) over TP ranks.

    Keywords as megatron-core's ``ColumnParallelLinear``, plus ``overlap`` (an :class:`OverlapConfig`; default:
    from ``config``); ``name``, the module's path that megatron-core passes from 0.18 on, is unused (as by its own
    local linears). Under ``config.sequence_parallel`` the input is this rank's sequence shard [s/tp, b, K] and the
    output [s, b, N/tp].
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable, bias: bool = True,
                 gather_output: bool = False, stride: int = 1, keep_master_weight_for_test: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 embedding_activation_buffer: Optional[list] = None, grad_output_buffer: Optional[list] = None,
                 is_expert: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 disable_grad_reduce: bool = False, tp_group: Optional[torch.distributed.ProcessGroup] = None,
                 overlap: Optional[OverlapConfig] = None, name: Optional[str] = None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.disable_grad_reduce = disable_grad_reduce
        world_size, rank = self._setup(config, tp_group, is_expert, tp_comm_buffer_name, overlap)
        self.output_size_per_partition = _divide("output_size", output_size, world_size)

        if not skip_weight_param_allocation:
            self.weight = Parameter(torch.empty(self.output_size_per_partition, input_size,
                                                dtype=config.params_dtype, device=_device(config)))
            self.master_weight = _init_weight(
                self.weight, config, full_out=output_size, full_in=input_size,
                per_partition=self.output_size_per_partition, partition_dim=0, init_method=init_method,
                stride=stride, keep_master_weight_for_test=keep_master_weight_for_test, rank=rank,
                world_size=world_size, is_expert=is_expert, master_dtype=torch.float32)  # as megatron's column
            setattr(self.weight, "allreduce", self._params_allreduce)
        else:
            self.weight = None

        if bias:
            self.bias = Parameter(torch.empty(self.output_size_per_partition, dtype=config.params_dtype,
                                              device=_device(config)))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            setattr(self.bias, "allreduce", self._params_allreduce)
        else:
            self.register_parameter("bias", None)

        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and world_size <= 1:
            warnings.warn("`sequence_parallel` is set to `True`, but tensor model parallel size is "
                          f"{world_size}. Disabling sequence parallel.")
            self.sequence_parallel = False
        self.allreduce_dgrad = world_size > 1 and not self.sequence_parallel and not disable_grad_reduce

    def _resolve_weight(self, weight: Optional[torch.Tensor]) -> torch.Tensor:
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass and "
                                   "skip_weight_param_allocation is True.")
            return self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not {expected} as expected")
        return weight

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        """input_ [s(/tp), b, K] -> (output [s, b, N/tp] (or [s, b, N] if gathered), bias or None)."""
        weight = self._resolve_weight(weight)
        self._check_main_grad(weight)
        bias = self.bias if not self.skip_bias_add else None
        fp8 = call_recipe(self)
        if fp8 is not None:
            output_parallel = column_parallel_forward(self, input_, weight, bias, fp8)
        elif self.sequence_parallel and not self.explicit_expert_comm:
            output_parallel = self._all_gather_linear(input_, weight, bias)
        else:
            if self.explicit_expert_comm:
                self._local_paths(_LOCAL_EXPERT)
            else:
                self._local_paths(_LOCAL_NO_SP if self.tp_size > 1 else _LOCAL_TP1)
            allreduce_dgrad = self.allreduce_dgrad and not self.explicit_expert_comm
            output_parallel = _local_linear(input_, weight, bias, self.tp_group, allreduce_dgrad=allreduce_dgrad,
                                            allreduce_output=False, grad_accum_fusion=self.gradient_accumulation_fusion)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        output = GatherLastDim.apply(output_parallel, self.tp_group) if gather else output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def _all_gather_linear(self, input_, weight, bias):
        x_shard_m = input_.reshape(-1, input_.shape[-1])
        m, k, n = x_shard_m.shape[0] * self.tp_size, self.input_size, self.output_size_per_partition
        fprop, fprop_gemm = self._plan("ag_gemm", x_shard_m, m // self.tp_size, k, n, "nt")  # AG(x) @ W^T
        dgrad, dgrad_gemm = self._plan("gemm_rs", x_shard_m, m, n, k, "nn", dgrad=True)  # dY [M, N/tp] @ W -> RS
        self.last_gemms = {"fprop": fprop_gemm, "dgrad": dgrad_gemm}
        if dgrad.path == "reference":
            dgrad = Choice("reference", dgrad.reason + "; NCCL reduce-scatter under the wgrad GEMM")
        self.last_paths = {"fprop": fprop, "dgrad": dgrad,
                           "wgrad": Choice("local", "dY^T @ AG(x), AG(x) " + (
                               "kept from fprop" if self.overlap.wgrad_input == "keep" else "gathered again"))}
        keep_gathered = (self.overlap.wgrad_input == "keep" and weight.requires_grad and torch.is_grad_enabled())
        y = AllGatherLinear.apply(x_shard_m, weight, bias, self.tp_group, fprop.path, dgrad.path, keep_gathered,
                                  self.gradient_accumulation_fusion)
        return y.view((input_.shape[0] * self.tp_size,) + tuple(input_.shape[1:-1]) + (y.shape[-1],))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Weight and bias sharded along axis 0, as megatron-core's."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0, "bias": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def __repr__(self):
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.tp_size}, SP={self.sequence_parallel})")


class RowParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A [output_size, input_size] split along its columns (input features) over TP ranks.

    Keywords as megatron-core's ``RowParallelLinear``, plus ``overlap`` (``name`` unused, as in
    :class:`ColumnParallelLinear`). The bias is not split and is added after the reduction (once); under
    ``config.sequence_parallel`` the output is this rank's sequence shard [s/tp, b, N] and the bias carries
    ``sequence_parallel = True`` so that its partial gradients are all-reduced by Megatron's
    ``finalize_model_grads``.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None, overlap: Optional[OverlapConfig] = None,
                 name: Optional[str] = None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise RuntimeError("RowParallelLinear: config.sequence_parallel=True needs input_is_parallel=True "
                               "(To enable `sequence_parallel`, `input_is_parallel` must be `True`)")
        world_size, rank = self._setup(config, tp_group, is_expert, tp_comm_buffer_name, overlap)
        if self.explicit_expert_comm and not skip_bias_add:
            raise ValueError("RowParallelLinear: is_expert=True with expert communication needs skip_bias_add=True "
                             "(the bias is added after the token combine)")
        self.input_size_per_partition = _divide("input_size", input_size, world_size)

        self.weight = Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=config.params_dtype,
                                            device=_device(config)))
        self.master_weight = _init_weight(
            self.weight, config, full_out=output_size, full_in=input_size,
            per_partition=self.input_size_per_partition, partition_dim=1, init_method=init_method, stride=stride,
            keep_master_weight_for_test=keep_master_weight_for_test, rank=rank, world_size=world_size,
            is_expert=is_expert, master_dtype=config.params_dtype)
        setattr(self.weight, "allreduce", self._params_allreduce)

        if bias:
            self.bias = Parameter(torch.empty(output_size, dtype=config.params_dtype, device=_device(config)))
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            setattr(self.bias, "allreduce", self._params_allreduce)
            setattr(self.bias, "sequence_parallel", self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        """input_ [s, b, K/tp] (or [s, b, K] if not input_is_parallel) -> (output [s(/tp), b, N], bias or None)."""
        self._check_main_grad(self.weight)
        x = input_ if self.input_is_parallel else ScatterLastDim.apply(input_, self.tp_group)
        bias = self.bias if not self.skip_bias_add else None
        fp8 = call_recipe(self)
        if fp8 is not None:
            output = row_parallel_forward(self, x, bias, fp8)
        elif self.explicit_expert_comm:
            self._local_paths(_LOCAL_EXPERT)
            output = _local_linear(x, self.weight, None, self.tp_group, allreduce_dgrad=False, allreduce_output=False,
                                   grad_accum_fusion=self.gradient_accumulation_fusion)
        elif self.sequence_parallel and self.tp_size > 1:
            output = self._reduce_scatter_linear(x, bias)
        else:
            self._local_paths(_LOCAL_NO_SP if self.tp_size > 1 else _LOCAL_TP1)
            output = _local_linear(x, self.weight, bias, self.tp_group, allreduce_dgrad=False,
                                   allreduce_output=self.tp_size > 1,
                                   grad_accum_fusion=self.gradient_accumulation_fusion)
        return output, (self.bias if self.skip_bias_add else None)

    def _reduce_scatter_linear(self, x, bias):
        if x.shape[0] % self.tp_size != 0:
            raise ValueError(f"RowParallelLinear: the sequence dimension of the input {tuple(x.shape)} "
                             f"({x.shape[0]}) is not divisible by the tensor-parallel size {self.tp_size}")
        x_shard_k = x.reshape(-1, x.shape[-1])
        m, k, n = x_shard_k.shape[0], self.input_size_per_partition, self.output_size
        fprop, fprop_gemm = self._plan("gemm_rs", x_shard_k, m, k, n, "nt")  # x [M, K/tp] @ W^T -> RS -> [M/tp, N]
        dgrad, dgrad_gemm = self._plan("ag_gemm", x_shard_k, m // self.tp_size, n, k, "nn")  # AG(dY) @ W
        self.last_gemms = {"fprop": fprop_gemm, "dgrad": dgrad_gemm}
        self.last_paths = {"fprop": fprop, "dgrad": dgrad, "wgrad": Choice("local", "AG(dY)^T @ x, AG(dY) from dgrad")}
        y_shard_m = ReduceScatterLinear.apply(x_shard_k, self.weight, bias, self.tp_group, fprop.path, dgrad.path,
                                              self.gradient_accumulation_fusion)
        return y_shard_m.view((x.shape[0] // self.tp_size,) + tuple(x.shape[1:-1]) + (self.output_size,))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Weight sharded along axis 1, bias replicated, as megatron-core's."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 1}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def __repr__(self):
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.tp_size}, SP={self.sequence_parallel})")


def _local_linear(x, weight, bias, group, *, allreduce_dgrad: bool, allreduce_output: bool,
                  grad_accum_fusion: bool) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    y = LocalLinear.apply(x2d, weight, bias, group, allreduce_dgrad, allreduce_output, grad_accum_fusion)
    return y.view(tuple(x.shape[:-1]) + (y.shape[-1],))
