"""Run checkpoints: every trained model's full state plus the loop's own state.

Layout: ``<root>/step_000010/{actor,critic}/`` (Megatron distributed checkpoints of each
`TrainEngine`, see ``mcore_rl.train.checkpoint``) and ``run_state.json`` (step, data
position, KL coefficient, ... whatever the loop needs to continue), beside any objects of
the loop's own (``<name>.pt``, e.g. dynamic sampling's pool). ``<root>/latest`` names the newest *complete* step directory and
moves (atomic rename) only after every part of it is written, so a run killed mid-save
resumes from the previous checkpoint. The oldest directories beyond ``keep_last`` are removed.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.atomic_write import write_text_atomic
from mcore_rl.errors import NonFiniteError, UsageError
from mcore_rl.parallel.agreement import all_gather, raise_if_any
from mcore_rl.sizes import format_bytes, free_bytes
from mcore_rl.train.checkpoint import load_engine, save_engine
from mcore_rl.train.checkpoint_check import checkpoint_problem


FULL_BELOW = 4 * 2**20
"""A save that failed with less than this left on its file system failed for lack of room
(the checkpoint writers do not always say so: "unexpected pos 704 vs 598")."""


def _save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then a rename: never a partial file at ``path``."""
    part = path.with_name(path.name + ".part")
    torch.save(obj, part)
    os.replace(part, path)


class CheckpointSpaceError(UsageError):
    """The checkpoint directory's file system cannot hold the next checkpoint."""


def _free_bytes(directory: Path) -> int | None:
    """Free bytes on the file system that holds (or will hold) ``directory``."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("."))
    return free_bytes(existing)


def _out_of_space(err: BaseException) -> bool:
    """Whether ``err`` or an error it came from is ENOSPC (a full disk). The checkpoint
    writers' own errors reach the saving rank only as text."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if os.strerror(errno.ENOSPC) in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _state_nbytes(engine) -> int:
    """This rank's bytes of ``engine``'s weights and (Adam) optimizer state, in fp32."""
    params = sum(p.numel() for chunk in engine.model for p in chunk.parameters()) * 4
    return params * (3 if engine.optimizer is not None else 1)


@dataclass(frozen=True)
class Resume:
    """Where a run continues from (None: a fresh start) and the broken checkpoints skipped."""

    path: Path | None
    skipped: list[str]


class RunCheckpoints:
    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = max(1, keep_last)

    @classmethod
    def for_config(cls, cfg) -> "RunCheckpoints":
        """``checkpoint.dir`` (default ``<logging.dir>/checkpoints``) of an `RLConfig`."""
        return cls(cfg.checkpoint.dir or Path(cfg.logging.dir) / "checkpoints", cfg.checkpoint.keep_last)

    def resolve_resume(self, resume: str, parts: list[str], log_dir: str | Path) -> Resume:
        """What ``checkpoint.resume`` (auto | never | a path) loads, decided from the files
        alone (every rank decides the same). auto: the newest usable checkpoint, skipping
        broken ones (named in `Resume.skipped`); when none is usable but ``log_dir`` or the
        checkpoint directory holds an earlier run, a one-line `UsageError` instead of
        starting over over it. A path that cannot be loaded: a `UsageError`."""
        if resume in ("never", ""):
            return Resume(None, [])
        if resume != "auto":
            problem = checkpoint_problem(resume, parts)
            if problem:
                raise UsageError(f"checkpoint.resume={resume} cannot be loaded: {problem}; give a "
                                 "complete step directory, or checkpoint.resume=auto")
            return Resume(Path(resume), [])
        skipped = []
        for candidate in self.candidates():
            problem = checkpoint_problem(candidate, parts)
            if problem is None:
                return Resume(candidate, skipped)
            skipped.append(problem)
        if skipped or self._earlier_metrics(log_dir):
            found = f" ({'; '.join(skipped)})" if skipped else ""
            raise UsageError(
                f"checkpoint.resume=auto: {log_dir} holds an earlier run but no usable "
                f"checkpoint{found}; resume from a step directory with checkpoint.resume=PATH, "
                "or start afresh, replacing its logs, with checkpoint.resume=never")
        return Resume(None, [])

    def candidates(self) -> list[Path]:
        """Step directories to resume from, best first: the one ``latest`` names, then the
        others from the newest."""
        steps = sorted((p for p in self.root.glob("step_*") if p.is_dir()), reverse=True)
        pointer = self.root / "latest"
        named = self.root / pointer.read_text().strip() if pointer.is_file() else None
        return ([named] if named is not None else []) + [p for p in steps if p != named]

    def latest(self) -> Path | None:
        """The newest step directory with a run state (not checked further)."""
        return next((p for p in self.candidates() if (p / "run_state.json").is_file()), None)

    @staticmethod
    def _earlier_metrics(log_dir: str | Path) -> bool:
        """Whether ``log_dir`` holds metrics of trained steps (step >= 1)."""
        path = Path(log_dir) / "metrics.jsonl"
        if not path.is_file():
            return False
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) >= 1:
                    return True
            except json.JSONDecodeError:
                return True  # a log of some kind: not ours to remove
        return False

    def save(self, step: int, engines: dict, run_state: dict,
             objects: dict[str, Any] | None = None) -> Path:
        """Collective: every rank calls it with the same engines. Weights that are not finite
        are never written (`NonFiniteError`). ``objects``: the loop's own state beyond JSON
        (each written as ``<name>.pt`` by the first rank; `load_object`)."""
        broken = [name for name, engine in engines.items() if not engine.weights_finite()]
        if broken:
            raise NonFiniteError(f"step {step}: the {', '.join(broken)} weights are not finite; no "
                                 f"checkpoint was written (the newest one in {self.root} stays)")
        path = self.root / f"step_{step:06d}"
        need = self._check_room(step, engines)
        if dist.get_rank() == 0:  # saved again (a resumed run redoes a step): incomplete until
            (path / "run_state.json").unlink(missing_ok=True)  # every part is the new one
            for old in path.glob("*.pt"):  # and none of the earlier save's objects stays
                old.unlink()
        dist.barrier()
        try:
            for name, engine in engines.items():
                save_engine(engine, path / name)
        except BaseException as err:  # torch's CheckpointException is a BaseException
            full = self._out_of_room(err)
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)  # a partial step keeps the disk full
            if full:
                raise CheckpointSpaceError(
                    f"checkpoint.dir {self.root}: no space left while saving step {step} (it needs "
                    f"about {format_bytes(need)}, {format_bytes(_free_bytes(self.root))} free "
                    "without it); the partial step was removed and the newest complete checkpoint "
                    "stays; free space or point checkpoint.dir elsewhere") from None
            raise
        if dist.get_rank() == 0:
            for name, obj in (objects or {}).items():
                _save_atomic(obj, path / f"{name}.pt")
            write_text_atomic(path / "run_state.json", json.dumps({"step": step, **run_state}))
            write_text_atomic(self.root / "latest", path.name)
            self._prune(keep=path.name)
        dist.barrier()
        return path

    def _out_of_room(self, err: BaseException) -> bool:
        """Whether a save failed for lack of room: ENOSPC, or a file system left all but full
        (the writers' own error may only say "unexpected pos 704 vs 598")."""
        if isinstance(err, KeyboardInterrupt):
            return False
        free = _free_bytes(self.root)
        return _out_of_space(err) or (free is not None and free < FULL_BELOW)

    def _check_room(self, step: int, engines: dict) -> int:
        """Bytes a save of ``engines`` needs (the previous checkpoint's size, or an estimate
        from the weights and optimizer state); refused on every rank before anything is
        written when the file system holds less."""
        previous = self.latest()
        if previous is not None:
            need = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file())
        else:
            local = sum(_state_nbytes(engine) for engine in engines.values())
            dp = next(iter(engines.values())).ctx.dp if engines else 1
            need = sum(all_gather(local)) // max(1, dp)
        free = _free_bytes(self.root)
        problem = None
        if free is not None and free < need:
            problem = (f"checkpoint.dir {self.root} has {format_bytes(free)} free, but saving step {step} "
                       f"needs about {format_bytes(need)}; nothing was written and the newest complete "
                       "checkpoint stays; free space or point checkpoint.dir elsewhere")
        raise_if_any(problem, error=CheckpointSpaceError)
        return need

    def load(self, path: str | Path, engines: dict) -> dict:
        """Load every engine's state from ``path``; returns the run state (with ``step``)."""
        path = Path(path)
        state = json.loads((path / "run_state.json").read_text())
        for name, engine in engines.items():
            if not (path / name).exists():
                raise FileNotFoundError(f"checkpoint {path} has no '{name}' state; was it written "
                                        "by a run with the same algorithm?")
            load_engine(engine, path / name)
        return state

    @staticmethod
    def load_object(path: str | Path, name: str) -> Any:
        """An object `save` kept beside the run state; None if the checkpoint has none (one
        written before the loop kept it)."""
        file = Path(path) / f"{name}.pt"
        return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else None

    def _prune(self, keep: str) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name != keep)
        complete = [p for p in steps if (p / "run_state.json").is_file()]
        for old in complete[:max(0, len(complete) - (self.keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        for partial in (p for p in steps if p not in complete):
            shutil.rmtree(partial, ignore_errors=True)  # leftovers of an interrupted save
