"""``REWARDS``: reward functions by name; user functions by ``module:function``.

A reward function scores one response::

    def my_reward(prompt: str, response: str, meta: dict) -> float

``prompt``/``response`` are decoded text (token ids travel separately and are never
re-tokenised), ``meta`` the dataset record's reward metadata (e.g. ``meta["answer"]``).
Return a finite number (bool is fine: True -> 1.0).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from mcore_rl.errors import UsageError
from mcore_rl.registry import Registry

RewardFn = Callable[[str, str, dict], float]
REWARDS: Registry = Registry("reward")
REWARDS.refuse("reward_model", "scoring with a trained reward model (reward.reward_model_path) "
               "is not implemented yet; use a rule-based reward (exact, math, reasoning_gym) or "
               "your own function as reward.name=package.module:function")


class RewardError(UsageError):
    """A reward function raised or returned something that is not a finite number."""


def score_all(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
              metas: Sequence[dict]) -> torch.Tensor:
    """[B] float scores; the first bad sample stops everything with a message naming it."""
    name = getattr(fn, "__qualname__", repr(fn))
    scores = []
    for i, (p, r, m) in enumerate(zip(prompts, responses, metas)):
        try:
            value = fn(p, r, m)
        except Exception as err:  # noqa: BLE001 - reported with the sample that caused it
            raise RewardError(f"reward function {name} raised {type(err).__name__}: {err} "
                              f"(sample {i}, response {r[:60]!r}); fix the function or its data") from err
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"reward function {name} returned {value!r} for sample {i}; it must "
                              "return one finite number per response (signature: "
                              "fn(prompt: str, response: str, meta: dict) -> float)")
        scores.append(float(value))
    return torch.tensor(scores, dtype=torch.float32)
