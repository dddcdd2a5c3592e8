"""Plain torch definition of token log-probs and entropy: the behaviour every path must match."""
from __future__ import annotations

import torch


def token_logprobs_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """``log_softmax(logits[..., :vocab_size] / temperature)`` in fp32, read at ``labels``.

    logits: [..., V] (unsharded), labels: [...] integer ids in [0, vocab_size).
    Returns log-probs [...] fp32 and, with ``return_entropy``, the entropy [...] fp32 of the
    same distribution. Materialises the full fp32 log-softmax; differentiable through autograd.
    """
    v = logits.shape[-1] if vocab_size is None else vocab_size
    logp = torch.log_softmax(logits[..., :v].float() / temperature, dim=-1)
    lp = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return lp
    return lp, -(logp.exp() * logp).sum(-1)
