"""The one place mcore-rl imports math-verify from (an optional dependency of the ``math``
reward; PyPI ``math-verify``, with ``latex2sympy2_extended``, sympy and the ANTLR runtime).

math-verify bounds its own parsing and comparisons with ``signal.alarm``, which works only
in the main thread and cancels any other alarm the process had set (a trainer's, pytest's).
Here its timeouts are always off; the caller bounds the time itself (see
`mcore_rl.rewards.math_answer`).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

from mcore_rl.errors import UsageError


def available() -> bool:
    """Whether math-verify can be imported (checked without importing it)."""
    return importlib.util.find_spec("math_verify") is not None


def require() -> Any:
    """The ``math_verify`` module, or a one-line `UsageError` saying how to install it."""
    if not available():
        raise UsageError("reward 'math' checks answers with math-verify, which is not installed: "
                         "pip install math-verify (on CPU: bash scripts/install.sh)")
    return _imported()


@functools.lru_cache(maxsize=None)
def _imported() -> Any:
    import math_verify

    # It warns once per process that its timeouts are off; here that is by design.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(
            lambda record: not record.getMessage().startswith("Timeout is disabled"))
    return math_verify


def parse(text: str) -> list:
    """What math-verify extracts from ``text``: the parsed answer (LaTeX first, else a plain
    expression, the last one in the text), then its source string; [] when there is none."""
    mv = require()
    configs = (mv.LatexExtractionConfig(), mv.ExprExtractionConfig())
    return mv.parse(text, configs, parsing_timeout=None)


def verify(gold: list, predicted: list) -> bool:
    """Whether the parsed ``predicted`` answer equals the parsed ``gold`` one (math-verify's
    comparison is not symmetric: ``x = 3`` is accepted for a gold ``3``)."""
    return bool(require().verify(gold, predicted, timeout_seconds=None))
