"""A slow module teardown, for the tests of processes that end without one
(`mcore_rl.process_exit`): `linger` leaves an object that, when the interpreter's teardown
of this module deletes it, appends a line to a log and then takes 30 s."""
from __future__ import annotations

import time


class _Lingering:
    """Holds what its deletion needs itself: the module's globals may be gone by then."""

    def __init__(self, log: str, line: str):
        self.file = open(log, "a")  # noqa: SIM115 - written when the interpreter ends
        self.line, self.sleep = line, time.sleep

    def __del__(self):
        self.file.write(self.line)
        self.file.flush()
        self.sleep(30)


_KEPT: list = []


def linger(log: str, line: str) -> None:
    """Until the module teardown of this process: ``line`` goes to ``log`` then, and the
    teardown takes 30 s more."""
    _KEPT.append(_Lingering(log, line))
