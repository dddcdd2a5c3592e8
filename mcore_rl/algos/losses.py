"""Policy and value losses (registry ``POLICY_LOSSES``) and their aggregation, pure torch.

Every loss here returns what `TrainEngine.train_batch` expects from a loss function: the
*sum* of the loss over the micro-batch and the number of units it covers (tokens for
``token_mean``, sequences for ``seq_mean``), so that the engine divides once by the global
count and the result is an exact mean over the whole batch.
"""
from __future__ import annotations

import torch

from mcore_rl.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, units): token_mean -> (sum over tokens, #tokens); seq_mean -> (sum over
    sequences of each sequence's token mean, #sequences with at least one token)."""
    m = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * m).sum(), m.sum()
    if mode == "seq_mean":
        tokens = m.sum(-1)
        real = (tokens > 0).to(per_token.dtype)
        return ((per_token * m).sum(-1) / tokens.clamp(min=1) * real).sum(), real.sum()
    raise ValueError(f"unknown loss aggregation '{mode}' (token_mean, seq_mean)")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate (to minimise), with optional dual clip.

    loss = -min(r A, clip(r, 1-low, 1+high) A); with dual clip c, for A < 0 the loss is
    also bounded by -c A (Ye et al., 2020). Returns (per-token loss, per-token diagnostics).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    clip_frac = (clipped > unclipped).to(loss.dtype)
    return loss, {"clip_fraction": clip_frac, "ratio": ratio.detach()}


@POLICY_LOSSES.register("vanilla_pg")
def vanilla_pg(logprobs, old_logprobs, advantages, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """REINFORCE-style -A log p (on-policy; the ratio is reported, not used)."""
    return -advantages * logprobs, {"clip_fraction": torch.zeros_like(logprobs),
                                    "ratio": torch.exp(logprobs - old_logprobs).detach()}


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> torch.Tensor:
    """Per-token 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2) (PPO's value clipping)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def truncated_importance_weight(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                                cap: float) -> torch.Tensor:
    """min(p_trainer / p_engine, cap) per token: corrects for the trainer/engine mismatch
    of the behaviour policy (truncated importance sampling), no gradient."""
    return torch.exp(old_logprobs - engine_logprobs).clamp(max=cap).detach()
