"""The Ray head, seen from the driver: a watch that ends the run at once, in one line, when
the head's GCS server or raylet dies, and Ray's notices of deaths kept off the console.

Without the watch a dead GCS leaves the driver retrying for Ray's reconnect timeout, and
Ray then ends the process with its own message; a dead raylet shows up later as whichever
controller call failed first. The watch looks every `HEAD_POLL_S`: at the processes'
exit status when this process started the Ray node (``ray.init`` without an address), or
at whether the GCS still answers on its port when it joined a cluster.

Worst case from a head process's death to the run's end: `HEAD_POLL_S` on the node that
started Ray; ``GCS_MISSES * (HEAD_POLL_S + CONNECT_TIMEOUT_S)`` when joined; Ray's own
reconnect timeout (``launch.ray_reconnect_timeout_s``, `ray_shim.RECONNECT_ENV`) for what
the watch does not see.
"""
from __future__ import annotations

import socket
import threading
from typing import Any, Callable

from mcore_rl.engines.liveness import describe_exit
from mcore_rl.flow import ray_shim

HEAD_POLL_S = 0.5
"""How often `watch_head` looks at the head."""
GCS_MISSES = 3
"""Consecutive failed connects to a joined cluster's GCS that count as its death."""
CONNECT_TIMEOUT_S = 1.0


def head_processes() -> dict[str, Any]:
    """{"GCS server" | "raylet": its ``Popen``} of the Ray node this process started; empty
    when it joined a cluster (or Ray is not running)."""
    node = ray_shim.ray_node()
    found = {}
    for kind, name in (("gcs_server", "GCS server"), ("raylet", "raylet")):
        infos = getattr(node, "all_processes", {}).get(kind) or []
        if infos and getattr(infos[0], "process", None) is not None:
            found[name] = infos[0].process
    return found


def gcs_address() -> str | None:
    return getattr(ray_shim.ray_node(), "gcs_address", None)


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        return True
    except (OSError, ValueError):
        return False


def head_problem(processes: dict[str, Any], address: str | None, misses: list[int]) -> str | None:
    """What is wrong with the head now, or None: a started head process that exited, or a
    joined cluster's GCS that stopped answering (``misses`` counts consecutive misses)."""
    for name, proc in processes.items():
        code = proc.poll()
        if code is not None:
            return f"Ray's {name} (pid {proc.pid}) {describe_exit(code)}"
    if not processes and address:
        misses[0] = 0 if _answers(address) else misses[0] + 1
        if misses[0] >= GCS_MISSES:
            return f"Ray's GCS server at {address} stopped answering"
    return None


class HeadWatch:
    """A daemon thread that calls ``on_death(what happened)`` once the head dies, unless
    `stop` came first: the two exclude each other, so a run that ends on purpose and a head
    that dies meanwhile never both report."""

    def __init__(self, on_death: Callable[[str], None], poll_s: float = HEAD_POLL_S):
        self.on_death, self.poll_s = on_death, poll_s
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.processes, self.address, self.misses = head_processes(), gcs_address(), [0]
        threading.Thread(target=self._watch, daemon=True, name="ray-head-watch").start()

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll_s):
            problem = head_problem(self.processes, self.address, self.misses)
            if problem is None:
                continue
            with self.lock:
                if not self.stopped.is_set():
                    self.on_death(problem)  # ends the process, or reports once
                    self.stopped.set()
            return

    def stop(self) -> None:
        """No report from here on (before Ray is shut down on purpose); waits for a report
        under way."""
        with self.lock:
            self.stopped.set()


def watch_head(on_death: Callable[[str], None], poll_s: float = HEAD_POLL_S) -> HeadWatch:
    """`HeadWatch` of the Ray this process is connected to."""
    return HeadWatch(on_death, poll_s)


DEATH_NOTICES = ("A worker died or was killed", "has been marked dead because",
                 "The raylet exited immediately because", "Failed to connect to GCS",
                 "Raylet is terminated")
"""Ray's console notices of a process's death: the run's own last line names the process
and the cause, and Ray keeps these in its session's logs."""


def quiet_death_notices() -> None:
    """Keep `DEATH_NOTICES` off this driver's console (Ray's other notices still print)."""
    ray = ray_shim.require()
    worker = ray._private.worker  # noqa: SLF001 - where the driver prints Ray's notices
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "quiet_deaths", False):
        return

    def filtered(data, *args, **kwargs):
        if data.get("pid") == "raylet" and any(
                notice in line for line in data.get("lines", []) for notice in DEATH_NOTICES):
            return None
        return printer(data, *args, **kwargs)

    filtered.quiet_deaths = True
    worker.print_to_stdstream = filtered
