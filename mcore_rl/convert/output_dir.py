"""All-or-nothing output directories: write into a temporary sibling, rename at the end."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mcore_rl.errors import UsageError


def check_output_dir(out: str | Path, force: bool) -> Path:
    """`UsageError` if ``out`` holds anything and ``force`` is off."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not empty (pass --force to replace it)")
    return out


@contextmanager
def atomic_output_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``out``; on success it becomes ``out``.

    On any error (or interrupt) the temporary directory is removed and ``out`` is untouched,
    so a failed run leaves no partial output. With ``force`` an existing ``out`` is replaced.
    """
    out = check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output is a normal directory
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        tmp.rename(out)
