"""Plain torch definition of token log-probs and entropy: the behaviour every path must match."""
from __future__ import annotations

import torch


def truncate_reference(z: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """``z`` [..., V] with the tokens top-k, then top-p sampling never picks set to -inf, as an
    engine samples: top-k keeps values >= the k-th largest; top-p sorts the (renormalised)
    survivors in ascending order and drops every token whose cumulative probability,
    itself included, is at most 1 - top_p, always keeping the largest. Tokens tied with the
    least likely kept one are kept too (a sort orders ties arbitrarily; bf16 logits tie often)."""
    v = z.shape[-1]
    if 0 < top_k < v:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = z.sort(dim=-1)
        cum = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        least = ascending.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
        z = z.masked_fill(z < least, float("-inf"))
    return z


def token_logprobs_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    top_k: int = -1,
    top_p: float = 1.0,
    return_kept: bool = False,
):
    """``log_softmax(logits[..., :vocab_size] / temperature)`` in fp32, read at ``labels``.

    logits: [..., V] (unsharded), labels: [...] integer ids in [0, vocab_size).
    With ``top_k`` / ``top_p`` the distribution is the truncated one (`truncate_reference`),
    and a label outside its kept set gets ``z_label - logsumexp(kept z)`` (finite) and, with
    ``return_kept``, a False flag.
    Returns log-probs [...] fp32, the entropy [...] fp32 of the same distribution
    (``return_entropy``) and the flags [...] bool (``return_kept``). Materialises the full
    fp32 log-softmax; differentiable through autograd.
    """
    v = logits.shape[-1] if vocab_size is None else vocab_size
    z = logits[..., :v].float() / temperature
    z = z - z.amax(dim=-1, keepdim=True).detach()  # as log_softmax does: exact where logits are huge
    kept_z = truncate_reference(z, top_k, top_p)
    lab = labels.long().unsqueeze(-1)
    lp = (z.gather(-1, lab) - torch.logsumexp(kept_z, dim=-1, keepdim=True)).squeeze(-1)
    out = [lp]
    if return_entropy:
        logp = torch.log_softmax(kept_z, dim=-1)
        out.append(-(logp.exp() * logp.masked_fill(torch.isinf(kept_z), 0.0)).sum(-1))
    if return_kept:
        out.append(torch.isfinite(kept_z.gather(-1, lab).squeeze(-1)))
    return out[0] if len(out) == 1 else tuple(out)
