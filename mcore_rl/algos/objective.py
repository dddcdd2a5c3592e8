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
from mcore_rl.algos.losses import (POLICY_LOSSES, aggregate, clipped_value_loss,
                                   truncated_importance_weight)
from mcore_rl.config import AlgorithmConfig


def actor_loss_fn(cfg: AlgorithmConfig, kl_coef: float) -> Callable:
    """Policy loss (+ KL-to-reference loss when ``kl_in_reward`` is off, - entropy bonus)."""
    policy_loss = POLICY_LOSSES.get(cfg.policy_loss)

    def loss_fn(outputs: dict, mb) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb["response_mask"].float()
        logprobs = outputs["logprobs"]
        per_token, diag = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"],
                                      clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
                                      dual_clip=cfg.dual_clip)
        metrics = {}
        if "rollout_logprobs" in mb:
            if cfg.tis_cap is not None:
                per_token = per_token * truncated_importance_weight(
                    mb["old_logprobs"], mb["rollout_logprobs"], cfg.tis_cap)
            gap = (mb["old_logprobs"] - mb["rollout_logprobs"]).abs()
            metrics["engine_logprob_gap"] = aggregate(gap, mask, cfg.loss_aggregation)[0]
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
