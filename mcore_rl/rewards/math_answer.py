"""Rule-based answer checking: the last number (or a \\boxed{} answer) against the reference."""
from __future__ import annotations

import re
from fractions import Fraction

from mcore_rl.rewards.registry import REWARDS

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> str | None:
    """The content of the last \\boxed{}, else the last number in the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    a, b = _as_number(predicted), _as_number(str(reference))
    if a is not None and b is not None:
        return a == b
    return predicted.strip() == str(reference).strip()


@REWARDS.register("math")
def math_reward(prompt: str, response: str, meta: dict) -> float:
    """1.0 when the response's final answer equals ``meta["answer"]`` numerically, else 0.0."""
    return 1.0 if answers_match(extract_answer(response), meta["answer"]) else 0.0


@REWARDS.register("exact", aliases=("builtin",))
def exact_reward(prompt: str, response: str, meta: dict) -> float:
    """1.0 when the stripped response equals ``meta["answer"]`` exactly."""
    return 1.0 if response.strip() == str(meta["answer"]).strip() else 0.0


@REWARDS.register("env", aliases=("none",))
def no_reward(prompt: str, response: str, meta: dict) -> float:
    """0 for every response: with an environment (``environment.name``) the score is the sum
    of its rewards alone."""
    return 0.0
