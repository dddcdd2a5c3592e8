"""The hub's streams, device turns and step accounting on their own event loop (no Ray)."""
from __future__ import annotations

import asyncio

from mcore_rl.flow.device_turns import DeviceTurns
from mcore_rl.flow.hub import Hub
from mcore_rl.flow.streams import CANCELLED, ENDED, OPEN, StreamState


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


async def blocked(task: asyncio.Task) -> bool:
    await asyncio.sleep(0.05)
    return not task.done()


def test_put_waits_while_buffer_size_items_wait_and_get_frees_room():
    async def scenario():
        stream = StreamState(buffer_size=2, producers=1)
        assert await stream.put(["a"]) and await stream.put(["b"])
        third = asyncio.create_task(stream.put(["c"]))
        assert await blocked(third)
        assert await stream.get(1) == ([["a"]], OPEN)
        assert await third is True
        assert await stream.get(5) == ([["b"], ["c"]], OPEN)
    run(scenario())


def test_get_sees_the_end_only_after_every_producer_closed_and_the_items_are_taken():
    async def scenario():
        stream = StreamState(buffer_size=4, producers=2)
        await stream.put(["a"])
        await stream.close()
        assert await stream.get(4) == ([["a"]], OPEN)
        waiting = asyncio.create_task(stream.get(4))
        assert await blocked(waiting)  # one producer is still open
        await stream.close()
        assert await waiting == ([], ENDED)
    run(scenario())


def test_cancel_refuses_puts_and_ends_gets():
    async def scenario():
        stream = StreamState(buffer_size=1, producers=1)
        await stream.put(["a"])
        put = asyncio.create_task(stream.put(["b"]))
        assert await blocked(put)
        await stream.cancel()
        assert await put is False
        assert await stream.get(1) == ([], CANCELLED)
    run(scenario())


def test_turns_are_exclusive_per_device_and_granted_in_arrival_order():
    async def scenario():
        turns = DeviceTurns()
        await turns.acquire((0,))
        both = asyncio.create_task(turns.acquire((0, 1)))
        assert await blocked(both)
        one = asyncio.create_task(turns.acquire((1,)))  # free, but an earlier request wants it
        assert await blocked(one)
        other = asyncio.create_task(turns.acquire((2,)))
        await other  # nobody wants device 2
        turns.release((0,))
        await both
        assert await blocked(one)
        turns.release((0, 1))
        await one
    run(scenario())


def test_the_step_budget_grants_exactly_steps_and_then_cancels_the_streams():
    async def scenario():
        hub = Hub({"s": (2, 1)}, steps=2)
        assert [await hub.take_step() for _ in range(3)] == [True, True, False]
        assert await hub.get("s", 1) == ([], CANCELLED)
    run(scenario())
