"""Ray round trips a process waited on, counted where the runtime makes them.

What counts: a get from a stream and the fetch of what it returned, a pacing wait, a call
on another process's published object (`mcore_rl.flow.services`), and a call the runtime
makes into a worker group (a fan-out to N ranks is one). What does not: the acknowledgement
of a put, which the producer waits for while the consumer already works on the item, and
fire-and-forget reports. A controller's stats carry the count of its calls
(`ControllerStats.round_trips`); summed over the roles a synchronous step passes through,
that is the step's critical path in round trips (`FlowStats.round_trips_per_step`)."""
from __future__ import annotations

import threading

_lock = threading.Lock()
_count = 0


def add(n: int = 1) -> None:
    """Record ``n`` round trips this process waited on."""
    global _count
    with _lock:
        _count += n


def total() -> int:
    """Round trips this process has waited on so far."""
    return _count
