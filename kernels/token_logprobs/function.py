"""Autograd glue shared by the torch and Triton paths: flatten, reduce per shard, merge, save.

A *backend* is a module with ``row_stats`` and ``row_grad`` (see ``cpu.py``); the Triton module
exposes the same two functions.
"""
from __future__ import annotations

import torch

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


class TokenLogprobsFunction(torch.autograd.Function):
    """logits [..., V_local] -> log p(label) [...] (and entropy [...]) with a recomputing backward."""

    @staticmethod
    def forward(ctx, logits, labels, shard, temperature, return_entropy, inplace_backward, backend):
        lead = labels.shape
        x = as_rows(logits)
        lab = labels.reshape(-1).contiguous()  # kernels index labels with unit stride
        row_max, log_sum, ent, tgt = forward_stats(backend, x, lab, shard, temperature, return_entropy)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, lab, row_max, log_sum, ent)
        ctx.cfg = (shard, temperature, inplace_backward, backend)
        lp = (tgt - row_max).div_(temperature).sub_(log_sum).view(lead)
        if return_entropy:
            return lp, ent.view(lead)
        return lp

    @staticmethod
    def backward(ctx, grad_lp, grad_ent=None):
        logits, lab, row_max, log_sum, ent = ctx.saved_tensors
        shard, temperature, inplace_backward, backend = ctx.cfg
        if grad_lp is None and grad_ent is None:
            return (None,) * 7
        x = as_rows(logits)
        if inplace_backward and logits.is_contiguous():
            out = x  # a view of the logits buffer, which becomes the gradient: no second [N, V]
        else:
            out = torch.empty_like(x)
        g_lp = grad_lp.reshape(-1) if grad_lp is not None else None
        g_ent = grad_ent.reshape(-1) if grad_ent is not None else None
        backend.row_grad(x, lab, shard, temperature, row_max, log_sum, ent, g_lp, g_ent, out)
        return out.view(logits.shape), None, None, None, None, None, None
