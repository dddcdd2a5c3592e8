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
    kept_ids: torch.Tensor | None = None,
):
    """``log_softmax(logits[..., :vocab_size] / temperature)`` in fp32, read at ``labels``.

    logits: [..., V] (unsharded), labels: [...] integer ids in [0, vocab_size).
    With ``top_k`` / ``top_p`` the distribution is the truncated one (`truncate_reference`),
    and a label outside its kept set gets ``z_label - logsumexp(kept z)`` (finite) and, with
    ``return_kept``, a False flag. ``kept_ids`` [..., K] (-1 padded) names the kept set
    instead (an engine's sampling mask); a token without any gets 0.
    Returns log-probs [...] fp32, the entropy [...] fp32 of the same distribution
    (``return_entropy``) and the flags [...] bool (``return_kept``). Materialises the full
    fp32 log-softmax; differentiable through autograd.
    """
    v = logits.shape[-1] if vocab_size is None else vocab_size
    z = logits[..., :v].float() / temperature
    z = z - z.amax(dim=-1, keepdim=True).detach()  # as log_softmax does: exact where logits are huge
    if kept_ids is not None:
        ids = kept_ids.long()
        v_all = z.shape[-1]
        inside = torch.zeros(*z.shape[:-1], v_all + 1, dtype=torch.bool, device=z.device)
        inside.scatter_(-1, torch.where(ids >= 0, ids, v_all), True)  # padding into a spare column
        inside = inside[..., :v_all]
        none = ~inside.any(dim=-1, keepdim=True)
        kept_z = z.masked_fill(~inside, float("-inf")).masked_fill(none, 0.0)
        z = z.masked_fill(none, 0.0)
    else:
        kept_z = truncate_reference(z, top_k, top_p)
    lab = labels.long().unsqueeze(-1)
    lp = (z.gather(-1, lab) - torch.logsumexp(kept_z, dim=-1, keepdim=True)).squeeze(-1)
    if kept_ids is not None:
        lp = lp.masked_fill(none.squeeze(-1), 0.0)
    out = [lp]
    if return_entropy:
        logp = torch.log_softmax(kept_z, dim=-1)
        ent = -(logp.exp() * logp.masked_fill(torch.isinf(kept_z), 0.0)).sum(-1)
        out.append(ent.masked_fill(none.squeeze(-1), 0.0) if kept_ids is not None else ent)
    if return_kept:
        flags = torch.isfinite(kept_z.gather(-1, lab).squeeze(-1))
        out.append(flags & ~none.squeeze(-1) if kept_ids is not None else flags)
    return out[0] if len(out) == 1 else tuple(out)
