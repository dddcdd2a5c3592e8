"""A calculator tool environment (the built-in multi-turn task, `mcore_rl.data.calculator_task`).

A turn that ends with ``]`` is a call: the expression after its last ``[`` (digits, ``+``
and ``*``, usual precedence) is evaluated and its value comes back as the observation
(``?`` for anything else). A turn that ends with end-of-sequence is the answer: reward 1 when
its text equals the record's ``answer``, else 0, and the episode ends.
"""
from __future__ import annotations

import re

from mcore_rl.envs.base import ENVIRONMENTS, Environment, EnvStep

_EXPRESSION = re.compile(r"\d+([+*]\d+)*")
MAX_DIGITS = 12
"""Values longer than this answer ``?`` (keeps observations short)."""


def evaluate(expression: str) -> int | None:
    """The value of ``expression`` (non-negative integers joined by + and *), else None."""
    if not _EXPRESSION.fullmatch(expression):
        return None
    return sum(_product(term) for term in expression.split("+"))


def _product(term: str) -> int:
    value = 1
    for factor in term.split("*"):
        value *= int(factor)
    return value


@ENVIRONMENTS.register("calculator")
class CalculatorEnv(Environment):
    """Bracketed calls ``[expr]`` are answered with their value; an end-of-sequence turn is
    the final answer, scored against ``answer``."""

    stop_strings = ("]",)

    def reset(self, prompt_meta: dict) -> None:
        self.answer = str(prompt_meta["answer"])

    def step(self, turn: list[int]) -> EnvStep:
        if turn and turn[-1] == self.tokenizer.eos_id:
            answer = self.tokenizer.decode(turn[:-1]).strip()
            return EnvStep(reward=float(answer == self.answer), done=True)
        text = self.tokenizer.decode(turn)
        value = evaluate(text[text.rfind("[") + 1:-1]) if text.endswith("]") and "[" in text else None
        shown = "?" if value is None or len(str(value)) > MAX_DIGITS else str(value)
        return EnvStep(observation=self.tokenizer.encode(shown))
