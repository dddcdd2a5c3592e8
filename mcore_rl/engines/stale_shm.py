"""Shared memory that killed engines left behind, removed at the next start.

vLLM's engine processes talk through POSIX shared memory (``/dev/shm/psm_*``, and
``vllm_dist_*`` between the ranks of a tensor-parallel CPU engine) and semaphores
(``/dev/shm/sem.mp-*``); a process killed with SIGKILL cannot unlink them, so
each killed run leaves some in the tmpfs (RAM). A file is stale when it belongs to this
user, is older than a minute, and no running process maps or holds it open.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

PATTERNS = ("psm_*", "sem.mp-*", "vllm_dist_*")
MIN_AGE_S = 60.0


def _in_use(directory: str, pids=None) -> set[str]:
    """Paths in ``directory`` that some process (of ``pids``; default all we may look
    into) maps or has open."""
    prefix = directory.rstrip("/") + "/"
    used: set[str] = set()
    procs = [Path("/proc") / str(pid) for pid in pids] if pids is not None else \
        [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    for proc in procs:
        try:
            for line in (proc / "maps").read_text().splitlines():
                if prefix in line:
                    used.add(line[line.index(prefix):].split(" (deleted)")[0])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target)
        except OSError:
            continue  # gone, or not ours to read
    return used


def stale_shared_memory(directory: str = "/dev/shm") -> list[Path]:
    """Leftovers of killed engine processes in ``directory`` (see the module doc)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    now, uid = time.time(), os.getuid()
    candidates = []
    for pattern in PATTERNS:
        for path in root.glob(pattern):
            try:
                st = path.stat()
            except OSError:
                continue
            if st.st_uid == uid and now - st.st_mtime > MIN_AGE_S:
                candidates.append(path)
    if not candidates:
        return []
    used = _in_use(str(root.resolve()))
    return [p for p in candidates if str(p.resolve()) not in used]


def remove_stale_shared_memory(directory: str = "/dev/shm") -> tuple[int, int]:
    """Remove the leftovers; (files removed, bytes freed)."""
    removed = freed = 0
    for path in stale_shared_memory(directory):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        removed, freed = removed + 1, freed + size
    return removed, freed


def shared_memory_of(pids, directory: str = "/dev/shm") -> set[str]:
    """The shared-memory files that the processes ``pids`` map or hold open."""
    return _in_use(str(Path(directory).resolve()), pids)


def remove_unused(paths, directory: str = "/dev/shm") -> int:
    """Unlink those of ``paths`` that no running process maps or holds any more (those of
    processes just killed); how many were removed."""
    if not paths:
        return 0
    used = _in_use(str(Path(directory).resolve()))
    removed = 0
    for path in paths:
        if path in used:
            continue
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
