"""Byte counts: free space on a file system, and sizes in messages in a unit that shows
them (never "0.00 GiB")."""
from __future__ import annotations

import os


def free_bytes(directory: str | os.PathLike) -> int | None:
    """Bytes still free in ``directory``'s file system (None: unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def format_bytes(nbytes: int | None) -> str:
    """``1536`` -> ``"1.50 KiB"``; None -> ``"an unknown amount"``."""
    if nbytes is None:
        return "an unknown amount"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
