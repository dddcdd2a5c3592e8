"""The one actor every process of a launch talks to (`Hub`, an asyncio actor): its streams
(`streams`), the turns on shared devices (`device_turns`), the step budget and pacing
(`step_accounting`) and the directory of published objects (`services`)."""
from __future__ import annotations

import os
from typing import Any

from mcore_rl.flow.device_turns import DeviceTurns
from mcore_rl.flow.step_accounting import StepAccount
from mcore_rl.flow.streams import StreamState


class Hub:
    """Streams, device turns, step accounting and published names of one launch."""

    def __init__(self, streams: dict[str, tuple[int, int]], steps: int | None):
        self.streams = {name: StreamState(size, producers)
                        for name, (size, producers) in streams.items()}
        self.turns = DeviceTurns()
        self.account = StepAccount(steps, self.cancel)
        self.services: dict[str, list] = {}
        """name -> [the actor handle of the process that published it] (`flow.publish`)."""

    async def put(self, stream: str, box: list, key=None, acks: tuple | None = None) -> bool:
        """Put ``box`` (named ``key``); ``acks``: (input stream, holder, keys) the holder is
        done with once the put succeeded, in the same step (a holder that dies after it
        has neither lost those items nor put them twice)."""
        if acks is None:
            return await self.streams[stream].put(box, key)
        source, holder, keys = acks
        gone = self.streams[source].gone  # its items went back to the feed: do not put twice
        accepted = await self.streams[stream].put(box, key, abort=lambda: holder in gone)
        if accepted:
            await self.streams[source].ack(holder, keys)
        return accepted

    async def get(self, stream: str, max_items: int, holder: str | None = None) -> tuple[list, str]:
        return await self.streams[stream].get(max_items, holder)

    async def let_go(self, stream: str, holder: str) -> None:
        """``holder`` ended: the others' gets may see the end of ``stream``."""
        await self.streams[stream].let_go(holder)

    async def requeue(self, stream: str, holder: str) -> int:
        """What a failed ``holder`` took from ``stream`` and did not finish, back in it."""
        return await self.streams[stream].requeue(holder)

    async def cancelled(self, stream: str) -> bool:
        """Whether the launch has cancelled ``stream`` (a consumer asks before it calls on
        items it took earlier)."""
        return self.streams[stream].cancelled

    async def close(self, stream: str, producer: str | None = None) -> None:
        await self.streams[stream].close(producer)

    async def acquire(self, devices: tuple[int, ...]) -> None:
        await self.turns.acquire(devices)

    async def release(self, devices: tuple[int, ...]) -> None:
        self.turns.release(devices)

    async def take_step(self) -> bool:
        return await self.account.take_step()

    async def cancel(self) -> None:
        """Stop the launch: every stream refuses puts and ends its gets; pacing waits end."""
        for stream in self.streams.values():
            await stream.cancel()
        await self.account.stop()

    async def peek(self, stream: str) -> list[list]:
        """What waits in ``stream`` (boxed object references), left in place: for inspection."""
        return list(self.streams[stream].items)

    async def sink_done(self, items: int = 1) -> None:
        await self.account.sink_done(items)

    async def wait_done(self, n: int) -> int | None:
        return await self.account.wait_done(n)

    async def publish(self, name: str, boxed_handle: list) -> None:
        if name in self.services:
            raise ValueError(f"two controllers publish an object named '{name}'")
        self.services[name] = boxed_handle

    async def lookup(self, name: str) -> list | None:
        return self.services.get(name)

    async def ping(self) -> Any:
        return True

    async def pid(self) -> int:
        return os.getpid()
