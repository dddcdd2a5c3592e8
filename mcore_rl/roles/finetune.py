"""The trainer role of the fine-tuning jobs (``train.job``: sft, rm, dpo, kto, online_dpo):
the Megatron ranks, each step reading its own records (`finetune_step`), or, driven by
`mcore_rl.RLTrainer`, stepping on records the driver passes in (`update`)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mcore_rl.config import config_from_dict
from mcore_rl.errors import UsageError


class FinetuneTrain:
    """One fine-tuning run on every rank (`mcore_rl.flow.rank_context`). Called once per step
    of the job's graph; once ``train.steps`` steps are done it ends the launch."""

    def __init__(self, cfg_data: dict, stop: Any = None):
        from mcore_rl.finetune.loop import resume_or_start
        from mcore_rl.finetune.setup import build_finetune_run
        from mcore_rl.flow import rank_context
        from mcore_rl.rl.setup import initial_model_removed_on_failure

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from mcore_rl.roles.train import report_placement

        cfg = config_from_dict(cfg_data)
        ctx = rank_context()
        report_placement(ctx)
        self.stop = stop
        with initial_model_removed_on_failure(cfg, ctx):
            self.run = build_finetune_run(cfg, ctx)
            resume_or_start(self.run)

    def __call__(self, item: Any = None) -> dict[str, float] | None:
        """The next step of the job, on records it reads itself; none once the run is done."""
        from mcore_rl.finetune.loop import after_step, finetune_step
        from mcore_rl.flow import finish_launch

        run = self.run
        if run.step >= run.cfg.train.steps:
            finish_launch()
            return None
        from mcore_rl.errors import StopRequested

        run.step += 1
        try:
            metrics = finetune_step(run)
            after_step(run, metrics, self.stop)
        except StopRequested as req:
            self.stop.acknowledge(run.ctx, req.step)
            raise
        except BaseException:
            run.log.close("failed")  # the trackers' runs end as failed; nothing else ends them
            raise
        return metrics

    def update(self, records: list[dict]) -> dict[str, float]:
        """One optimizer step on ``records`` (the job's record format), then what follows a
        step (`mcore_rl.RLTrainer.update`)."""
        from mcore_rl.data.finetune_records import EXAMPLES
        from mcore_rl.finetune.loop import after_step, learn_from
        from mcore_rl.finetune.setup import max_length

        run = self.run
        t0 = time.perf_counter()
        examples, _ = EXAMPLES[run.cfg.train.job](records, run.cfg, run.tokenizer, "update()'s records",
                                                  max_length(run.cfg))
        if len(examples) < run.ctx.dp:
            raise UsageError(f"update: {len(examples)} usable record(s) for {run.ctx.dp} "
                             "data-parallel ranks; pass at least one per rank")
        run.step += 1
        metrics = learn_from(run, run.job.batch(examples, run.tokenizer.pad_id), t0)
        after_step(run, metrics)
        return metrics

    def validate(self) -> dict[str, float]:
        from mcore_rl.finetune.loop import validate

        metrics = validate(self.run)
        self.run.log.log(self.run.step, metrics, console=False)
        return metrics

    def save(self, path: str | None) -> str:
        from mcore_rl.finetune.loop import save
        from mcore_rl.train.run_checkpoints import RunCheckpoints

        run = self.run
        if path is not None:
            run.checkpoints = RunCheckpoints(Path(path))
        return str(save(run))

    def info(self) -> dict[str, Any]:
        run = self.run
        return {"step": run.step, "weight_version": None, "layout": str(run.ctx.layout),
                "log_dir": str(run.log.dir), "max_staleness": None}

    def close(self) -> None:
        from mcore_rl.finetune.loop import finish

        finish(self.run)
