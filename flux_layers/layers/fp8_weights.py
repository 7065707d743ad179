"""The cached FP8 copy of a linear's weight and its transpose: cast once per optimizer step, reused by micro-batches.

| copy | shape (column layer / row layer) | read by |
|---|---|---|
| ``q`` | w_shard_n [N/tp, K] / w_shard_k [N, K/tp] | fprop: x @ W^T ('nt') |
| ``t`` | [K, N/tp] / [K/tp, N] | dgrad: dY @ W, which FP8 GEMMs also need K-major: ``gemm(dY, W^T, 'nt')`` |

Both share one tensor-wise scale (``ops.fp8.quantize_with_transpose``). The weight itself stays in its master dtype
(checkpoints are unchanged); the copies are recomputable state and never saved. They cost 2 bytes per weight
element (the transpose only once a backward needs it).

**When the copy is refreshed.** A cast is needed exactly when the weight's values changed. Two signals, either one
refreshes:
- the parameter's version counter (``weight._version``: every in-place update through the tensor, as the
  optimizer's ``p.copy_(master)`` or ``p.add_(...)``, bumps it), with its identity, storage address, shape and dtype
  (megatron's buffers rebind ``param.data``);
- megatron's first-micro-batch signal: the schedules set ``layer.is_first_microbatch = True`` on every module that
  has the attribute at each step's first micro-batch (for updates that bypass the version counter, such as a
  distributed optimizer's all-gather into the parameter buffer through ``.data``).
A frozen weight keeps its copy for as long as neither fires. While a CUDA graph is being captured the cast is
always recorded into the graph, so that every replay casts the weight it then holds. Host-side metadata only:
nothing here reads tensor values.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from flux_layers.ops.fp8 import ScaledTensor, quantize, quantize_with_transpose


class Fp8Weight:
    """One weight's FP8 copies: ``q`` [N, K] and, once asked for, ``t`` [K, N] (same scale)."""

    def __init__(self, q: ScaledTensor, t: Optional[ScaledTensor]):
        self.q = q
        self._t = t

    @property
    def t(self) -> ScaledTensor:
        if self._t is None:  # cast without the transpose (no grad at the time): the same bytes, transposed
            self._t = ScaledTensor(self.q.data.t().contiguous(), self.q.scale)
        return self._t


class Fp8WeightCache:
    """The FP8 copy of one weight, refreshed when the weight changes (module docstring). ``casts`` counts the
    casts made (tests count them)."""

    def __init__(self):
        self._weight_ref = None
        self._key = None
        self._copy: Optional[Fp8Weight] = None
        self.casts = 0

    @staticmethod
    def _key_of(weight: torch.Tensor, dtype: torch.dtype, margin: int) -> tuple:
        return (weight._version, weight.data_ptr(), tuple(weight.shape), weight.dtype, weight.device, dtype, margin)

    def get(self, weight: torch.Tensor, dtype: torch.dtype, margin: int, *, refresh: bool,
            with_transpose: bool) -> Fp8Weight:
        """The FP8 copy of ``weight`` (``refresh``: cast again regardless, megatron's first-micro-batch signal;
        ``with_transpose``: the backward will need ``t``, cast both in one pass)."""
        key = self._key_of(weight, dtype, margin)
        capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
        same = self._copy is not None and self._key == key and self._weight_ref() is weight
        if same and not refresh and not capturing:
            return self._copy
        with torch.no_grad():
            source = weight.detach()
            if with_transpose:
                copy = Fp8Weight(*quantize_with_transpose(source, dtype, margin=margin))
            else:
                copy = Fp8Weight(quantize(source, dtype, margin=margin), None)
        self.casts += 1
        if capturing:  # recorded into the graph: keep nothing that a later eager call could mistake for current
            self._copy, self._key, self._weight_ref = None, None, None
            return copy
        self._copy, self._key, self._weight_ref = copy, key, weakref.ref(weight)
        return copy

    def clear(self) -> None:
        self._copy, self._key, self._weight_ref = None, None, None
