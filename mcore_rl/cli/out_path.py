"""Checks of an output file path given on the command line, before any work starts."""
from __future__ import annotations

from pathlib import Path

from mcore_rl.errors import UsageError


def check_out(path: str | None, option: str = "--out") -> None:
    """Refuse an output file (``option``) that cannot be written, before any work."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file path, "
                         f"e.g. {out / 'plan.json'}")
    if not out.parent.is_dir():
        raise UsageError(f"{option} {path}: directory {out.parent} does not exist; create it first")
