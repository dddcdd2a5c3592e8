"""The actor and critic objectives as `TrainEngine` loss functions.

A loss function gets the engine's per-token outputs for one micro-batch (``logprobs`` and
``entropy`` of the actor, or ``values`` of the critic) and the micro-batch itself (with the
rollout fields ``old_logprobs``, ``advantages``, ``returns``, ``ref_logprobs``,
``rollout_logprobs`` (the engine's), ``old_values``), and returns (summed loss, units, summed metrics).
"""
from __future__ import annotations

from typing import Callable

import torch

from mcore_rl.algos.kl import kl_per_token
from mcore_rl.algos.losses import (POLICY_LOSSES, aggregate, clipped_value_loss, decoupled_ppo,
                                   icepop, masked_importance_sampling, tis_policy_gradient)
from mcore_rl.config import AlgorithmConfig


def actor_loss_fn(cfg: AlgorithmConfig, kl_coef: float) -> Callable:
    """Policy loss (+ KL-to-reference loss when ``kl_in_reward`` is off, - entropy bonus).

    ``off_policy_correction`` (``algorithm``): none: the configured policy loss against
    ``old_logprobs``; decoupled_ppo: that loss (against the proximal policy, ``old_logprobs``)
    times min(pi_prox / pi_behav, is_cap); tis: the truncated-importance-sampling policy
    gradient against the behaviour policy in place of the configured loss; icepop: the
    configured loss, with no gradient for tokens whose pi_theta / pi_behav leaves
    [is_mask_low, is_mask_high]; mis: decoupled_ppo's weight pi_prox / pi_behav, set to 0 for
    tokens (``mis_level: token``: pi_theta / pi_behav > is_mask_high) or whole sequences
    (``sequence``: their geometric-mean ratio outside the band) instead of truncated. Every
    correction reads the behaviour policy's log-probs from ``rollout_logprobs``.
    """
    policy_loss = POLICY_LOSSES.get(cfg.policy_loss)
    correction = cfg.off_policy_correction

    def loss_fn(outputs: dict, mb) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb["response_mask"].float()
        logprobs = outputs["logprobs"]
        if correction != "none" and "rollout_logprobs" not in mb:
            raise ValueError(
                f"algorithm.off_policy_correction={correction} needs the behaviour policy's "
                "log-probs, the batch field 'rollout_logprobs', which this micro-batch lacks; "
                "use an engine that records them or set algorithm.off_policy_correction=none")
        if correction == "tis":
            per_token, diag = tis_policy_gradient(logprobs, mb["rollout_logprobs"],
                                                  mb["advantages"], cfg.is_cap)
            diag["ratio"] = torch.exp(logprobs - mb["old_logprobs"]).detach()
        else:
            per_token, diag = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"],
                                          clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
                                          dual_clip=cfg.dual_clip)
            if correction == "decoupled_ppo":
                per_token, diag = decoupled_ppo(per_token, diag, mb["old_logprobs"],
                                                mb["rollout_logprobs"], cfg.is_cap)
            elif correction == "icepop":
                per_token, diag = icepop(per_token, diag, logprobs, mb["rollout_logprobs"],
                                         cfg.is_mask_low, cfg.is_mask_high)
            elif correction == "mis":
                per_token, diag = masked_importance_sampling(
                    per_token, diag, logprobs, mb["old_logprobs"], mb["rollout_logprobs"], mask,
                    cfg.is_mask_low, cfg.is_mask_high, cfg.mis_level)
        metrics = {}
        if "rollout_logprobs" in mb:
            gap = (mb["old_logprobs"] - mb["rollout_logprobs"]).abs()
            metrics["engine_logprob_gap"] = aggregate(gap, mask, cfg.loss_aggregation)[0]
        if "is_weight" in diag:
            metrics["is_weight"] = aggregate(diag["is_weight"], mask, cfg.loss_aggregation)[0]
        if "is_capped" in diag:
            metrics["is_capped_fraction"] = aggregate(diag["is_capped"], mask,
                                                      cfg.loss_aggregation)[0]
        if "is_masked" in diag:
            metrics["is_masked_fraction"] = aggregate(diag["is_masked"], mask,
                                                      cfg.loss_aggregation)[0]
        if kl_coef > 0 and not cfg.kl_in_reward:
            kl = kl_per_token(logprobs, mb["ref_logprobs"], cfg.kl_estimator)
            per_token = per_token + kl_coef * kl
            metrics["kl_loss"] = aggregate(kl.detach(), mask, cfg.loss_aggregation)[0]
        if cfg.entropy_coef and "entropy" in outputs:
            per_token = per_token - cfg.entropy_coef * outputs["entropy"]
        total, units = aggregate(per_token, mask, cfg.loss_aggregation)
        metrics["clip_fraction"] = aggregate(diag["clip_fraction"], mask, cfg.loss_aggregation)[0]
        metrics["ratio_abs_dev"] = aggregate((diag["ratio"] - 1).abs(), mask, cfg.loss_aggregation)[0]
        if "entropy" in outputs:
            metrics["entropy"] = aggregate(outputs["entropy"].detach(), mask, cfg.loss_aggregation)[0]
        return total, units, metrics

    return loss_fn


def critic_loss_fn(cfg: AlgorithmConfig) -> Callable:
    """Clipped value loss against the GAE returns."""

    def loss_fn(outputs: dict, mb) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb["response_mask"].float()
        per_token = clipped_value_loss(outputs["values"], mb["old_values"], mb["returns"],
                                       cfg.value_clip)
        total, units = aggregate(per_token, mask, cfg.loss_aggregation)
        return total, units, {}

    return loss_fn
