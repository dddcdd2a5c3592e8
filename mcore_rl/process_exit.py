"""Ending a finished process without the interpreter's teardown of its modules.

After ``import torch`` and ``megatron.core``, Python's teardown of every module at exit
takes seconds on its own (2-4 s on a 2-core CPU machine), and a finished process has no use
for it: whoever waits for the process (a launch's teardown, a shell, a test) waits for it.
`end_after_exit_handlers` keeps the interpreter's own exit (its other threads waited for,
as `threading` does at exit, then the exit handlers) and leaves out only that teardown."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def end_after_exit_handlers(code: int = 0) -> None:
    """From now on, this process ends with status ``code`` as soon as its exit handlers have
    run: a handler registered last, so that it runs first, runs the others in their order,
    flushes the output and ends the process (``os._exit``)."""

    def end() -> None:
        atexit.unregister(end)
        atexit._run_exitfuncs()  # noqa: SLF001 - the registered handlers, in their order
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    atexit.register(end)


def exit_now(code: int = 0) -> NoReturn:
    """``sys.exit(code)``, less the interpreter's teardown of every module."""
    end_after_exit_handlers(code)
    sys.exit(code)
