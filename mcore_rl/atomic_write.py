"""Files written whole or not at all: a temporary file beside the target, renamed over it.

A reader (or a resumed run) never sees half a file: the rename is atomic on one file
system, and a failure before it leaves the target as it was and no temporary behind.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` to ``path`` (its directory must exist) through ``.<name>.tmp<pid>``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: str | Path, data: Any, indent: int = 1) -> Path:
    """``data`` as JSON (and a final newline) to ``path``, as `write_text_atomic` does."""
    return write_text_atomic(path, json.dumps(data, indent=indent) + "\n")
