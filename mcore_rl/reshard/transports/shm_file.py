"""The file in ``reshard.shm_dir`` (a tmpfs) that file-backed transports share with the engines.

The controller creates it, every trainer rank on its node and every engine process maps it,
and then the controller removes its name: the memory lives exactly as long as someone maps
it, so a crashed process leaves nothing behind.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from mcore_rl.parallel.agreement import broadcast
from mcore_rl.sizes import format_bytes, free_bytes


def agree_on_path(shm_dir: str, controller: int, group=None) -> str:
    """A fresh file name in ``shm_dir``, chosen by the controller (collective)."""
    name = broadcast(f"mcore_rl_reshard_{os.getpid()}_{uuid.uuid4().hex[:8]}", controller, group)
    return str(Path(shm_dir) / name)


def room_problem(directory: str, nbytes: int, what: str, fix: str) -> str | None:
    """Why ``directory`` cannot take ``nbytes`` more (None: it can): a clear error now rather
    than a SIGBUS when a tmpfs page cannot be allocated later."""
    if not Path(directory).is_dir():
        return f"reshard.shm_dir {directory} is not a directory: point it at a tmpfs such as /dev/shm"
    free = free_bytes(directory)
    if free is not None and free < nbytes:
        return (f"{what} needs {format_bytes(nbytes)} in {directory}, which has "
                f"{format_bytes(free)} free: {fix} (docker: --shm-size)")
    return None
