"""``python [-P] mcore_rl/engines/owner_watch.py OWNER_PID``: kill the owner's descendants once
the owner is gone (started by `mcore_rl.engines.liveness.watch_owner`).

While the owner lives, its descendants (engine core, engine workers, their resource
tracker) are listed every second, each with its start time, so a process re-parented to
init when the owner dies is still found, and a reused PID is never killed. Standard input
is a pipe the owner holds: it closes when the owner dies, however it dies.

It imports nothing of mcore-rl (run as a file, not through the package, which loads torch).
"""
from __future__ import annotations

import os
import select
import sys

import psutil

LIST_EVERY_S = 1.0
"""How often the owner's descendants are listed."""
KILL_WAIT_S = 5.0
"""How long the watcher waits for the processes it killed to end."""


def descendants(owner: psutil.Process) -> dict[int, float]:
    """PID -> start time of the owner's descendants (this watcher excluded)."""
    found = {}
    for proc in owner.children(recursive=True):
        try:
            if proc.pid != os.getpid():
                found[proc.pid] = proc.create_time()
        except psutil.Error:
            pass
    return found


def kill_all(known: dict[int, float]) -> None:
    procs = []
    for pid, started in known.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:
                procs.append(proc)
                procs.extend(proc.children(recursive=True))
        except psutil.Error:
            pass
    kill_and_wait(procs)


def kill_and_wait(procs: list[psutil.Process], timeout_s: float = KILL_WAIT_S) -> None:
    """SIGKILL each of ``procs`` (those already gone are skipped) and wait for them to end."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def main(owner_pid: int) -> None:
    try:
        owner = psutil.Process(owner_pid)
    except psutil.Error:
        return
    known: dict[int, float] = {}
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], LIST_EVERY_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the owner is gone: its end of the pipe closed
        try:
            known.update(descendants(owner))
        except psutil.Error:
            break
    kill_all(known)


if __name__ == "__main__":
    main(int(sys.argv[1]))
