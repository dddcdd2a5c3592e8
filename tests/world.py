"""Multi-rank worlds shared by the whole test session, one per size.

Starting a world (spawning ranks, importing megatron.core on each) costs 10-30 s on the CI
machine, so every test module asks `shared_world(n)` for the process-wide world of n ranks:
started on first use, restarted after a test that broke it, and stopped cleanly at the end
of the session (tests/conftest.py), so that what its ranks started (vLLM engines among them)
ends with them.
"""
from __future__ import annotations

import threading

from mcore_rl.parallel.local_world import RankFailure, SharedWorld

__all__ = ["RankFailure", "SharedWorld", "shared_world", "close_shared_worlds"]

_WORLDS: dict[int, SharedWorld] = {}


def shared_world(size: int) -> SharedWorld:
    """The session-wide `SharedWorld` of ``size`` ranks."""
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
