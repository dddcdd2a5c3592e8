"""The runtime state every controller of a launch talks to: its streams, the turns on
shared devices and the step budget, in one asyncio actor (`Hub`).

A stream holds references to items in Ray's object store (each wrapped in a list so Ray
passes the reference instead of resolving it), never the items themselves, so a put or a
get is a message of a few hundred bytes whatever the item's size. Blocking calls wait on
the actor's event loop, so a blocked put never stops a get of another controller."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

OPEN, ENDED, CANCELLED = "open", "ended", "cancelled"


class StreamState:
    """A bounded FIFO of boxed references with end-of-stream (all producers closed) and
    cancellation (the launch is stopping: puts are refused, gets see the end)."""

    def __init__(self, buffer_size: int, producers: int):
        self.buffer_size = buffer_size
        self.open_producers = producers
        self.items: deque = deque()
        self.cancelled = False
        self.changed = asyncio.Condition()

    async def put(self, box: list) -> bool:
        """Append once fewer than ``buffer_size`` items wait; False if cancelled."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.cancelled or len(self.items) < self.buffer_size)
            if self.cancelled:
                return False
            self.items.append(box)
            self.changed.notify_all()
            return True

    async def get(self, max_items: int) -> tuple[list, str]:
        """Up to ``max_items`` waiting items (at least one) and OPEN; or no items and ENDED
        (every producer closed, nothing left) or CANCELLED."""
        async with self.changed:
            await self.changed.wait_for(
                lambda: self.cancelled or self.items or self.open_producers <= 0)
            if self.cancelled:
                return [], CANCELLED
            if not self.items:
                return [], ENDED
            taken = [self.items.popleft() for _ in range(min(max_items, len(self.items)))]
            self.changed.notify_all()
            return taken, OPEN

    async def close(self) -> None:
        """One producer is done."""
        async with self.changed:
            self.open_producers -= 1
            self.changed.notify_all()

    async def cancel(self) -> None:
        async with self.changed:
            self.cancelled = True
            self.items.clear()
            self.changed.notify_all()


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


class Hub:
    """Streams, device turns and the step budget of one launch (a Ray asyncio actor)."""

    def __init__(self, streams: dict[str, tuple[int, int]], steps: int | None):
        self.streams = {name: StreamState(size, producers)
                        for name, (size, producers) in streams.items()}
        self.turns = DeviceTurns()
        self.steps = steps
        self.steps_taken = 0
        self.done = 0
        self.stopping = False
        """Items of the launch's data the sinks have finished (a launch with
        ``max_in_flight`` counts them: each item the feed put in becomes one stream item
        per controller, and a sink call reports the items it consumed)."""
        self.done_changed = asyncio.Condition()
        self.services: dict[str, list] = {}
        """name -> [the actor handle of the process that published it] (`flow.publish`)."""

    async def put(self, stream: str, box: list) -> bool:
        return await self.streams[stream].put(box)

    async def get(self, stream: str, max_items: int) -> tuple[list, str]:
        return await self.streams[stream].get(max_items)

    async def cancelled(self, stream: str) -> bool:
        """Whether the launch has cancelled ``stream`` (a consumer asks before it calls on
        items it took earlier)."""
        return self.streams[stream].cancelled

    async def close(self, stream: str) -> None:
        await self.streams[stream].close()

    async def acquire(self, devices: tuple[int, ...]) -> None:
        await self.turns.acquire(devices)

    async def release(self, devices: tuple[int, ...]) -> None:
        self.turns.release(devices)

    async def take_step(self) -> bool:
        """One step of the budget for a sink's next call; the last one granted cancels
        every stream, so the rest of the graph stops once that call is done."""
        if self.steps is None:
            return True
        if self.steps_taken >= self.steps:
            return False
        self.steps_taken += 1
        if self.steps_taken == self.steps:
            await self.cancel()
        return True

    async def cancel(self) -> None:
        for stream in self.streams.values():
            await stream.cancel()
        async with self.done_changed:
            self.stopping = True
            self.done_changed.notify_all()

    async def peek(self, stream: str) -> list[list]:
        """What waits in ``stream`` (boxed object references), left in place: for inspection."""
        return list(self.streams[stream].items)

    async def sink_done(self, items: int = 1) -> None:
        async with self.done_changed:
            self.done += items
            self.done_changed.notify_all()

    async def wait_done(self, n: int) -> int | None:
        """Wait until the sinks have finished ``n`` items; how many they have finished, or
        None if the launch is stopping first."""
        async with self.done_changed:
            await self.done_changed.wait_for(lambda: self.done >= n or self.stopping)
            return self.done if self.done >= n else None

    async def publish(self, name: str, boxed_handle: list) -> None:
        if name in self.services:
            raise ValueError(f"two controllers publish an object named '{name}'")
        self.services[name] = boxed_handle

    async def lookup(self, name: str) -> list | None:
        return self.services.get(name)

    async def ping(self) -> Any:
        return True
