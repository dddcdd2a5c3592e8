"""The built-in multi-turn task: two-step arithmetic with a calculator tool.

Prompt ``"23*7+41="``, answer ``"202"``. The model may call the calculator with a bracketed
expression, ``[23*7]``; the environment (`mcore_rl.envs.calculator`) answers with the value,
``161``, and the model goes on: ``[161+41]`` -> ``202``, then the answer and end-of-sequence.
A two-layer character model cannot multiply two-digit numbers by itself; with the tool it
only has to copy numbers into the right calls.

The supervised warm-start transcripts are deliberately biased, as in the addition task: 70%
stop after the first call and answer its value (``[23*7]161`` then ``161``: the product,
without the sum), 30% make both calls. The warm-started policy therefore mostly answers
wrong when greedy while still sampling the right procedure, which RL has to find.
"""
from __future__ import annotations

import random

from mcore_rl.data.records import PromptRecord
from mcore_rl.data.tokenizer import CharTokenizer

ALPHABET = "0123456789+*=[]?"
"""Digits, the operators, the call brackets and ``?`` (the tool's answer to a bad call)."""

WARM_START_CORRECT = 0.3
TRAIN_PROBLEMS = 2000


def calculator_tokenizer() -> CharTokenizer:
    return CharTokenizer(ALPHABET)


def record(a: int, b: int, c: int) -> PromptRecord:
    product, total = a * b, a * b + c
    right = [f"[{a}*{b}]", f"[{product}+{c}]", str(total)]
    shortcut = [f"[{a}*{b}]", str(product)]
    return PromptRecord(f"{a}*{b}+{c}=", {
        "answer": str(total),
        "warm_start_answers": [[right, WARM_START_CORRECT], [shortcut, 1.0 - WARM_START_CORRECT]]})


def calculator_records(split: str, num_val: int, seed: int) -> list[PromptRecord]:
    """``a*b+c`` with a, c in 10..99 and b in 2..9: ``TRAIN_PROBLEMS`` seeded problems for
    training, ``num_val`` others (never in training) for validation."""
    problems = [(a, b, c) for a in range(10, 100) for b in range(2, 10) for c in range(10, 100)]
    random.Random(seed).shuffle(problems)
    chosen = problems[TRAIN_PROBLEMS:TRAIN_PROBLEMS + num_val] if split == "val" else \
        problems[:TRAIN_PROBLEMS]
    return [record(*p) for p in chosen]
