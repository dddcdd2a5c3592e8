"""How ``mcore-rl train`` ends a run that failed at run time: the details (the remote
traceback, Ray's error text) written to ``<logging.dir>/error.log``, and the console's last
line naming the role, the instance and the cause, and that file; and the end of a run whose
Ray head died (`mcore_rl.flow.ray_head.watch_head`), before Ray's own timeouts would end it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ERROR_LOG = "error.log"
"""The file in ``logging.dir`` that holds a failed run's details."""


def write_error_log(log_dir: str | os.PathLike, details: str) -> Path:
    from mcore_rl.atomic_write import write_text_atomic

    return write_text_atomic(Path(log_dir) / ERROR_LOG, details.rstrip("\n") + "\n")


def error_line(summary: str, log_dir: str | os.PathLike, details: str) -> str:
    """``summary`` (one line) and where ``details`` were written."""
    try:
        where = f"; details: {write_error_log(log_dir, details)}"
    except OSError as err:
        where = f"; its details could not be written to {Path(log_dir) / ERROR_LOG}: {err}"
    return f"mcore-rl train: error: {summary}{where}"


def end_on_head_death(log_dir: str | os.PathLike):
    """The callback for `watch_head`: the one line, then this process exits at once (its
    watcher, `mcore_rl.engines.owner_watch`, ends every process it started, Ray's too)."""
    def on_death(what: str) -> None:
        from mcore_rl.flow import ray_shim

        session = ray_shim.session_dir()
        logs = f"Ray's logs: {session}/logs" if session else ""
        line = error_line(f"{what}; the run cannot go on without the Ray head", log_dir,
                          f"{what}\n{logs}")
        print(line, file=sys.stderr, flush=True)
        os._exit(1)

    return on_death
