"""Overlap switches of the parallel linear layers, named after Megatron's ``tp_comm_overlap*`` fields.

A layer's sequence-parallel GEMMs come in two kinds:

| switch | fused op | column-parallel layer | row-parallel layer |
|---|---|---|---|
| ``tp_comm_overlap_ag`` | AllGather + GEMM (``ops.ag_gemm``) | fprop | dgrad |
| ``tp_comm_overlap_rs`` | GEMM + ReduceScatter (``ops.gemm_rs``) | (with ``_rs_dgrad``) dgrad | fprop |
| ``tp_comm_overlap_rs_dgrad`` | GEMM + ReduceScatter for the column dgrad | dgrad | |

A switch that is off sends that GEMM down the sequential path (``backend='reference'``: the collective, then
the GEMM), which is what megatron-core's own layers do. ``tp_comm_overlap`` is the master switch, as in
Megatron. The column dgrad's reduce-scatter has a second overlap that needs no fused kernel, as with TE's
``tp_comm_bulk_dgrad``: with ``tp_comm_overlap_rs_dgrad=False`` the dgrad GEMM runs alone and its NCCL
reduce-scatter runs underneath the wgrad GEMM (megatron-core's own column layer does the same); with True the
dgrad is the fused GEMM+ReduceScatter. As in Megatron, ``tp_comm_overlap_rs_dgrad`` defaults to False when
read from a megatron config. TE's other userbuffer modes (``tp_comm_split_*``, ``tp_comm_atomic_*``) have no
counterpart here.

Column-parallel wgrad needs AG(x). ``wgrad_input`` says where it comes from:
- ``'keep'`` (default): the fprop AG+GEMM hands the gathered x back (``return_gathered=True``) and the layer
  keeps it for backward. Costs (tp-1)/tp * M * K extra activation memory per column layer (64 MiB for M = K =
  8192, bf16, tp = 2) and saves one all-gather per layer per step, which would otherwise share links and copy
  engines with the dgrad GEMM+RS running at the same time.
- ``'regather'``: keep only the shard and gather it again in backward, issued before the dgrad GEMM so that it
  runs underneath it (Megatron's choice: less memory, one more all-gather).
Which wins is a measurement on the GPU machine; the default is the one that moves fewer bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from flux_layers.ops.backend import BACKENDS

WGRAD_INPUTS = ("keep", "regather")


@dataclass(frozen=True)
class OverlapConfig:
    tp_comm_overlap: bool = True
    """Master switch: if False, every sequence-parallel GEMM takes the sequential (reference) path."""

    tp_comm_overlap_ag: bool = True
    """AllGather + GEMM fused: column fprop, row dgrad."""

    tp_comm_overlap_rs: bool = True
    """GEMM + ReduceScatter fused: row fprop (and column dgrad if ``tp_comm_overlap_rs_dgrad``)."""

    tp_comm_overlap_rs_dgrad: bool = True
    """Column dgrad as fused GEMM + ReduceScatter; False: dgrad GEMM, then NCCL reduce-scatter underneath the
    wgrad GEMM."""

    wgrad_input: str = "keep"
    """Where column wgrad gets AG(x): 'keep' it from fprop or 'regather' it in backward."""

    backend: str | None = None
    """ops backend for the GEMMs whose switch is on: None (``FLUX_LAYERS_BACKEND``), 'auto', 'fused' or
    'reference'."""

    def __post_init__(self):
        if self.wgrad_input not in WGRAD_INPUTS:
            raise ValueError(f"OverlapConfig.wgrad_input must be one of {WGRAD_INPUTS}, got {self.wgrad_input!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"OverlapConfig.backend must be None or one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "fused":
            off = [name for name in ("tp_comm_overlap", "tp_comm_overlap_ag", "tp_comm_overlap_rs")
                   if not getattr(self, name)]
            if off:
                raise ValueError(f"OverlapConfig.backend='fused' asks for the fused kernels but "
                                 f"{', '.join(f'{n}=False' for n in off)} turns them off; "
                                 f"set backend=None or 'auto', or turn the switch on")

    @property
    def ag_enabled(self) -> bool:
        return self.tp_comm_overlap and self.tp_comm_overlap_ag

    @property
    def rs_enabled(self) -> bool:
        return self.tp_comm_overlap and self.tp_comm_overlap_rs

    @property
    def rs_dgrad_enabled(self) -> bool:
        return self.rs_enabled and self.tp_comm_overlap_rs_dgrad

    # The switches that must all be on for a GEMM kind to be fused, master switch first.
    _SWITCHES = {"ag_gemm": ("tp_comm_overlap", "tp_comm_overlap_ag"),
                 "gemm_rs": ("tp_comm_overlap", "tp_comm_overlap_rs"),
                 "gemm_rs_dgrad": ("tp_comm_overlap", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad")}

    def off_switch(self, op: str) -> str | None:
        """The first switch that turns GEMM kind ``op`` ('ag_gemm', 'gemm_rs', 'gemm_rs_dgrad': the column dgrad's
        GEMM+RS) off, or None when it may be fused."""
        if op not in self._SWITCHES:
            raise ValueError(f"backend_for: op must be 'ag_gemm', 'gemm_rs' or 'gemm_rs_dgrad', got {op!r}")
        return next((switch for switch in self._SWITCHES[op] if not getattr(self, switch)), None)

    def backend_for(self, op: str) -> str | None:
        """The ``backend=`` a layer passes for GEMM kind ``op`` (see :meth:`off_switch`): 'reference' where a switch
        is off, else :attr:`backend`."""
        return "reference" if self.off_switch(op) is not None else self.backend

    @classmethod
    def from_megatron(cls, config, tp_comm_buffer_name: str | None = None, **overrides) -> "OverlapConfig":
        """Read the switches from a megatron-core ``ModelParallelConfig``/``TransformerConfig``.

        Attributes the config lacks keep this class's defaults (on). ``tp_comm_overlap_disable_qkv`` /
        ``_fc1`` turn the AG overlap off for the layer whose ``tp_comm_buffer_name`` is 'qkv' / 'fc1', as TE
        does. ``overrides`` replace fields afterwards.
        """
        ag = getattr(config, "tp_comm_overlap_ag", cls.tp_comm_overlap_ag)
        if tp_comm_buffer_name == "qkv" and getattr(config, "tp_comm_overlap_disable_qkv", False):
            ag = False
        if tp_comm_buffer_name == "fc1" and getattr(config, "tp_comm_overlap_disable_fc1", False):
            ag = False
        base = cls(tp_comm_overlap=getattr(config, "tp_comm_overlap", cls.tp_comm_overlap),
                   tp_comm_overlap_ag=ag,
                   tp_comm_overlap_rs=getattr(config, "tp_comm_overlap_rs", cls.tp_comm_overlap_rs),
                   tp_comm_overlap_rs_dgrad=getattr(config, "tp_comm_overlap_rs_dgrad", cls.tp_comm_overlap_rs_dgrad))
        return replace(base, **overrides) if overrides else base
