"""Model directories made once per machine and reused: SmolLM2 converted from its package
(`mcore_rl.models.smollm2`), and the random initial models of runs without ``model.path``
(`mcore_rl.models.random_init`). They live under ``$MCORE_RL_CACHE`` (default
``~/.cache/mcore-rl``) and may be deleted at any time: what is missing is made again."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

COMPLETE = ".complete"
"""The file a directory of the cache holds once it is whole (written last, before the rename)."""


def default_cache_dir() -> Path:
    """``$MCORE_RL_CACHE`` or ``~/.cache/mcore-rl``."""
    return Path(os.environ.get("MCORE_RL_CACHE", Path.home() / ".cache" / "mcore-rl"))


def made_once(out: Path, make: Callable[[Path], None], note: str = "") -> Path:
    """``out``, made by ``make(directory)`` unless a whole copy is there already. ``make``
    writes into a fresh directory beside ``out``, which is renamed to ``out`` once complete,
    so that processes racing to make it never see half a directory (the first whole copy
    wins). ``note``: the text of the `COMPLETE` file (what the directory was made from)."""
    if (out / COMPLETE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        make(tmp)
        (tmp / COMPLETE).write_text(note)
        if out.is_dir() and not (out / COMPLETE).is_file():
            shutil.rmtree(out, ignore_errors=True)  # an incomplete copy left by a killed writer
        try:
            tmp.rename(out)
        except OSError:
            if not (out / COMPLETE).is_file():  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
