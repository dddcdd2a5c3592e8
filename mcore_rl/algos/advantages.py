"""Advantage estimators (registry ``ADVANTAGE_ESTIMATORS``), pure torch.

Legend: B sequences, T tokens. Inputs follow the batch conventions of ``mcore_rl.data.batch``:
``token_rewards`` [B, T] is 0 except on the last response token (plus per-token KL penalties
when KL is applied in the reward), ``response_mask`` [B, T], ``values`` [B, T] (critic output
aligned to the token it precedes), ``group_id`` [B] (sequences sampled from one prompt).

Every estimator sees the *whole* rollout batch (every rank holds it), so group and whitening
statistics are global by construction, however the batch is later split over DP ranks.
Returns (advantages [B, T], returns [B, T]), 0 outside the response.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
"""Name -> ``fn(AdvantageInputs, gamma=, lam=, whiten=) -> (advantages, returns)``; metadata
``needs_critic`` (True: the run builds a critic and passes its values)."""


@dataclass
class AdvantageInputs:
    token_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_id: torch.Tensor
    values: torch.Tensor | None = None


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the tokens where ``mask`` is 1; 0 elsewhere."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * m


def group_stats(scores: torch.Tensor, group_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group mean, group std (unbiased; 0 for singletons), group size)."""
    _, inverse, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = (sums / counts)[inverse]
    sq = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, (scores - mean) ** 2)
    denom = (counts - 1).clamp(min=1).to(scores.dtype)
    std = torch.where(counts > 1, (sq / denom).sqrt(), torch.zeros_like(denom))[inverse]
    return mean, std, counts[inverse]


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq[:, None] * mask.to(per_seq.dtype)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(x: AdvantageInputs, gamma: float = 1.0, lam: float = 1.0, whiten: bool = False,
         eps: float = 1e-6):
    """GRPO: (score - group mean) / (group std + eps) on every response token."""
    scores = x.token_rewards.sum(-1)
    mean, std, _ = group_stats(scores, x.group_id)
    adv = _broadcast((scores - mean) / (std + eps), x.response_mask)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(x: AdvantageInputs, gamma: float = 1.0, lam: float = 1.0, whiten: bool = False):
    """RLOO: score minus the mean score of the *other* samples of the same prompt."""
    scores = x.token_rewards.sum(-1)
    mean, _, n = group_stats(scores, x.group_id)
    n = n.to(scores.dtype)
    others = torch.where(n > 1, (mean * n - scores) / (n - 1).clamp(min=1), torch.zeros_like(scores))
    adv = _broadcast(torch.where(n > 1, scores - others, torch.zeros_like(scores)), x.response_mask)
    return adv, adv.clone()


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_t' over valid steps (t' the next valid step), 0 on masked steps."""
    from mcore_rl.kernels import gae

    # With V = 0 and lambda = 1, GAE's advantage is exactly the discounted return.
    advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(x: AdvantageInputs, gamma: float = 1.0, lam: float = 1.0,
                        whiten: bool = True):
    """REINFORCE++: per-token discounted returns, whitened over all response tokens."""
    returns = discounted_returns(x.token_rewards.float(), x.response_mask, gamma)
    return masked_whiten(returns, x.response_mask), returns


@ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True)
def gae_estimator(x: AdvantageInputs, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True):
    """PPO's GAE over response tokens with the critic's values (``kernels.gae``)."""
    from mcore_rl.kernels import gae

    if x.values is None:
        raise ValueError("the gae advantage estimator needs critic values (PPO with a critic)")
    adv, returns = gae(x.token_rewards.float(), x.values.float(), x.response_mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, x.response_mask)
    return adv, returns


def needs_critic(name: str) -> bool:
    """Whether the estimator ``name`` uses critic values (its ``needs_critic`` metadata)."""
    return bool(ADVANTAGE_ESTIMATORS.meta(name, "needs_critic", False))
