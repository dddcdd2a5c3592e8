"""Whether a run checkpoint can be loaded, found without loading it (no rank needed).

A step directory is usable when its ``run_state.json`` parses and names the step, and each
trained model's part (``actor/``, ``critic/``) is a complete Megatron distributed
checkpoint: its headers are there and every byte range the checkpoint's index points at
lies inside its data files (a save cut short by a full disk or a kill leaves them short).
"""
from __future__ import annotations

import json
from pathlib import Path


def checkpoint_problem(path: str | Path, parts: list[str]) -> str | None:
    """Why the run checkpoint at ``path`` cannot be loaded for ``parts``; None when it can."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    state = path / "run_state.json"
    if not state.is_file():
        return f"{path.name} has no run_state.json (its save did not finish)"
    try:
        step = json.loads(state.read_text())["step"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        return f"{state} is unreadable ({type(err).__name__}: {err})"
    if not isinstance(step, int):
        return f"{state} names no step"
    for part in parts:
        problem = model_checkpoint_problem(path / part)
        if problem:
            return f"{path.name}/{part}: {problem}"
    return None


def model_checkpoint_problem(path: Path) -> str | None:
    """Why the Megatron distributed checkpoint of one model at ``path`` is incomplete."""
    if not path.is_dir():
        return "missing (was it written by a run with another algorithm?)"
    for header in ("metadata.json", "common.pt", ".metadata"):
        if not (path / header).is_file():
            return f"{header} is missing"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as err:  # noqa: BLE001 - any unreadable index is the answer
        return f"its index (.metadata) is unreadable ({type(err).__name__})"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        data = path / name
        size = data.stat().st_size if data.is_file() else None
        if size is None:
            return f"data file {name} is missing"
        if size < end:
            return f"data file {name} is truncated ({size} of {end} bytes)"
    return None
