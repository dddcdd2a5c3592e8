"""Process groups of the runtime's processes: every controller and rank leads a group of its
own, so that killing the group also kills what its function started (an engine, reward
workers), wherever the launch ends."""
from __future__ import annotations

import os
import signal


def lead_process_group() -> None:
    """Make this process the leader of a process group of its own (Ray's workers already
    are; the check keeps a kill from ever hitting a group it does not lead)."""
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)


def kill_process_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (or only ``pid``, if it leads none)."""
    try:
        if os.getpgid(pid) == pid and pid != os.getpgid(0):
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:  # the leader is gone; its group may still have members
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
