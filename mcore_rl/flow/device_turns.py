"""Turns on shared devices: controllers whose devices overlap take turns one call at a time
(colocated roles on CPU cores), granted by the hub in arrival order."""
from __future__ import annotations

import asyncio


class DeviceTurns:
    """Exclusive turns on sets of devices, granted in arrival order: a request waits while
    any of its devices is held, or wanted by an earlier waiting request (no starvation)."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.waiting: list[tuple[frozenset, asyncio.Future]] = []

    async def acquire(self, devices: tuple[int, ...]) -> None:
        wanted = frozenset(devices)
        if not wanted & self.held and not any(wanted & w for w, _ in self.waiting):
            self.held |= wanted
            return
        granted = asyncio.get_running_loop().create_future()
        self.waiting.append((wanted, granted))
        await granted

    def release(self, devices: tuple[int, ...]) -> None:
        self.held -= set(devices)
        blocked: set[int] = set()
        for wanted, granted in list(self.waiting):
            if not wanted & self.held and not wanted & blocked:
                self.held |= wanted
                self.waiting.remove((wanted, granted))
                granted.set_result(None)
            blocked |= wanted
