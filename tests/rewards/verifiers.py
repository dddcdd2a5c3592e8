"""Reward functions for the scorer tests, importable by the reward worker processes (so
module level, and no torch import)."""
import asyncio
import os
import signal
import sys
import time

from mcore_rl.rewards import RewardFailure, batched


def length(prompt, response, meta):
    return float(len(response))


def half_length(prompt, response, meta):
    return len(response) / 2


async def slow_async(prompt, response, meta):
    """A remote verifier: waits half a second, then answers."""
    await asyncio.sleep(meta.get("sleep", 0.5))
    return float(len(response))


def busy_loop(prompt, response, meta):
    """CPU-bound pure Python: ``meta["n"]`` iterations."""
    total = 0
    for i in range(meta["n"]):
        total += i % 7
    return float(total % 2)


def sleepy(prompt, response, meta):
    time.sleep(meta.get("sleep", 0.0))
    return float(len(response))


def dies_on_request(prompt, response, meta):
    """Kills its own process (as the OOM killer would) for the sample that asks."""
    if meta.get("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    return float(len(response))


def fails_on_request(prompt, response, meta):
    if meta.get("fail"):
        raise RewardFailure("this response cannot be checked")
    return 1.0


def raises_on_request(prompt, response, meta):
    if meta.get("raise"):
        raise KeyError("answer")
    return 1.0


def nan_on_request(prompt, response, meta):
    return float("nan") if meta.get("nan") else 1.0


def faulty(prompt, response, meta):
    """1.0, or the fault ``meta["fault"]`` names: raise, nan, inf, text (a string), hang (30
    s), die (its process killed), fail (`RewardFailure`: the response's, not a fault)."""
    fault = meta.get("fault")
    if fault == "raise":
        raise KeyError("answer")
    if fault == "hang":
        time.sleep(30.0)
    if fault == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "fail":
        raise RewardFailure("this response cannot be checked")
    return {"nan": float("nan"), "inf": float("inf"), "text": "1.0"}.get(fault, 1.0)


async def async_raises(prompt, response, meta):
    if meta.get("raise"):
        raise ValueError("bad\nrecord")
    return 1.0


@batched
def batched_length(prompts, responses, metas):
    return [float(len(r)) for r in responses]


@batched
def batched_one_short(prompts, responses, metas):
    return [1.0] * (len(responses) - 1)


@batched
def batched_inf_at_2(prompts, responses, metas):
    return [float("inf") if i == 2 else 1.0 for i in range(len(responses))]


def torch_loaded(prompt, response, meta):
    return float("torch" in sys.modules)
