"""A stream's state in the hub: a bounded FIFO of boxed object references with end-of-stream
(every producer closed) and cancellation (the launch is stopping).

A stream holds references to items in Ray's object store (each wrapped in a list so Ray
passes the reference instead of resolving it), never the items themselves, so a put or a
get is a message of a few hundred bytes whatever the item's size. Blocking calls wait on
the hub's event loop, so a blocked put never stops a get of another controller."""
from __future__ import annotations

import asyncio
from collections import deque

OPEN, ENDED, CANCELLED = "open", "ended", "cancelled"


class StreamState:
    """A bounded FIFO of boxed references with end-of-stream and cancellation (puts are
    refused, gets see the end)."""

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
