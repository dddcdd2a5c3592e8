"""Per-step rollout statistics and the greedy validation score."""
from __future__ import annotations

import torch

from mcore_rl.algos import kl_per_token


def rollout_metrics(state, batch) -> dict[str, float]:
    mask = batch["response_mask"].float()
    resp_len = batch["response_mask"].sum(-1).float()
    out = {
        "reward/mean": batch["scores"].mean().item(),
        "reward/std": batch["scores"].std().item() if len(batch) > 1 else 0.0,
        "response/length": resp_len.mean().item(),
        "response/length_p50": resp_len.quantile(0.5, interpolation="lower").item(),
        "response/length_p90": resp_len.quantile(0.9, interpolation="lower").item(),
        "response/length_max": resp_len.max().item(),
        "response/truncation_rate": batch["truncated"].float().mean().item(),
        "data/filtered_prompts": float(batch.info.get("filtered_prompts", 0)),
        "algo/kl_coef": state.kl.coef,
    }
    if "turns" in batch.meta:  # multi-turn episodes
        out["response/turns"] = sum(batch.meta["turns"]) / len(batch)
    out |= {k: float(v) for k, v in batch.info.items() if k.startswith("reward/")}  # RewardScorer's
    if "ref_logprobs" in batch:
        kl = kl_per_token(batch.policy_logprobs, batch["ref_logprobs"], state.cfg.algorithm.kl_estimator)
        out["actor/kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).item()
    return out


@torch.no_grad()
def validation_metrics(state) -> dict[str, float]:
    """``val/score``: the mean reward of greedy responses to the validation prompts; and
    ``state.val_metrics`` of the same responses, if any (e.g. ``val/rm_score``)."""
    from mcore_rl.rl import phases

    batch = phases.generate(state, state.val_records, greedy=True)
    metrics = {"val/score": phases.score(state, batch)["scores"].mean().item()}
    if state.val_metrics is not None:
        more = state.val_metrics(batch) if state.is_controller else None
        metrics |= state.ctx.broadcast_object(more)
    return metrics


def validation_score(state) -> float:
    """Mean reward of greedy responses to the validation prompts."""
    return validation_metrics(state)["val/score"]
