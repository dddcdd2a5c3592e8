"""``REWARDS``: reward functions by name; user functions by ``module:function``.

A reward function has one of three forms::

    def my_reward(prompt: str, response: str, meta: dict) -> float          # per sample

    async def my_reward(prompt: str, response: str, meta: dict) -> float    # per sample, async

    @batched
    def my_reward(prompts: list[str], responses: list[str], metas: list[dict]) -> list[float]

``prompt``/``response`` are decoded text (token ids travel separately and are never
re-tokenised), ``meta`` the dataset record's reward metadata (e.g. ``meta["answer"]``).
Return a finite number per response (bool is fine: True -> 1.0). A batched function is
declared by the `batched` marker only (not by its parameter names), so a per-sample
function is never called with lists by accident. `mcore_rl.rewards.RewardScorer` runs all
three (async ones concurrently, synchronous ones in worker processes if configured).

A function that cannot score a response for a reason of the response's own (a program that
crashes) raises `RewardFailure` (`RewardTimeout` when it ran out of time): the sample then
scores ``reward.failure_score`` and is counted. Any other exception, or a return that is not
a finite number, is a fault of the function: the sample scores ``reward.failure_score`` too
and is counted (``reward/errors``, ``reward/nonfinite``), and once more than
``reward.max_failure_fraction`` of a batch has failed so, scoring stops (`RewardError`).

A registered entry may carry ``prepare=f`` in its metadata: ``f(fn, reward_config)`` is
called once when a scorer is built, checks what the function needs (refusing with a
`UsageError`) and returns the function to call (e.g. with its limits bound).

This module and the rest of ``mcore_rl.rewards`` import no torch at module level: the
reward worker processes import them and start fast.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Sequence

from mcore_rl.errors import UsageError
from mcore_rl.registry import Registry

RewardFn = Callable[[str, str, dict], float]
REWARDS: Registry = Registry("reward")

SIGNATURES = ("signature: fn(prompt: str, response: str, meta: dict) -> float; a function "
              "marked @mcore_rl.rewards.batched takes lists and returns one score per response")


class RewardError(UsageError):
    """A reward function failed on more than ``reward.max_failure_fraction`` of a batch
    (`score_all`: on one sample), or a batch to score is malformed."""


class RewardFailure(Exception):
    """Raised by a reward function for a response it cannot score (e.g. a program that
    crashes): the sample scores ``reward.failure_score`` and counts in ``reward/failures``."""


class RewardTimeout(RewardFailure):
    """A `RewardFailure` for running out of time: counts in ``reward/timeouts``."""


def batched(fn: Callable) -> Callable:
    """Mark ``fn`` as batched: ``fn(prompts, responses, metas) -> list[float]``, one call per
    batch (per chunk of it with ``reward.workers``) instead of one per sample."""
    fn.reward_batched = True
    return fn


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` (or the function a `functools.partial` wraps) is marked `batched`."""
    while isinstance(fn, partial):
        fn = fn.func
    return bool(getattr(fn, "reward_batched", False))


def function_name(fn: Callable) -> str:
    """The name errors give for a reward function."""
    while isinstance(fn, partial):
        fn = fn.func
    return getattr(fn, "__qualname__", repr(fn))


def as_score(value) -> float | None:
    """``value`` as a float if it is one finite number (bool, int, float, a 1-element tensor
    or array), else None."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def short_repr(value, limit: int = 80) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def score_all(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
              metas: Sequence[dict]):
    """[B] float scores of a per-sample function, in this process, one sample after another;
    the first bad sample stops everything with a message naming it. (`RewardScorer` runs
    every kind of function, in parallel where configured.)"""
    import torch

    name = function_name(fn)
    scores = []
    for i, (p, r, m) in enumerate(zip(prompts, responses, metas)):
        try:
            value = fn(p, r, m)
        except Exception as err:  # noqa: BLE001 - reported with the sample that caused it
            raise RewardError(f"reward function {name} raised {type(err).__name__}: "
                              f"{first_line(err)} (sample {i}, response {r[:60]!r}); fix the "
                              "function or its data") from err
        score = as_score(value)
        if score is None:
            raise RewardError(f"reward function {name} returned {short_repr(value)} for sample "
                              f"{i}; it must return one finite number per response ({SIGNATURES})")
        scores.append(score)
    return torch.tensor(scores, dtype=torch.float32)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (errors are reported on one line)."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""
