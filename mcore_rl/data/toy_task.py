"""The built-in quick-start task: single-digit addition with a character tokenizer.

Prompt ``"3+4="``, answer ``"7"`` (then the end-of-sequence token). Everything is generated
here: no download.

The supervised warm-start data is deliberately biased: 70% of its answers are off by one
(``"8"`` for ``3+4=``), 30% are right. The warm-started policy therefore prefers a wrong
answer (greedy accuracy near 0) while still sampling the right one about 30% of the time,
which is the situation RL is for: the exact-match reward has to find and undo the bias.
"""
from __future__ import annotations

import random

from mcore_rl.data.records import PromptRecord
from mcore_rl.data.tokenizer import CharTokenizer

ALPHABET = "0123456789+="


def toy_tokenizer(source: str = "builtin") -> CharTokenizer:
    """The character tokenizer of a built-in task (``data.source``: builtin or calculator)."""
    if source == "calculator":
        from mcore_rl.data.calculator_task import calculator_tokenizer

        return calculator_tokenizer()
    return CharTokenizer(ALPHABET)


def all_problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10)]


WARM_START_CORRECT = 0.3


def record(a: int, b: int) -> PromptRecord:
    return PromptRecord(f"{a}+{b}=", {
        "answer": str(a + b),
        "warm_start_answers": [[str(a + b), WARM_START_CORRECT],
                               [str(a + b + 1), 1.0 - WARM_START_CORRECT]]})


def toy_records(split: str, num_val: int, seed: int) -> list[PromptRecord]:
    """Training: all 100 sums. Validation: a fixed seeded sample of ``num_val`` of them."""
    problems = all_problems()
    if split == "val":
        problems = random.Random(seed + 1).sample(problems, min(num_val, len(problems)))
    return [record(a, b) for a, b in problems]
