"""Run checkpoints: every trained model's full state plus the loop's own state.

Layout: ``<root>/step_000010/{actor,critic}/`` (Megatron distributed checkpoints of each
`TrainEngine`, see ``mcore_rl.train.checkpoint``) and ``run_state.json`` (step, data
position, KL coefficient, ... whatever the loop needs to continue). ``<root>/latest`` names the newest *complete* step directory and
moves (atomic rename) only after every part of it is written, so a run killed mid-save
resumes from the previous checkpoint. The oldest directories beyond ``keep_last`` are removed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from mcore_rl.train.checkpoint import load_engine, save_engine


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunCheckpoints:
    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = max(1, keep_last)

    @classmethod
    def for_config(cls, cfg) -> "RunCheckpoints":
        """``checkpoint.dir`` (default ``<logging.dir>/checkpoints``) of an `RLConfig`."""
        return cls(cfg.checkpoint.dir or Path(cfg.logging.dir) / "checkpoints", cfg.checkpoint.keep_last)

    def resume_path(self, resume: str) -> Path | None:
        """What ``checkpoint.resume`` (auto | never | a path) asks to load, if anything."""
        if resume in ("never", ""):
            return None
        if resume == "auto":
            return self.latest()
        if not (Path(resume) / "run_state.json").is_file():
            raise FileNotFoundError(f"checkpoint.resume={resume} is not a complete checkpoint "
                                    "(no run_state.json)")
        return Path(resume)

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "run_state.json").is_file() else None

    def save(self, step: int, engines: dict, run_state: dict) -> Path:
        """Collective: every rank calls it with the same engines."""
        path = self.root / f"step_{step:06d}"
        for name, engine in engines.items():
            save_engine(engine, path / name)
        if dist.get_rank() == 0:
            _atomic_write(path / "run_state.json", json.dumps({"step": step, **run_state}))
            _atomic_write(self.root / "latest", path.name)
            self._prune(keep=path.name)
        dist.barrier()
        return path

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

    def _prune(self, keep: str) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name != keep)
        complete = [p for p in steps if (p / "run_state.json").is_file()]
        for old in complete[:max(0, len(complete) - (self.keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        for partial in (p for p in steps if p not in complete):
            shutil.rmtree(partial, ignore_errors=True)  # leftovers of an interrupted save
