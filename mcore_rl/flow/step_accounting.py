"""The hub's count of a launch's progress: the ``steps`` budget of the sink controllers and
the items the sinks have finished, which paces the sources (``max_in_flight``)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable


class StepAccount:
    """Steps taken against the budget, items finished, and waiting for either."""

    def __init__(self, steps: int | None, cancel_all: Callable[[], Awaitable[None]]):
        self.steps = steps
        self.steps_taken = 0
        self.done = 0
        """Items of the launch's data the sinks have finished: each item a source took
        becomes one stream item per controller, and a sink call reports the items it
        consumed."""
        self.stopping = False
        self.changed = asyncio.Condition()
        self._cancel_all = cancel_all

    async def take_step(self) -> bool:
        """One step of the budget for a sink's next call; the last one granted cancels
        every stream, so the rest of the graph stops once that call is done."""
        if self.steps is None:
            return True
        if self.steps_taken >= self.steps:
            return False
        self.steps_taken += 1
        if self.steps_taken == self.steps:
            await self._cancel_all()
        return True

    async def stop(self) -> None:
        async with self.changed:
            self.stopping = True
            self.changed.notify_all()

    async def sink_done(self, items: int = 1) -> None:
        async with self.changed:
            self.done += items
            self.changed.notify_all()

    async def wait_done(self, n: int) -> int | None:
        """Wait until the sinks have finished ``n`` items; how many they have finished, or
        None if the launch is stopping first."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.done >= n or self.stopping)
            return self.done if self.done >= n else None
