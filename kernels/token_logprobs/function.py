"""Autograd glue shared by the torch and Triton paths: flatten, reduce per shard, merge, save.

A *backend* is a module with ``row_stats`` and ``row_grad`` (see ``cpu.py``); the Triton module
exposes the same two functions.
"""
from __future__ import annotations

import torch

from mcore_rl.kernels.token_logprobs.truncation import Truncation, kept_set, top_candidates
from mcore_rl.kernels.token_logprobs.vocab_parallel import VocabShard, combine_stats


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [N, V] with unit stride along V, as a view whenever the layout allows."""
    x = t.reshape(-1, t.shape[-1])
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x


def forward_stats(backend, x: torch.Tensor, labels: torch.Tensor, shard: VocabShard, temperature: float,
                  need_entropy: bool):
    """Global (max, log-sum, entropy or None, target logit) per row of x: [N, V_local]."""
    return combine_stats(*backend.row_stats(x, labels, shard, temperature, need_entropy), shard, temperature)


def truncated_stats(candidates, shard: VocabShard, trunc: Truncation, temperature: float,
                    row_max, log_sum, ent, tgt, need_entropy: bool):
    """(log_sum, entropy, threshold, kept) of the truncated distribution when ``trunc`` cuts
    anything, else the untruncated (log_sum, ent) with no threshold and kept None."""
    if not trunc.active_for(shard.local_size * shard.world_size):
        return log_sum, ent, None, None
    ks = kept_set(candidates, shard, trunc, temperature, row_max, log_sum, need_entropy)
    return ks.log_sum, ks.entropy, ks.threshold, tgt >= ks.threshold


def outputs(lp, ent, kept, lead, return_entropy: bool, return_kept: bool, ctx):
    """The op's outputs in order: log-probs, entropy (asked for), kept (asked for)."""
    out = [lp.view(lead)]
    if return_entropy:
        out.append(ent.view(lead))
    if return_kept:
        flags = kept.view(lead) if kept is not None else torch.ones(lead, dtype=torch.bool, device=lp.device)
        ctx.mark_non_differentiable(flags)
        out.append(flags)
    return out[0] if len(out) == 1 else tuple(out)


class TokenLogprobsFunction(torch.autograd.Function):
    """logits [..., V_local] -> log p(label) [...] (and entropy [...]) with a recomputing backward."""

    @staticmethod
    def forward(ctx, logits, labels, shard, temperature, return_entropy, inplace_backward, backend,
                trunc=Truncation(), return_kept=False):
        lead = labels.shape
        x = as_rows(logits)
        lab = labels.reshape(-1).contiguous()  # kernels index labels with unit stride
        active = trunc.active_for(shard.local_size * shard.world_size)
        row_max, log_sum, ent, tgt = forward_stats(backend, x, lab, shard, temperature,
                                                   return_entropy and not active)
        log_sum, ent, threshold, kept = truncated_stats(
            lambda k, rows: top_candidates((x if rows is None else x[rows])[:, :shard.n_valid], k),
            shard, trunc, temperature,
            row_max, log_sum, ent, tgt, return_entropy)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, lab, row_max, log_sum, ent, threshold)
        ctx.cfg = (shard, temperature, inplace_backward, backend, return_entropy)
        lp = (tgt - row_max).div_(temperature).sub_(log_sum)
        return outputs(lp, ent, kept, lead, return_entropy, return_kept, ctx)

    @staticmethod
    def backward(ctx, grad_lp, *more):
        logits, lab, row_max, log_sum, ent, threshold = ctx.saved_tensors
        shard, temperature, inplace_backward, backend, return_entropy = ctx.cfg
        grad_ent = more[0] if return_entropy else None  # a kept-flags output has no gradient
        if grad_lp is None and grad_ent is None:
            return (None,) * 9
        x = as_rows(logits)
        if inplace_backward and logits.is_contiguous():
            out = x  # a view of the logits buffer, which becomes the gradient: no second [N, V]
        else:
            out = torch.empty_like(x)
        g_lp = grad_lp.reshape(-1) if grad_lp is not None else None
        g_ent = grad_ent.reshape(-1) if grad_ent is not None else None
        backend.row_grad(x, lab, shard, temperature, row_max, log_sum, ent, g_lp, g_ent, out,
                         threshold=threshold)
        return out.view(logits.shape), None, None, None, None, None, None, None, None
