"""``reshard.verify``: after a sync, the engine and the trainer must agree on log-probs.

It lives with the RL phases because it needs both sides: the rollout engine and the
trainer's `TrainEngine`.

The controller's engine samples a fixed probe batch (fixed prompts and seed) at the rollout
temperature, returning its per-token log-probs; every trainer rank then computes the
log-probs of the same sequences with the `TrainEngine` (same convention:
``log_softmax(logits / T)``, untruncated unless a top-k / top-p is given, which both sides
then apply), and the largest difference over response tokens must stay within
``reshard.verify_tolerance``. A wrong weight (a swapped shard, a stale
layer, a missed bucket) moves log-probs by far more than numerical noise: fp32 engine and
trainer on CPU agree to ~1e-5; in bf16 single tokens differ by up to a few 1e-1 (measured
0.24 on SmolLM2-135M, mean 0.07), from rounding of the logits themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.wire import WeightSyncError


class LogprobMismatchError(WeightSyncError):
    """Engine and trainer log-probs differ by more than the tolerance after a sync."""


@dataclass
class VerifyReport:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    temperature: float
    version: int | None
    outside_kept: int = 0
    """Probe tokens outside the trainer's kept set of a truncated distribution (not compared)."""


def probe_prompts(vocab_size: int, count: int = 2, length: int = 8, seed: int = 0) -> list[list[int]]:
    """Fixed pseudo-random prompts (ids >= 3, clear of the usual special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=g).tolist()


@torch.no_grad()
def verify_engine_logprobs(train_engine, engine, prompts: list[list[int]], *, temperature: float,
                           tolerance: float, max_new_tokens: int = 16, seed: int = 0,
                           controller: int = 0, group=None, top_k: int = -1,
                           top_p: float = 1.0) -> VerifyReport:
    """Compare engine and trainer log-probs on the probe (collective; ``engine`` is used on
    the controller only). Raises `LogprobMismatchError` on every rank above ``tolerance``."""
    from mcore_rl.engines.base import SamplingConfig

    temperature = temperature or 1.0
    box = [None]
    if dist.get_rank() == controller:
        rollouts = engine.generate(prompts, SamplingConfig(
            temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, top_k=top_k,
            top_p=top_p))
        box = [(rollouts, engine.weight_version)]
    dist.broadcast_object_list(box, src=controller, group=group)
    rollouts, version = box[0]
    batch = rollouts.to_batch()
    truncation = {"top_k": top_k, "top_p": top_p} if top_k > 0 or top_p < 1 else {}
    out = train_engine.forward(batch, temperature=temperature, **truncation)
    response = batch["response_mask"].bool()
    mask = response & out["kept"].bool() if "kept" in out else response
    diff = (out["logprobs"] - batch["rollout_logprobs"]).abs()[mask]
    report = VerifyReport(diff.max().item(), diff.mean().item(), int(mask.sum()), temperature,
                          version, int((response & ~mask).sum()))
    if not report.max_abs_diff <= tolerance:  # NaN fails too
        raise LogprobMismatchError(
            f"after the sync to weight version {version}, engine and trainer log-probs differ "
            f"by up to {report.max_abs_diff:.3g} (mean {report.mean_abs_diff:.3g}) over "
            f"{report.tokens} probe tokens at temperature {temperature}; tolerance "
            f"{tolerance:g} (reshard.verify_tolerance): the engine does not hold the trainer's "
            "weights")
    return report
