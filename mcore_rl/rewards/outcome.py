"""What one reward call gave (`Outcome`): scores, a failure the function reported for the
response, or a fault of the reward itself.

The same classification runs in this process, in the event loop (async functions) and in
the worker processes (`mcore_rl.rewards.pool_worker`), so every path reports alike.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from mcore_rl.rewards.registry import RewardFailure, RewardTimeout, as_score, first_line, short_repr

FAULTS = ("overtime", "died", "raised", "invalid", "length")
"""Kinds that are faults of the reward, not of the response: they count against
``reward.max_failure_fraction`` (`RewardFailure` and `RewardTimeout` do not)."""


@dataclass(frozen=True)
class Outcome:
    """One call's result.

    kind: ``ok`` (``value``: the score, or the list of scores of a batched call);
    ``failure`` / ``timeout``: the function raised `RewardFailure` / `RewardTimeout` (the
    response cannot be scored); or one of `FAULTS`: ``overtime`` (the call ran past
    ``reward.timeout_s``), ``died`` (the worker process running it died), ``raised``
    (``message``: the exception), ``invalid`` (``message``: the first value that is not a
    finite number, ``offset``: its place in a batched call, ``value``: a batched call's
    scores, None where not a finite number), ``length`` (a batched call returned the wrong
    number of scores). Every sample not scored scores ``reward.failure_score``."""

    kind: str
    value: Any = None
    message: str = ""
    offset: int = 0

    def unscored(self, size: int) -> int:
        """How many of the call's ``size`` samples it gave no score."""
        if self.kind == "ok":
            return 0
        if isinstance(self.value, list):
            return sum(v is None for v in self.value)
        return size

    def faults(self, size: int) -> int:
        """How many of the call's ``size`` samples failed by a fault of the reward."""
        return self.unscored(size) if self.kind in FAULTS else 0


def raised(err: BaseException) -> Outcome:
    if isinstance(err, RewardTimeout):
        return Outcome("timeout", message=first_line(err))
    if isinstance(err, RewardFailure):
        return Outcome("failure", message=first_line(err))
    return Outcome("raised", message=f"raised {type(err).__name__}: {first_line(err)}")


def checked(value: Any, expect: int | None) -> Outcome:
    """The return ``value`` of a call: one score (``expect`` None) or ``expect`` of them."""
    if expect is None:
        score = as_score(value)
        return Outcome("ok", score) if score is not None else \
            Outcome("invalid", message=f"returned {short_repr(value)}")
    try:
        values = list(value)
    except TypeError:
        return Outcome("length", message=f"returned {short_repr(value)}, not a list of {expect} scores")
    if len(values) != expect:
        return Outcome("length", message=f"returned {len(values)} scores for {expect} responses")
    scores = [as_score(v) for v in values]
    if None in scores:
        j = scores.index(None)
        return Outcome("invalid", scores, message=f"returned {short_repr(values[j])}", offset=j)
    return Outcome("ok", scores)


def call(fn: Callable, args: tuple, expect: int | None = None) -> Outcome:
    """Call a synchronous reward function; ``expect``: the batch size of a batched call."""
    try:
        value = fn(*args)
    except Exception as err:  # noqa: BLE001 - classified and reported with its sample
        return raised(err)
    return checked(value, expect)


async def call_async(fn: Callable, args: tuple, timeout_s: float) -> Outcome:
    """Await an ``async def`` reward function, within ``timeout_s`` (0: no limit)."""
    try:
        async with asyncio.timeout(timeout_s or None) as limit:
            value = await fn(*args)
    except TimeoutError as err:
        if limit.expired():
            return Outcome("overtime",
                           message=f"took longer than {timeout_s:g} s (reward.timeout_s)")
        return raised(err)
    except Exception as err:  # noqa: BLE001 - classified and reported with its sample
        return raised(err)
    return checked(value, None)
