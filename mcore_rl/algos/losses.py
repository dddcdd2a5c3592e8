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


def truncated_importance_weight(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                                cap: float) -> torch.Tensor:
    """w = min(p / p_behav, cap) = min(exp(logprobs - behaviour_logprobs), cap) per token,
    detached (no gradient flows through the weight)."""
    return torch.exp(logprobs - behaviour_logprobs).clamp(max=cap).detach()


def importance_weight_capped(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                             cap: float) -> torch.Tensor:
    """1.0 where p / p_behav = exp(logprobs - behaviour_logprobs) > cap (the weight of
    `truncated_importance_weight` was cut to the cap), else 0.0; no gradient."""
    ratio = torch.exp((logprobs - behaviour_logprobs).detach())
    return (ratio > cap).to(ratio.dtype)


def decoupled_ppo(per_token_loss: torch.Tensor, diag: dict[str, torch.Tensor],
                  prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al., 2021, "Batch size-invariance for policy optimization";
    AReaL): the behaviour correction of a surrogate taken against the proximal policy.

    ``per_token_loss`` is the configured policy loss with ratio r = pi_theta / pi_prox
    (``old_logprobs`` = ``prox_logprobs``: PPO's clip keeps pi_theta near pi_prox); each
    token's loss is multiplied by w = min(pi_prox / pi_behav, cap), a constant:

        loss = w * (-min(r A, clip(r, 1-low, 1+high) A)),   w = sg(min(pi_prox / pi_behav, C)).

    Returns (per-token loss, ``diag`` plus ``is_weight`` (w) and ``is_capped`` (1 where
    pi_prox / pi_behav > C)).
    """
    w = truncated_importance_weight(prox_logprobs, behaviour_logprobs, cap)
    capped = importance_weight_capped(prox_logprobs, behaviour_logprobs, cap)
    return per_token_loss * w, {**diag, "is_weight": w, "is_capped": capped}


def tis_policy_gradient(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        advantages: torch.Tensor, cap: float
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling against the behaviour policy, no proximal clipping:

        loss = -A * sg(min(pi_theta / pi_behav, C)) * log pi_theta,
        grad = -A * min(pi_theta / pi_behav, C) * grad log pi_theta   (sg: stop-gradient).

    Returns (per-token loss, diagnostics): ``is_weight`` (the weight), ``is_capped`` and
    ``clip_fraction`` (both 1 where pi_theta / pi_behav > C).
    """
    w = truncated_importance_weight(logprobs.detach(), behaviour_logprobs, cap)
    capped = importance_weight_capped(logprobs, behaviour_logprobs, cap)
    return -advantages * w * logprobs, {"clip_fraction": capped, "is_weight": w, "is_capped": capped}


def ratio_band_mask(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, low: float,
                    high: float) -> torch.Tensor:
    """1.0 where low <= pi / pi_behav <= high, else 0.0; no gradient."""
    ratio = torch.exp((logprobs - behaviour_logprobs).detach())
    return ((ratio >= low) & (ratio <= high)).to(ratio.dtype)


def icepop(per_token_loss: torch.Tensor, diag: dict[str, torch.Tensor], logprobs: torch.Tensor,
           behaviour_logprobs: torch.Tensor, low: float, high: float
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IcePop: a token whose r = pi_theta / pi_behav lies outside [low, high] gets no gradient
    (its loss is multiplied by 0; it still counts in the mean); the others keep the
    configured loss unchanged:

        loss_t = 1[low <= sg(r_t) <= high] * loss_t.

    Returns (per-token loss, ``diag`` plus ``is_masked``: 1 where the token was masked)."""
    keep = ratio_band_mask(logprobs, behaviour_logprobs, low, high)
    return per_token_loss * keep, {**diag, "is_masked": 1.0 - keep}


def masked_importance_sampling(per_token_loss: torch.Tensor, diag: dict[str, torch.Tensor],
                               logprobs: torch.Tensor, prox_logprobs: torch.Tensor,
                               behaviour_logprobs: torch.Tensor, mask: torch.Tensor, low: float,
                               high: float, level: str = "token"
                               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling: the behaviour correction of `decoupled_ppo`, with weights
    that leave the trusted range set to 0 instead of truncated. With r_t = pi_theta / pi_behav:

    - ``level="token"``: a token with r_t > high is masked;
    - ``level="sequence"``: a sequence whose geometric-mean ratio exp(mean_t log r_t) over its
      response tokens (``mask``) lies outside [low, high] is masked whole;

        loss_t = keep_t * sg(pi_prox / pi_behav) * loss_t.

    Returns (per-token loss, ``diag`` plus ``is_weight`` (the weight, 0 where masked) and
    ``is_masked``)."""
    log_r = (logprobs - behaviour_logprobs).detach()
    if level == "token":
        keep = (log_r.exp() <= high).to(log_r.dtype)
    elif level == "sequence":
        m = mask.to(log_r.dtype)
        geometric = ((log_r * m).sum(-1) / m.sum(-1).clamp(min=1)).exp()
        keep = ((geometric >= low) & (geometric <= high)).to(log_r.dtype).unsqueeze(-1)
        keep = keep.expand_as(log_r)
    else:
        raise ValueError(f"unknown masked-importance-sampling level {level!r} (token, sequence)")
    weight = torch.exp((prox_logprobs - behaviour_logprobs).detach()) * keep
    return per_token_loss * weight, {**diag, "is_weight": weight, "is_masked": 1.0 - keep}


MISMATCH_BAND = (0.9, 1.1)
"""Ratios exp(log p_trainer - log p_engine) outside this band count as mismatched tokens."""


def mismatch_sums(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the tokens of ``mask`` (those generated by the weights the trainer
    evaluates) of how the trainer's and the engine's log-probs of the sampled tokens differ,
    d = |log p_trainer - log p_engine|: the count, sum of exp(d) (NeMo-RL's token
    multiplicative probability error, >= 1 per token), sum of d, tokens whose ratio leaves
    `MISMATCH_BAND`; and two maxima (names ending ``_max``): the largest d, and the largest
    per-sequence mean of exp(d). Means are the sums over the count (`mismatch_metrics`)."""
    m = mask.to(torch.float64)
    d = (trainer_logprobs.detach() - engine_logprobs.detach()).abs().to(torch.float64) * m
    mult = torch.exp(d) * m
    ratio = torch.exp(trainer_logprobs.detach().double() - engine_logprobs.detach().double())
    low, high = MISMATCH_BAND
    outside = (((ratio < low) | (ratio > high)).to(torch.float64) * m)
    tokens = m.sum(-1)
    seq = mult.sum(-1) / tokens.clamp(min=1)
    return {"mismatch_tokens": m.sum(), "mismatch_mult_sum": mult.sum(), "mismatch_abs_sum": d.sum(),
            "mismatch_outside": outside.sum(), "mismatch_abs_max": d.max() if d.numel() else d.sum(),
            "mismatch_seq_mult_max": seq[tokens > 0].max() if bool((tokens > 0).any())
            else torch.zeros((), dtype=torch.float64)}


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``rollout/*`` metrics from `mismatch_sums` added up over a step ({} without tokens),
    and ``rollout/outside_kept_set``, the fraction of response tokens outside the trainer's
    kept set of a truncated distribution (when the loss reported it)."""
    out = {}
    if sums.get("mismatch_response_tokens"):
        out["rollout/outside_kept_set"] = sums["mismatch_outside_kept"] / sums["mismatch_response_tokens"]
    n = sums.get("mismatch_tokens", 0.0)
    if not n:
        return out
    return {**out, "rollout/token_mult_prob_error": sums["mismatch_mult_sum"] / n,
            "rollout/logprob_abs_diff_mean": sums["mismatch_abs_sum"] / n,
            "rollout/logprob_abs_diff_max": sums["mismatch_abs_max"],
            "rollout/ratio_outside_band_frac": sums["mismatch_outside"] / n,
            "rollout/seq_mult_prob_error_max": sums["mismatch_seq_mult_max"],
            "rollout/mismatch_tokens": n}
