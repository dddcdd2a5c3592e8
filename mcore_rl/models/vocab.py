"""Padded vocabulary: which logit columns are real, and masking the rest.

The embedding and output layer have ``arch.padded_vocab_size`` rows (a multiple stored with
the checkpoint, independent of TP), zero beyond ``vocab_size``. A zero row still produces a
logit of 0, which a softmax would count, so padded columns must never reach a softmax:

- on vocabulary-parallel logits (each TP rank holds Vp/tp columns), call
  `mask_padded_vocab` before any softmax / log-prob / entropy over the shard;
- on gathered logits, slice ``logits[..., :vocab_size]`` (the log-prob convention of
  mcore-rl: ``log_softmax(logits[..., :vocab_size] / temperature)``).

Masked columns get zero probability, hence zero gradient: the padded rows stay zero in
training and are dropped on export.
"""
from __future__ import annotations

import torch


def padded_columns(vocab_size: int, padded_vocab_size: int, tp_rank: int,
                   tp_size: int) -> tuple[int, int]:
    """[start, end) of padded columns within TP rank ``tp_rank``'s shard (empty if start == end)."""
    per_rank = padded_vocab_size // tp_size
    first = tp_rank * per_rank
    start = min(max(vocab_size - first, 0), per_rank)
    return start, per_rank


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int = 0,
                      tp_size: int = 1) -> torch.Tensor:
    """Set the padded columns of a vocabulary-parallel logits shard [..., Vp/tp] to -inf.

    In place (returns ``logits``); works under autograd (the masked columns get no gradient).
    """
    padded_vocab = logits.shape[-1] * tp_size
    start, end = padded_columns(vocab_size, padded_vocab, tp_rank, tp_size)
    if start < end:
        logits[..., start:end] = float("-inf")
    return logits
