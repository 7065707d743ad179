"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` with megatron-core's interface.

megatron-core's own ``DotProductAttention`` is the unfused baddbmm + softmax + bmm path; TE's needs TE. This
module is what both GPT specs in :mod:`flux_layers.layers.spec` use, so that a comparison between them differs
only in the linear layers.

| tensor | shape (this rank) |
|---|---|
| query | [sq, b, np, hn] (np = heads / tp) |
| key, value | [sk, b, ng, hn] (ng = query groups / tp) |
| attention_mask | None or bool, broadcastable to [b, np, sq, sk], True = masked out (Megatron's convention) |
| output | [sq, b, np * hn] |

Mask types: ``causal`` (the mask argument is ignored, as in TE), ``no_mask``, ``padding`` / ``arbitrary`` (the
mask is applied), ``padding_causal`` (both).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide, get_pg_size

_SUPPORTED_MASKS = (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.arbitrary,
                    AttnMaskType.padding_causal)


class SDPAttention(MegatronModule):
    """``DotProductAttention``-compatible core attention on SDPA (flash / memory-efficient kernels on GPU)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(f"SDPAttention: config.context_parallel_size={config.context_parallel_size}; "
                             f"context parallelism is not supported")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention: config.softmax_type={config.softmax_type!r}; only 'vanilla' is supported")
        if config.window_size is not None:
            raise ValueError(f"SDPAttention: config.window_size={config.window_size}; sliding windows are not "
                             f"supported")
        if attn_mask_type not in _SUPPORTED_MASKS:
            raise ValueError(f"SDPAttention: attn_mask_type={attn_mask_type} is not supported; expected one of "
                             f"{[m.name for m in _SUPPORTED_MASKS]}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = get_pg_size(self.tp_group)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp)
        # Megatron's query-key layer scaling divides the scores by layer_number and multiplies them back in the
        # fp32 softmax: the net scale is the plain one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPAttention: packed sequences (packed_seq_params) are not supported")
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        is_causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        attn_mask = None
        if mask_type in (AttnMaskType.padding, AttnMaskType.arbitrary, AttnMaskType.padding_causal):
            if attention_mask is not None:
                attn_mask = ~attention_mask  # SDPA: True = attend
        if attn_mask is not None and is_causal:
            sq, sk = query.shape[0], key.shape[0]
            causal = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
            attn_mask, is_causal = attn_mask & causal, False

        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                         is_causal=is_causal, scale=self.softmax_scale,
                                                         enable_gqa=gqa)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                     is_causal=is_causal, scale=self.softmax_scale, enable_gqa=gqa)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(context.shape[0], context.shape[1], self.hidden_size_per_partition)
