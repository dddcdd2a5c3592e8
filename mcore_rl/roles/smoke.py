"""The trainer role of the ``smoke`` job: synthetic next-token steps on the Megatron ranks
(`mcore_rl.train.smoke.SmokeRun`), and its summary when the run ends."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mcore_rl.config import config_from_dict


class SmokeTrain:
    """One smoke run on every rank; called once per step, it ends the launch when done."""

    def __init__(self, cfg_data: dict, stop: Any = None):
        from mcore_rl.flow import rank_context
        from mcore_rl.roles.train import report_placement
        from mcore_rl.train.smoke import SmokeRun

        self.cfg = config_from_dict(cfg_data)
        self.stop = stop
        report_placement(rank_context())
        self.run = SmokeRun(self.cfg, rank_context())

    def __call__(self, item: Any = None) -> float | None:
        from mcore_rl.flow import finish_launch

        from mcore_rl.errors import StopRequested

        if self.run.step_count >= self.run.steps:
            finish_launch()
            return None
        try:
            return self.run.step(self.stop)
        except StopRequested as req:
            self.stop.acknowledge(self.run.ctx, req.step)
            raise

    def close(self) -> None:
        """The run's summary (rank 0): ``smoke_summary.json`` and one line."""
        run = self.run
        run.metrics.close()
        if run.ctx.rank != 0 or run.step_count < run.steps:
            return
        out = Path(self.cfg.logging.dir)
        out.mkdir(parents=True, exist_ok=True)
        losses = run.losses
        summary = {"layout": str(run.ctx.layout), "steps": len(losses), "losses": losses,
                   "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}
        (out / "smoke_summary.json").write_text(json.dumps(summary, indent=1))
        print(f"mcore-rl: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
              f"summary in {out / 'smoke_summary.json'}", flush=True)
