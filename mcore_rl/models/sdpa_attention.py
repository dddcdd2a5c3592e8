"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for the local
(non-Transformer-Engine) layer spec.

Megatron's local `DotProductAttention` materialises the scores and probabilities of every
head, [b, heads, s, s], and keeps the probabilities for backward: for one 4096-token
sequence of a 9-head, 30-layer model in fp32, 18 GB. PyTorch's fused attention (flash
attention on CPU and GPU) computes the same softmax(QK^T * scale) V blockwise and keeps only
the output and the log-sum-exp, so memory grows with s, not s^2, and grouped-query attention
reads the KV heads without repeating them.

It takes the cases our models run: causal self-attention without a mask tensor (right
padding needs none), or self-attention under an explicit boolean mask [b, 1, s, s] (True:
masked, Megatron's convention; the train engine's shared prompts,
`mcore_rl.train.shared_prompts`), with no attention bias, no sliding window, no learnable
softmax offset and no attention dropout while training. Anything else goes to Megatron's
own implementation.

Packed sequences (Megatron's ``thd`` format, `mcore_rl.train.packing`): one attention per
segment of ``cu_seqlens``, causal, or under the segment's own mask (a shared prompt), so
the cost is the sum of the segments' squared lengths.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """`DotProductAttention` with the fused kernel where it computes the same thing, and
    context parallelism (`mcore_rl.parallel.context_parallel`), which Megatron's local
    attention refuses."""

    def __init__(self, config, *args, **kwargs):
        cp = getattr(config, "context_parallel_size", 1)
        if cp > 1:  # Megatron's class asserts CP == 1; what it builds does not depend on CP
            from dataclasses import replace

            super().__init__(replace(config, context_parallel_size=1), *args, **kwargs)
            self.config = config
            pg = kwargs.get("pg_collection")
            if pg is not None and getattr(pg, "cp", None) is not None:
                self.cp_group = pg.cp
            else:
                from megatron.core import parallel_state

                self.cp_group = parallel_state.get_context_parallel_group()
        else:
            super().__init__(config, *args, **kwargs)
            self.cp_group = None

    def _fused_applies(self, query, key, attention_mask, attn_mask_type, attention_bias,
                       packed_seq_params) -> bool:
        config = self.config
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return ((attention_mask is None and mask_type == AttnMaskType.causal
                 or _boolean_mask(attention_mask, query))
                and attention_bias is None and packed_seq_params is None
                and query.shape[0] == key.shape[0]
                and getattr(config, "window_size", None) is None
                and getattr(config, "softmax_type", "vanilla") == "vanilla"
                and not config.apply_query_key_layer_scaling
                and not (self.training and self.attention_dropout.p > 0))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._segments(query, key, value, attention_bias, packed_seq_params)
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, attention_mask, attn_mask_type,
                                          attention_bias)
        if not self._fused_applies(query, key, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        grouped = self.num_attention_heads_per_partition > self.num_query_groups_per_partition
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=grouped)
        else:  # torch's boolean mask marks what may be attended: the opposite of Megatron's
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                 scale=self.softmax_scale, enable_gqa=grouped)
        # [b, heads, s, d] -> [s, b, heads * d]
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


    def _context_parallel(self, query, key, value, attention_mask, attn_mask_type,
                          attention_bias):
        """This rank's queries (two chunks of the sequence) over every CP rank's keys and
        values, causal by global position."""
        from mcore_rl.parallel.context_parallel import (causal_attention, chunk_positions,
                                                     gather_sequence)

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if not self._fused_applies(query, key, attention_mask, attn_mask_type, attention_bias,
                                   None) or attention_mask is not None \
                or mask_type != AttnMaskType.causal:
            raise NotImplementedError("context parallelism on the local attention takes plain "
                                      "causal softmax attention only; set parallel.cp: 1")
        cp = self.cp_group.size()
        local = query.shape[0]
        positions = chunk_positions(local * cp, cp, self.cp_group.rank(), query.device)
        key, value = (gather_sequence(t, self.cp_group) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        grouped = self.num_attention_heads_per_partition > self.num_query_groups_per_partition
        out = causal_attention(q, k, v, positions, self.softmax_scale, grouped)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _segments(self, query, key, value, attention_bias, params):
        """[t, heads, d] packed tokens -> [t, heads * d], attention within each segment."""
        config = self.config
        if (attention_bias is not None or getattr(config, "window_size", None) is not None
                or getattr(config, "softmax_type", "vanilla") != "vanilla"
                or config.apply_query_key_layer_scaling
                or (self.training and self.attention_dropout.p > 0)):
            raise NotImplementedError("packed sequences on the local attention take plain "
                                      "causal softmax attention only (no bias, window, "
                                      "softmax offset or attention dropout); set "
                                      "train.packing: false")
        bounds = getattr(params, "segment_bounds", None) or tuple(params.cu_seqlens_q.tolist())
        masks = getattr(params, "segment_masks", None) or (None,) * (len(bounds) - 1)
        grouped = self.num_attention_heads_per_partition > self.num_query_groups_per_partition
        if self.cp_group is not None:
            return self._segments_context_parallel(query, key, value, bounds, masks, grouped)
        # One split per tensor, not a slice per segment: a slice's backward writes its
        # gradient into zeros the size of the whole tensor, so slicing would zero-fill every
        # packed token once per segment; a split's backward is one concatenation.
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        if bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(f"packed segments cover positions {bounds[0]}..{bounds[-1]}, "
                             f"not the {query.shape[0]} packed tokens")
        outs = []
        for q, k, v, mask in zip(*(t.split(lengths) for t in (query, key, value)), masks):
            # [n, heads, d] -> [1, heads, n, d]
            q, k, v = (t.permute(1, 0, 2)[None] for t in (q, k, v))
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     scale=self.softmax_scale, enable_gqa=grouped)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask,
                                                     scale=self.softmax_scale, enable_gqa=grouped)
            outs.append(out[0].permute(1, 0, 2))
        out = torch.cat(outs)
        return out.reshape(out.shape[0], self.hidden_size_per_partition)


    def _segments_context_parallel(self, query, key, value, bounds, masks, grouped):
        """Packed segments split over CP: this rank's two chunks of every segment (in
        segment order) attend the whole segment, gathered from every CP rank."""
        from mcore_rl.parallel.context_parallel import (causal_attention, chunk_positions,
                                                     gather_sequence)

        if any(m is not None for m in masks):
            raise NotImplementedError("shared-prompt segments are not split over CP ranks")
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        spans = list(zip(bounds[:-1], bounds[1:]))
        order = torch.cat([torch.cat([s + chunk_positions(e - s, cp, r) for s, e in spans])
                           for r in range(cp)])
        key, value = (gather_sequence(t, self.cp_group, order) for t in (key, value))
        lengths = [end - start for start, end in spans]
        outs = []  # split, not sliced (see _segments)
        for length, q, k, v in zip(lengths, query.split([n // cp for n in lengths]),
                                   key.split(lengths), value.split(lengths)):
            mine = chunk_positions(length, cp, rank, query.device)
            # [n, heads, d] -> [1, heads, n, d]
            q, k, v = (t.permute(1, 0, 2)[None] for t in (q, k, v))
            out = causal_attention(q, k, v, mine, self.softmax_scale, grouped)
            outs.append(out[0].permute(1, 0, 2))
        out = torch.cat(outs)
        return out.reshape(out.shape[0], self.hidden_size_per_partition)


def _boolean_mask(mask, query) -> bool:
    """A [b, 1, s, s] boolean mask over the query's own sequence (``query`` [s, b, ...])."""
    s, b = query.shape[0], query.shape[1]
    return mask is not None and mask.dtype == torch.bool and tuple(mask.shape) == (b, 1, s, s)
