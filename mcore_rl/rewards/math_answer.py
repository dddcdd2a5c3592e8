"""``math``: the response's final answer against ``meta["answer"]``, checked by math-verify.

math-verify (`mcore_rl.rewards.math_verify_shim`) reads LaTeX and plain expressions into
sympy and compares them as mathematics: a nested ``\\boxed{\\frac{\\sqrt{2}}{2}}``,
``\\dfrac{3}{4}``, ``0.75`` and ``3/4`` are one answer, ``x = 3`` is accepted for ``3``,
sets and intervals compare as such. The response's answer is its last ``\\boxed{}`` (all of
them, as a set, where there are several), else its GSM8K answer line (``#### 72``), else the
last LaTeX or plain expression after an "answer is"-style phrase, else the last one in the
text; a response with none scores 0. A reference in GSM8K's form (the worked solution, then
``#### 72``) is read by its answer line.

Time: a pathological answer (``9^{9^{9^{9}}}``) can keep sympy busy for hours. math-verify's
own timeouts (``signal.alarm``) are off: they work only in the main thread and cancel any
other alarm of the process. Instead each sample's parsing and comparison is bounded by
`TIME_LIMIT_S` through an interval timer that nests with one already set (pytest-timeout's,
a caller's): past it the sample is a `RewardTimeout` (``reward/timeouts``). Outside the main
thread no signal can interrupt it: there only ``reward.workers`` with ``reward.timeout_s``
bound it (the pool kills the worker past the deadline).

Also here: ``exact`` and ``env`` (no reward), and `extract_answer` (the last ``\\boxed{}``
or number, as text), which ``reasoning_gym`` uses.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import signal
import threading
import time

from mcore_rl.rewards import math_verify_shim
from mcore_rl.rewards.registry import REWARDS, RewardTimeout

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_BOXED = "\\boxed{"

TIME_LIMIT_S = 5.0
"""Wall-clock bound of one sample's parsing and comparison (in the main thread)."""

logger = logging.getLogger(__name__)


def _last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}``, braces nested inside it kept."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth = 0
        for end in range(start + len(_BOXED) - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[start + len(_BOXED):end].strip()
        start = text.rfind(_BOXED, 0, start)  # never closed: an earlier one
    return None


def extract_answer(text: str) -> str | None:
    """The content of the last \\boxed{}, else the last number in the text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


class _OutOfTime(BaseException):
    """Raised by the timer's handler; a BaseException, so that the ``except Exception`` of
    math-verify and sympy lets it through."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """A `RewardTimeout` when the block runs past ``seconds`` (SIGALRM, main thread only).

    A real-time timer already set (pytest-timeout's, a caller's) is kept: when it would fire
    first it is left alone, else it is set again afterwards, less the time spent. The timer
    repeats every 50 ms after the limit, so an exception swallowed on the way still ends
    the block."""
    if threading.current_thread() is not threading.main_thread():
        _warn_unbounded_once()
        yield
        return
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.getsignal(signal.SIGALRM)
    if (outer_left and outer_left <= seconds) or previous is None:  # None: a handler set in C
        yield
        return
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _OutOfTime

    started = time.monotonic()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    try:
        yield
    except _OutOfTime:
        armed[0] = False
        raise RewardTimeout(f"math-verify took longer than {seconds:g} s") from None
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left:
            left = max(outer_left - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


@functools.lru_cache(maxsize=None)
def _warn_unbounded_once() -> None:
    logger.warning("reward 'math' runs outside the main thread, where it cannot interrupt a "
                   "pathological answer: bound it with reward.workers and reward.timeout_s")


_GSM8K_MARK = "####"
"""GSM8K's final-answer line: ``#### 72`` after the worked solution."""


def _gsm8k_final(text: str) -> str | None:
    """What follows the last ``####`` (GSM8K's answer line), thousands separators dropped,
    or None when there is none."""
    at = text.rfind(_GSM8K_MARK)
    if at == -1:
        return None
    final = text[at + len(_GSM8K_MARK):].strip().splitlines()
    return re.sub(r"(?<=\d),(?=\d{3})", "", final[0]).strip() if final and final[0].strip() else None


def _response_text(response: str) -> str:
    """The response as math-verify reads it: its GSM8K answer line alone when it ends so and
    has no box (the worked solution before it holds other numbers), else all of it."""
    final = _gsm8k_final(response) if _BOXED not in response else None
    return f"${final}$" if final else response


def _reference_text(answer) -> str:
    """``meta["answer"]`` as math-verify reads it: GSM8K's ``#### 72`` line alone when there
    is one, and inside ``$...$`` unless it already has a math environment or a box (so
    ``(1, 2]`` is an interval and ``\\sqrt{2}`` parses, not their last number)."""
    text = str(answer).strip()
    text = _gsm8k_final(text) or text
    delimited = any(mark in text for mark in ("$", "\\boxed", "\\(", "\\["))
    return text if delimited else f"${text}$"


def prepare(fn, cfg):
    """At scorer build: refuse with one line when math-verify is not installed."""
    math_verify_shim.require()
    return fn


@REWARDS.register("math", prepare=prepare)
def math_reward(prompt: str, response: str, meta: dict, *,
                time_limit_s: float = TIME_LIMIT_S) -> float:
    """1.0 when the response's final answer equals ``meta["answer"]`` mathematically
    (math-verify, reference first), else 0.0; a `RewardTimeout` past ``time_limit_s``. A
    reference math-verify cannot read at all is an error of the data (`ValueError`)."""
    with _time_limit(time_limit_s):
        gold = math_verify_shim.parse(_reference_text(meta["answer"]))
        if not gold:
            raise ValueError(f"math-verify finds no answer in the reference {meta['answer']!r}")
        predicted = math_verify_shim.parse(_response_text(response))
        return 1.0 if predicted and math_verify_shim.verify(gold, predicted) else 0.0


@REWARDS.register("exact", aliases=("builtin",))
def exact_reward(prompt: str, response: str, meta: dict) -> float:
    """1.0 when the stripped response equals ``meta["answer"]`` exactly."""
    return 1.0 if response.strip() == str(meta["answer"]).strip() else 0.0


@REWARDS.register("env", aliases=("none",))
def no_reward(prompt: str, response: str, meta: dict) -> float:
    """0 for every response: with an environment (``environment.name``) the score is the sum
    of its rewards alone."""
    return 0.0
