"""Multi-rank worlds shared by every test module that asks for one of the same size.

Starting a world (spawning ranks, importing megatron.core on each) costs 10-30 s on the CI
machine, so the model and conversion tests share one world per size for the whole pytest
process: `shared_world(n)` starts it on first use, and `close_shared_worlds` (a session
fixture in this folder's and tests/convert's conftest) stops the ranks cleanly at the end:
a rank killed instead would orphan the helper process Megatron's checkpoint saving starts.
A test that breaks a world gets it restarted for the next one.
"""
from __future__ import annotations

import threading

from tests.world import SharedWorld

_WORLDS: dict[int, SharedWorld] = {}


def shared_world(size: int) -> SharedWorld:
    """The process-wide `SharedWorld` of ``size`` ranks."""
    if size not in _WORLDS:
        _WORLDS[size] = SharedWorld(size)
    return _WORLDS[size]


def close_shared_worlds() -> None:
    """Stop every shared world's ranks cleanly, all worlds at once (idempotent)."""
    worlds = list(_WORLDS.values())
    _WORLDS.clear()
    threads = [threading.Thread(target=world.close) for world in worlds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
