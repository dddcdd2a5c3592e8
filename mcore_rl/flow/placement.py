"""Putting a controller's processes on its devices.

On CPU a device is a core id of the node the process runs on. Ray's CPUs are logical (it
sets no affinity), so a process with devices pins itself and sizes torch's thread pool to
them; a process without devices reserves nothing and runs wherever the OS puts it."""
from __future__ import annotations

import os
from typing import Sequence

from mcore_rl.errors import UsageError


def pin_to_cores(cores: Sequence[int] | None) -> None:
    """Pin this process to ``cores`` and give torch one intra-op thread per core.

    Affinity is per thread on Linux and a Ray actor runs its methods on several threads,
    so every thread of the process is pinned; threads started later inherit it."""
    if not cores:
        return
    allowed = os.sched_getaffinity(0)
    if not set(cores) <= allowed:
        raise UsageError(f"devices {list(cores)} are not cores of this node "
                         f"(it may use {sorted(allowed)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    import torch

    torch.set_num_threads(len(cores))


def split_devices(devices: Sequence[int] | None, parts: int) -> list[tuple[int, ...] | None]:
    """``devices`` dealt out in equal, contiguous shares to ``parts`` processes."""
    if devices is None:
        return [None] * parts
    if len(devices) % parts:
        raise UsageError(f"{len(devices)} devices cannot be shared equally by {parts} workers")
    share = len(devices) // parts
    return [tuple(devices[i * share:(i + 1) * share]) for i in range(parts)]
