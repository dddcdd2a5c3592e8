"""Critic and reward model: the GPT backbone with a scalar head (hidden -> 1).

Why this shape: HF's ``*ForSequenceClassification`` is the causal LM with ``lm_head``
replaced by ``score`` (a bias-free hidden -> num_labels linear). `GPTValueModel` does the same
to Megatron's ``GPTModel``: it is a GPTModel (so pipeline stages, ``set_input_tensor``, the
final RMSNorm, checkpointing and Megatron's schedules work unchanged) whose ``output_layer``
is a `ScalarHead`. Building a GPTModel with a "vocabulary" of 1 would not work (the vocabulary
is padded), and reaching into ``model.decoder`` would duplicate GPTModel's RoPE and
pipeline plumbing. The head is stored under Megatron's ``output_layer.weight`` key, as HF
stores ``score.weight`` where ``lm_head.weight`` was.

The head is replicated on every TP rank: the final hidden states are identical on all TP
ranks (gathered first under sequence parallelism), so each rank computes the same values
and gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel


class ScalarHead(torch.nn.Module):
    """hidden -> 1 projection without bias, called the way GPTModel calls its output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, std: float, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        # A private generator: every rank (TP, PP, DP) draws the same fresh head.
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=generator) * std
        self.weight = torch.nn.Parameter(weight.to(dtype))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            # [s/tp, b, H] -> [s, b, H]: every TP rank computes the same values, so each
            # keeps its own slice of the gradient (no sum).
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight), None


class GPTValueModel(GPTModel):
    """A GPTModel whose last stage outputs one value per token ([b, s]) instead of logits.

    Other pipeline stages return hidden states as GPTModel does.
    """

    def __init__(self, config, transformer_layer_spec, *, head_seed: int = 1234, **kwargs):
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(config, transformer_layer_spec, **kwargs)
        if self.post_process:
            # Replaces the vocabulary projection GPTModel built (freed right away).
            self.output_layer = ScalarHead(config.hidden_size, config.params_dtype,
                                           config.init_method_std, head_seed,
                                           config.sequence_parallel)

    def forward(self, input_ids, position_ids, attention_mask, *args, labels=None, **kwargs):
        if labels is not None:
            raise ValueError("GPTValueModel returns values; it takes no labels")
        out = super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        return out.squeeze(-1) if self.post_process else out


def sequence_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence score [b] = ``values`` [b, s] at the last non-padding token.

    As HF's ``*ForSequenceClassification`` pools: the rightmost position that is not padding
    (works for right and left padding). HF finds padding by ``pad_token_id``; this uses
    ``attention_mask``, which agrees whenever the pad token only appears as padding.
    """
    positions = torch.arange(values.shape[-1], device=values.device)
    last = (positions * attention_mask.to(positions.dtype)).argmax(-1)
    return values.gather(-1, last.unsqueeze(-1)).squeeze(-1)
