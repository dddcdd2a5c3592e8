"""``wandb``: a Weights & Biases run (``logging.wandb``), through the ``wandb`` package.

The run's config and its git revision go into the W&B config; each step's metrics are one
history row at that step; sample rollouts are a table (``samples``) at the steps that write
them. Offline runs (``logging.wandb.mode=offline`` or ``WANDB_MODE=offline``) are files under
``logging.dir``/wandb, uploaded later with ``wandb sync``.

On resume the same W&B run continues (its id is kept in ``logging.dir``/trackers.json). W&B
keeps the first value logged for a step and ignores steps below the last one it has: the
steps a killed attempt logged after its last checkpoint keep that attempt's values, and
the resumed attempt's rows start after them."""
from __future__ import annotations

import math
import netrc
import os
import uuid
from urllib.parse import urlparse

from mcore_rl.errors import UsageError
from mcore_rl.tracking.base import TRACKERS, Tracker, git_revision


def mode_of(logging) -> str:
    return logging.wandb.mode or os.environ.get("WANDB_MODE", "") or "online"


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


@TRACKERS.register("wandb")
class WandbTracker(Tracker):
    name = "wandb"
    package = "wandb"

    @classmethod
    def check(cls, logging) -> None:
        super().check(logging)
        mode = mode_of(logging)
        if mode not in ("online", "offline", "disabled", "dryrun", "run"):
            raise UsageError(f"WANDB_MODE={mode} is not a W&B mode; use online, offline or disabled")
        if mode in ("online", "run") and not _has_api_key():
            raise UsageError("logging.backends has wandb in online mode, and no W&B API key is set "
                             "(WANDB_API_KEY, or 'wandb login'); set one, or "
                             "logging.wandb.mode=offline (upload later with 'wandb sync')")

    def start(self, resumed_after: int | None) -> None:
        import wandb

        cfg = self.run.logging.wandb
        run_id = self.recall() if resumed_after is not None else None
        self.wb = wandb.init(
            project=cfg.project, entity=cfg.entity or None, name=cfg.run_name or self.run.name,
            id=run_id or uuid.uuid4().hex[:12], resume="allow", mode=mode_of(self.run.logging),
            dir=str(self.run.dir), config={**self.run.config, "git_revision": git_revision()},
            settings=wandb.Settings(console="off", silent=True))
        self.remember(self.wb.id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.wb.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def samples(self, step: int, rows: list[dict]) -> None:
        import wandb

        columns = ["prompt", "response", "reward"]
        self.wb.log({"samples": wandb.Table(columns=columns,
                                            data=[[r[c] for c in columns] for r in rows])}, step=step)

    def close(self, outcome: str = "finished", artifacts=()) -> None:
        import wandb

        for path in artifacts:
            if path.suffix == ".png":
                self.wb.log({path.stem: wandb.Image(str(path))})
        if outcome == "stopped":  # to be resumed: W&B shows it preempted, not failed
            self.wb.mark_preempting()
        self.wb.finish(exit_code=1 if outcome == "failed" else 0)
