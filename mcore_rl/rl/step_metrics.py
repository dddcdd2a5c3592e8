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
        "response/truncation_rate": batch["truncated"].float().mean().item(),
        "data/filtered_prompts": float(batch.info.get("filtered_prompts", 0)),
        "algo/kl_coef": state.kl.coef,
    }
    if "ref_logprobs" in batch:
        kl = kl_per_token(batch.policy_logprobs, batch["ref_logprobs"], state.cfg.algorithm.kl_estimator)
        out["actor/kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).item()
    return out


@torch.no_grad()
def validation_score(state) -> float:
    """Mean reward of greedy responses to the validation prompts."""
    from mcore_rl.rl import phases

    batch = phases.generate(state, state.val_records, greedy=True)
    batch = phases.score(state, batch)
    return batch["scores"].mean().item()
