"""What each rank of an `RLTrainer` holds for a fine-tuning job (``train.job``: sft, rm,
dpo, kto): one `FinetuneRun`, stepped on records the driver passes in."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mcore_rl.config import RLConfig
from mcore_rl.errors import UsageError


class FinetuneWorker:
    """One rank's fine-tuning run, built in the rank's process (`mcore_rl.flow.rank_context`)."""

    def __init__(self, cfg_data: dict):
        from mcore_rl.config.loader import _build
        from mcore_rl.finetune.loop import resume_or_start
        from mcore_rl.finetune.setup import build_finetune_run
        from mcore_rl.flow import rank_context
        from mcore_rl.rl.setup import initial_model_removed_on_failure

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        cfg = _build(RLConfig, cfg_data, "")
        ctx = rank_context()
        with initial_model_removed_on_failure(cfg, ctx):
            self.run = build_finetune_run(cfg, ctx)
            resume_or_start(self.run)

    def update(self, records: list[dict]) -> dict[str, float]:
        """One optimizer step on ``records`` (the job's record format)."""
        from mcore_rl.data.finetune_records import EXAMPLES
        from mcore_rl.finetune.loop import learn_from
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
        run.log.log(run.step, metrics, console=False)
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
                "log_dir": str(run.log.dir), "n_samples_per_prompt": run.cfg.rollout.n_samples_per_prompt}

    def close(self) -> None:
        from mcore_rl.finetune.loop import finish

        finish(self.run)
