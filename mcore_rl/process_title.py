"""Processes of ours named for ``ps`` (their command line, e.g. ``VLLM::EngineCore``).

setproctitle finds the command-line memory it rewrites by walking back from the first
environment string, once, the first time it is called. A process that sets that variable
again before then (importing vLLM, torch or OpenCV sets several, and which variable is first
depends on the environment the process inherited) keeps its command line for good, and
whatever looks for the process by its name misses it. A `multiprocessing` spawn child
imports its target's module before it unpickles the target's arguments, so a target from
this module (which imports nothing else of ours, and has setproctitle find the command line
as it is imported) names the process whatever they import: `titled`.
"""
from __future__ import annotations

from typing import Any, Callable

import setproctitle

setproctitle.getproctitle()  # the command line found now, before anything sets a variable


def titled(title: str, target: Callable[..., Any], *args: Any) -> Any:
    """``target(*args)`` in a process titled ``title``: a spawned process's target, with
    the real one and its arguments as arguments."""
    setproctitle.setproctitle(title)
    return target(*args)
