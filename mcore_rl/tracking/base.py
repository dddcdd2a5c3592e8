"""The tracker interface, its registry, and the checks that run before any rank starts."""
from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_rl.errors import UsageError
from mcore_rl.registry import Registry

TRACKERS: Registry[type["Tracker"]] = Registry("tracker")
"""``logging.backends`` names -> `Tracker` classes (``module:Class`` for one of your own)."""


OUTCOMES = ("finished", "stopped", "failed")
"""How a run's attempt ended: all its steps (or as many as its driver asked for), stopped on
request to be resumed (a preemption), or failed."""


@dataclass
class RunInfo:
    """What a tracker knows of the run it records."""

    dir: Path
    """``logging.dir``: where local trackers write, and where run ids are kept for resume."""
    logging: Any
    """The run's `LoggingConfig` (``logging.wandb``, ``logging.mlflow``)."""
    config: dict = field(default_factory=dict)
    """The whole config as a mapping (W&B's run config, MLflow's params and artifact)."""

    @property
    def name(self) -> str:
        return self.dir.resolve().name


class Tracker:
    """One place metrics go. `start` is called once, before anything is logged, with the
    step the run resumes after (None: a fresh run); then `log` and `samples` per step;
    `close` at the end, with the run's ``outcome`` (`OUTCOMES`) and its artifacts (the
    reward-curve plot) to keep.

    A tracker that keeps a run on a service records its id with ``remember`` and finds it
    again with ``recall`` on resume (``logging.dir``/trackers.json), so a resumed run
    continues the same tracked run."""

    name = "tracker"
    package: str | None = None
    """The package the backend needs (checked before the run starts)."""

    def __init__(self, run: RunInfo):
        self.run = run

    @classmethod
    def check(cls, logging) -> None:
        """Raise `UsageError` (one line) if this backend cannot start with ``logging``."""
        if cls.package and importlib.util.find_spec(cls.package) is None:
            raise UsageError(f"logging.backends has {cls.name}, and the {cls.package} package is "
                             f"not installed; pip install {cls.package}, or remove {cls.name} "
                             "from logging.backends")

    def start(self, resumed_after: int | None) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def samples(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self, outcome: str = "finished", artifacts: tuple[Path, ...] = ()) -> None:
        pass

    # ----- run ids kept for resume --------------------------------------------------------
    def _ids(self) -> tuple[Path, dict[str, str]]:
        """``logging.dir``/trackers.json and the run ids it holds, by tracker name."""
        import json

        path = self.run.dir / "trackers.json"
        return path, json.loads(path.read_text()) if path.exists() else {}

    def recall(self) -> str | None:
        return self._ids()[1].get(self.name)

    def remember(self, run_id: str) -> None:
        from mcore_rl.atomic_write import write_json_atomic

        path, ids = self._ids()
        write_json_atomic(path, {**ids, self.name: run_id})


def git_revision() -> str | None:
    """The commit of the working directory's git checkout, if there is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def flat(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config mapping as ``section.field`` -> value."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
