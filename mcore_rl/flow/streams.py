"""A stream's state in the hub: a bounded FIFO of boxed object references with end-of-stream
(every producer closed) and cancellation (the launch is stopping); and, for consumers that
may be replaced (`mcore_rl.flow.Replaceable`), what each took and has not yet handed on.

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
        self.keys: deque = deque()
        """The key of each waiting item (None: not tracked), in step with ``items``."""
        self.held: dict[str, dict] = {}
        """Holder -> {key: box} it took and has not acknowledged (`ack`), for `requeue`."""
        self.closed_by: set[str] = set()
        """Producers that closed by name (`close`)."""
        self.gone: set[str] = set()
        """Holders that failed (`requeue`): a call of theirs still waiting here (the hub
        serves calls of a caller that died) takes nothing more."""
        self.cancelled = False
        self.changed = asyncio.Condition()

    async def put(self, box: list, key=None, abort=None) -> bool:
        """Append once fewer than ``buffer_size`` items wait; False if cancelled, or if
        ``abort()`` says so first. ``key`` names the item for the holders that take it."""
        def aborted() -> bool:
            return abort is not None and abort()

        async with self.changed:
            await self.changed.wait_for(lambda: self.cancelled or aborted()
                                        or len(self.items) < self.buffer_size)
            if self.cancelled or aborted():
                return False
            self.items.append(box)
            self.keys.append(key)
            self.changed.notify_all()
            return True

    async def get(self, max_items: int, holder: str | None = None) -> tuple[list, str]:
        """Up to ``max_items`` waiting items (at least one) and OPEN; or no items and ENDED
        (every producer closed, nothing left, nothing held elsewhere that could come back)
        or CANCELLED. ``holder``: the keyed items taken are held for it until it
        acknowledges them (`ack`) or ends (`let_go`); a holder must hand items on without
        waiting for the end of its input, or two holders would wait for each other."""
        def ended() -> bool:
            return self.open_producers <= 0 and not any(
                held for other, held in self.held.items() if other != holder)

        async with self.changed:
            await self.changed.wait_for(lambda: self.cancelled or self.items or ended()
                                        or holder in self.gone)
            if self.cancelled or holder in self.gone:
                return [], CANCELLED
            if not self.items:
                return [], ENDED
            taken = []
            for _ in range(min(max_items, len(self.items))):
                box, key = self.items.popleft(), self.keys.popleft()
                if holder is not None and key is not None:
                    self.held.setdefault(holder, {})[key] = box
                taken.append(box)
            self.changed.notify_all()
            return taken, OPEN

    async def ack(self, holder: str, keys) -> None:
        """``holder`` is done with the items ``keys`` (their results went on)."""
        async with self.changed:
            held = self.held.get(holder, {})
            for key in keys:
                held.pop(key, None)
            self.changed.notify_all()

    async def let_go(self, holder: str) -> None:
        """``holder`` ended: nothing it took can come back."""
        async with self.changed:
            self.held.pop(holder, None)
            self.changed.notify_all()

    async def requeue(self, holder: str) -> int:
        """Put what ``holder`` took and did not acknowledge back at the front (it failed);
        how many items."""
        async with self.changed:
            self.gone.add(holder)
            held = self.held.pop(holder, {})
            for key, box in reversed(list(held.items())):
                self.items.appendleft(box)
                self.keys.appendleft(key)
            self.changed.notify_all()
            return len(held)

    async def close(self, producer: str | None = None) -> None:
        """One producer is done (``producer``: named, so that a second close of the same
        one, by the launch on behalf of a failed instance, counts once)."""
        async with self.changed:
            if producer is not None:
                if producer in self.closed_by:
                    return
                self.closed_by.add(producer)
            self.open_producers -= 1
            self.changed.notify_all()

    async def cancel(self) -> None:
        async with self.changed:
            self.cancelled = True
            self.items.clear()
            self.keys.clear()
            self.changed.notify_all()
