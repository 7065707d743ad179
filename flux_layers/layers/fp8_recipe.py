"""The FP8 recipe of the flux linears, read from megatron-core's own fp8 settings: the one place that reads them.

megatron-core switches FP8 on with ``TransformerConfig(fp8=..., fp8_recipe=...)`` and, without TransformerEngine,
ignores it (``fp8_utils.get_fp8_context`` returns a null context). The flux linears make these fields real:

| field | read as |
|---|---|
| ``fp8`` | None: 16-bit. 'e4m3': e4m3 everywhere. 'hybrid': e4m3 inputs and weights, e5m2 gradients |
| ``fp8_recipe`` | 'tensorwise' only: current scaling, each tensor's scale from its own amax this step |
| ``fp8_margin`` | scale = amax * 2^margin / FP8 max (``flux_layers.ops.fp8.quantize``) |
| ``fp8_wgrad`` | True: wgrad in FP8 from the saved FP8 input and the FP8 gradient; False: in 16 bits |
| ``first_last_layers_bf16`` | the first/last ``num_layers_at_start_in_bf16``/``_end_in_bf16`` layers stay 16-bit |
| ``fp8_param`` | refused: weights stay in ``params_dtype``, the layers cache an FP8 copy (``fp8_weights``) |

Recipes not built ('delayed', 'mxfp8', 'blockwise', 'custom'; megatron's default is 'delayed') are refused when the
layer is built, naming what is supported. ``fp8_amax_history_len``, ``fp8_amax_compute_algo`` and ``fp8_interval``
belong to the delayed recipe and are not read; ``tp_only_amax_red`` has nothing to reduce (no amax all-reduce:
each rank scales its own shard).

**Layer number.** ``first_last_layers_bf16`` needs each linear's transformer layer. megatron-core (0.16.1 to 0.19.x)
builds a layer's linears without it: ``TransformerLayer`` sets its own ``layer_number`` (1-based, global across
pipeline stages) and hands it to the attention's core attention and to MoE layers only. So a linear learns it from
:func:`assign_layer_numbers` (called once on the built model: each flux linear gets the ``layer_number`` of the
transformer layer that holds it) or from ``layer.set_layer_number(n)``; a linear whose number is still unknown when
it runs with ``first_last_layers_bf16`` set raises, naming both.

**Baseline.** megatron-core's own linears do nothing with ``fp8``: :func:`warn_if_fp8_is_ignored` says so where the
baseline spec is built (``get_gpt_decoder_block_spec(..., baseline=True)``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise",)


@dataclass(frozen=True)
class Fp8Recipe:
    """What one FP8 call runs (the config's fields, resolved)."""
    format: str       # 'e4m3' | 'hybrid'
    margin: int       # fp8_margin
    wgrad: bool       # fp8_wgrad: the wgrad GEMM in FP8

    @property
    def fprop_dtype(self) -> torch.dtype:
        """Inputs and weights (both formats)."""
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        """Output gradients dY: e5m2 under 'hybrid' (range over precision), e4m3 under 'e4m3'."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn


def _name(value) -> Optional[str]:
    """A config value that may be a str enum (megatron's ``Fp8Recipe``) as its plain string."""
    if value is None:
        return None
    return str(getattr(value, "value", value))


def recipe_from_config(config, where: str) -> Optional[Fp8Recipe]:
    """The FP8 recipe the config asks for, None for no FP8; ValueError naming the field for what is not built."""
    fmt = getattr(config, "fp8", None)
    if fmt is None or fmt is False:
        return None
    fmt = _name(fmt)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"{where}: config.fp8={fmt!r} is not supported; expected None or one of {FP8_FORMATS} "
                         f"('hybrid': e4m3 forward, e5m2 gradients)")
    recipe = _name(getattr(config, "fp8_recipe", "delayed"))
    if recipe not in FP8_RECIPES:
        raise ValueError(f"{where}: config.fp8_recipe={recipe!r} is not supported by the flux linears; supported: "
                         f"{FP8_RECIPES} (current scaling from this step's amax; set fp8_recipe='tensorwise' - "
                         f"megatron-core's default is 'delayed')")
    if getattr(config, "fp8_param", False):
        raise ValueError(f"{where}: config.fp8_param=True (FP8 primary weights) is not supported; the flux linears "
                         f"keep the weights in params_dtype and cast a cached FP8 copy once per optimizer step")
    margin = getattr(config, "fp8_margin", 0)
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"{where}: config.fp8_margin must be an integer >= 0, got {margin!r}")
    return Fp8Recipe(format=fmt, margin=margin, wgrad=bool(getattr(config, "fp8_wgrad", True)))


def is_bf16_layer(config, layer_number: int) -> bool:
    """Whether transformer layer ``layer_number`` (1-based, global) stays in bf16 under ``first_last_layers_bf16``
    (megatron-core's ``fp8_utils.is_first_last_bf16_layer`` with its 0-based ``layer_no = layer_number - 1``)."""
    if not getattr(config, "first_last_layers_bf16", False):
        return False
    layer_no = layer_number - 1
    start = getattr(config, "num_layers_at_start_in_bf16", 1)
    end = getattr(config, "num_layers_at_end_in_bf16", 1)
    return layer_no < start or layer_no >= config.num_layers - end


class LayerFp8:
    """One linear's FP8 state: the recipe, the layer number (for ``first_last_layers_bf16``), the cached FP8
    weight and the record of what the last call ran (``last``: 'fprop', 'dgrad', 'wgrad' -> the operand dtypes,
    written by the autograd functions as each GEMM runs; empty after a call that ran in bf16)."""

    def __init__(self, where: str, recipe: Fp8Recipe, config):
        from flux_layers.layers.fp8_weights import Fp8WeightCache
        self.where = where
        self.recipe = recipe
        self.config = config
        self.first_last_bf16 = bool(getattr(config, "first_last_layers_bf16", False))
        self.layer_number: Optional[int] = None
        self.weight_cache = Fp8WeightCache()
        self.last: dict[str, str] = {}
        self.paths: dict = {}   # ops' path of each FP8 GEMM, per shape (layer.last_paths)

    def recipe_for_call(self) -> Optional[Fp8Recipe]:
        """The recipe this layer runs now, or None where it stays in bf16 (first/last layers)."""
        if not self.first_last_bf16:
            return self.recipe
        if self.layer_number is None:
            raise RuntimeError(f"{self.where}: config.first_last_layers_bf16=True needs this linear's transformer "
                               f"layer number, which megatron-core does not pass to linears: call "
                               f"flux_layers.layers.fp8_recipe.assign_layer_numbers(model) once the model is built, "
                               f"or layer.set_layer_number(n)")
        if is_bf16_layer(self.config, self.layer_number):
            self.last = {}
            return None
        return self.recipe


def setup_layer(layer, config, is_expert: bool) -> None:
    """Give a flux linear its FP8 state (``layer.fp8_state``: a :class:`LayerFp8`, or None without FP8) and, under
    FP8, megatron's first-micro-batch flag (``layer.is_first_microbatch``: the schedules set it on every module that
    has it at each step's first micro-batch, ``MegatronModule.set_is_first_microbatch``; the layer recasts its
    weight then). Raises for recipes that are not built."""
    where = type(layer).__name__
    recipe = recipe_from_config(config, where)
    layer.fp8_state = None
    if recipe is None:
        return
    if is_expert:
        warnings.warn(f"{where}: config.fp8={recipe.format!r}: FP8 is not built for expert linears (is_expert=True; "
                      f"their token counts vary per step); this layer runs in {config.params_dtype}")
        return
    layer.fp8_state = LayerFp8(where, recipe, config)
    layer.is_first_microbatch = True


def call_recipe(layer) -> Optional[Fp8Recipe]:
    """The recipe ``layer`` runs this call (None: its 16-bit path). What the layers' forward asks."""
    state = getattr(layer, "fp8_state", None)
    return state.recipe_for_call() if state is not None else None


def assign_layer_numbers(model: torch.nn.Module) -> int:
    """Tell every flux linear inside a transformer layer of ``model`` that layer's ``layer_number`` (what
    ``first_last_layers_bf16`` needs); returns how many linears were told. A module counts as a transformer layer
    when it has an integer ``layer_number`` and a ``submodules_config`` (megatron-core's ``TransformerLayer``)."""
    told = 0
    for module in model.modules():
        number = getattr(module, "layer_number", None)
        if not isinstance(number, int) or not hasattr(module, "submodules_config"):
            continue
        for inner in module.modules():
            if getattr(inner, "fp8_state", None) is not None:
                inner.fp8_state.layer_number = number
                told += 1
    return told


def warn_if_fp8_is_ignored(config, where: str = "megatron-core's own linears (the baseline spec)") -> bool:
    """Warn when ``config.fp8`` is set for a model whose linears are megatron-core's: without TransformerEngine they
    ignore it and train in 16 bits. Returns whether it warned."""
    fmt = getattr(config, "fp8", None)
    if fmt is None or fmt is False:
        return False
    warnings.warn(f"config.fp8={_name(fmt)!r} does nothing with {where}: megatron-core without TransformerEngine "
                  f"ignores it and these linears run in {getattr(config, 'params_dtype', '16 bits')}; the flux spec's "
                  f"linears (get_gpt_layer_flux_spec) run FP8")
    return True
