"""Processes of ours named for ``ps`` (their command line, e.g. ``VLLM::EngineCore``).

setproctitle cannot be relied on for this: it finds the command line's memory by walking
back from the first environment string, once, the first time it is called, and a process
that sets that variable again before then keeps its command line for good. A spawned
process of ours runs the parent's ``__main__`` module (a Ray worker's: Ray sets variables as
it is imported) and imports vLLM, torch and OpenCV (each sets several) before its target
runs, and which variable is first depends on the environment it inherited. So the name is
written here where the kernel says the command line is (``/proc/self/stat``'s
``arg_start``/``arg_end``), whatever the environment did: `set_title`, and `titled` for a
spawned process's target.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

PR_SET_NAME = 15
"""prctl(2): the thread name (``comm``, 15 bytes) that ``top`` and ``ps -o comm`` show."""


def _command_line_area() -> tuple[int, int] | None:
    """(start, end) of this process's command line in its memory (proc(5): fields 48 and
    49 of ``/proc/self/stat``), or None where there is no such file."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # from field 3 on: comm may hold spaces
    return int(fields[48 - 3]), int(fields[49 - 3])


def set_title(title: str) -> bool:
    """Name this process ``title`` in ``ps`` (cut to the length of the command line it was
    started with, which a spawned process's exceeds by far) and in ``comm``; False where
    the platform has no ``/proc`` (the name stays as it was)."""
    area = _command_line_area()
    if area is None or area[1] <= area[0]:
        return False
    start, end = area
    data = title.encode()[:end - start - 1]
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    ctypes.CDLL(None).prctl(PR_SET_NAME, title.encode()[:15], 0, 0, 0)  # libc, loaded already
    return True


def titled(title: str, target: Callable[..., Any], *args: Any) -> Any:
    """``target(*args)`` in a process named ``title``: a spawned process's target, with the
    real one and its arguments as arguments."""
    set_title(title)
    return target(*args)
