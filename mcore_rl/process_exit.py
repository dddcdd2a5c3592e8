"""Ending a finished process without the interpreter's teardown of its modules.

After ``import torch`` and ``megatron.core``, Python's teardown of every module at exit
takes seconds on its own (2-4 s on a 2-core CPU machine), and a finished process has no use
for it: whoever waits for the process (a launch's teardown, a shell, a test) waits for it.
`exit_now` ends the process as the interpreter would, less that teardown."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """End this process with status ``code``: its other (non-daemon) threads are waited for
    and its exit handlers run, as at a normal exit; its output is flushed; then ``os._exit``."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - the registered handlers, in their order
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
