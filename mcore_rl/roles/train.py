"""The trainer role of an RL graph: the Megatron ranks, a scored rollout batch in, one RL
step (`mcore_rl.trainer.train_step`), the weight sync into the engines, and what follows a
step (validation, logs, checkpoints, the stop check)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from mcore_rl.config import config_from_dict
from mcore_rl.data.batch import Batch
from mcore_rl.rewards.reward_model import REWARD_MODEL


def report_placement(ctx) -> None:
    """One line from the controller rank: how many ranks run on how many Ray nodes."""
    import torch.distributed as dist

    from mcore_rl.flow import ray_shim

    nodes = [None] * ctx.world_size
    here = ray_shim.node_id() if ray_shim.require().is_initialized() else None
    dist.all_gather_object(nodes, here, group=ctx.world_group)
    if ctx.is_controller:
        where = f"on {len(set(nodes))} Ray node(s)" if here is not None else "in one world"
        print(f"mcore-rl: {ctx.world_size} trainer rank(s), layout {ctx.layout}, {where}",
              flush=True)


class Train:
    """A trainer role for the Megatron strategy: a scored rollout `Batch` -> one RL step
    (`mcore_rl.trainer.train_step`: log-probs, KL, values, advantages, the update, the
    weight sync into the engines published as ``engines``), then what follows a step of
    ``mcore-rl train``: validation every ``train.val_every`` steps (greedy, on the first
    engine), logs, samples and checkpoints. Before the first step it resumes or
    warm-starts (`resume_or_warm_start`), then, with ``initial_sync``, syncs the weights if
    nothing did yet (engines built elsewhere may hold other weights; the RL graph's engines
    start from the trainer's own initial model).

    Each step's metrics (returned and logged) carry, from the second step on,
    ``time/batch_interval``: the wall time from the end of the previous step (its
    validation, logs and checkpoint included) to the end of this one's update and sync: the
    step's wall time as the graph runs it, hops between controllers included (with overlap,
    the time per trained batch); and ``time/trainer_idle_s``, the wait for the batch."""

    def __init__(self, cfg_data: dict, model_dir: str | Path, engines: Sequence[str],
                 initial_sync: bool = True, stop: Any = None, colocated: bool = False):
        from dataclasses import replace

        from mcore_rl.flow import lookup, rank_context
        from mcore_rl.rl import phases
        from mcore_rl.rl.setup import build_run, initial_model_removed_on_failure
        from mcore_rl.trainer import resume_or_warm_start

        cfg = config_from_dict(cfg_data)
        cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
        if not colocated:
            # The engines run beside the trainer: no hand-over (sleep, wake) around the update.
            cfg = replace(cfg, rollout=replace(cfg.rollout, placement="separate"))
        self.stop = stop
        ctx = rank_context()
        report_placement(ctx)
        remote = [lookup(name) for name in engines] if ctx.is_controller else []
        reward = val_metrics = None
        if cfg.reward.name == REWARD_MODEL:  # the reward controller's model scores rollouts
            from mcore_rl.roles.reward_model import trainer_rewards

            reward, client = trainer_rewards(cfg, ctx.is_controller)
            val_metrics = client.validation_metrics
        with initial_model_removed_on_failure(cfg, ctx):
            self.state = build_run(cfg, ctx, engines=remote, reward=reward)
            self.state.val_metrics = val_metrics
            resume_or_warm_start(self.state)
            if initial_sync and self.state.weight_version == 0:
                phases.sync_weights(self.state)
        self.last_end: float | None = None

    def __call__(self, batch: Batch) -> dict[str, float]:
        from mcore_rl.errors import StopRequested
        from mcore_rl.trainer import after_step, train_step

        state = self.state
        arrived = time.perf_counter()
        try:
            metrics = train_step(state, batch)
            if metrics is None:  # pooled for dynamic sampling, or nothing fresh enough
                return {}
            if self.last_end is not None:
                metrics["time/batch_interval"] = time.perf_counter() - self.last_end
                metrics["time/trainer_idle_s"] = arrived - self.last_end  # waiting for the batch
            after_step(state, metrics, stop=self.stop)
        except StopRequested as req:
            self.stop.acknowledge(state.ctx, req.step)
            raise
        except BaseException:
            state.log.close("failed")  # the trackers' runs end as failed; nothing else ends them
            raise
        self.last_end = time.perf_counter()
        if state.dynamic is not None and state.step >= state.cfg.train.steps and state.is_controller:
            from mcore_rl.flow import finish_launch

            finish_launch()  # the data holds spare rounds for dynamic sampling: stop here
        return metrics

    def validate(self) -> float:
        """The greedy validation score now (`mcore_rl.RLTrainer.validate`), logged."""
        from mcore_rl.rl.step_metrics import validation_score

        score = validation_score(self.state)
        self.state.log.log(self.state.step, {"val/score": score}, console=False)
        return score

    def save(self, path: str | None) -> str:
        """A checkpoint of the run in ``path`` (default ``checkpoint.dir``)."""
        from mcore_rl.train.run_checkpoints import RunCheckpoints
        from mcore_rl.trainer import save_checkpoint

        checkpoints = None if path is None else RunCheckpoints(Path(path))
        return str(save_checkpoint(self.state, checkpoints))

    def info(self) -> dict[str, Any]:
        s = self.state
        return {"step": s.step, "weight_version": s.weight_version, "layout": str(s.ctx.layout),
                "log_dir": str(s.log.dir), "max_staleness": s.cfg.train.max_staleness}

    def close(self) -> None:
        from mcore_rl.trainer import finish

        finish(self.state)
