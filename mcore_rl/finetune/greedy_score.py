"""Greedy ``val/score`` of a fine-tuned policy (``finetune.val_score``): the task's
validation prompts (``data``), answered greedily by the rollout engine (``rollout.engine``)
after a weight sync, scored by the reward (``reward.name``), as the RL job measures it.

The phases of the RL step do the work (`mcore_rl.rl.phases`); `ScoreState` holds what they
read of a run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mcore_rl.config import RLConfig
from mcore_rl.parallel import ParallelContext


@dataclass
class ScoreState:
    cfg: RLConfig
    ctx: ParallelContext
    tokenizer: object
    actor: object
    rollout: object
    """The rollout engine (controller rank only)."""
    sync: object
    reward: object
    """The `RewardScorer` (closed by `close`)."""
    val_records: list
    vocab_size: int
    step: int = 0
    weight_version: int = 0

    @property
    def is_controller(self) -> bool:
        return self.ctx.is_controller

    @property
    def colocated(self) -> bool:
        return self.cfg.rollout.placement == "colocated"


def build_score_state(cfg: RLConfig, ctx: ParallelContext, model_dir: Path, tokenizer, model, arch,
                      always: bool = False) -> ScoreState | None:
    """The engine and weight sync for greedy validation (and, ``always``, for an online
    job's sampling); None when neither needs them."""
    if not always and not (cfg.finetune.val_score and cfg.train.val_every and cfg.data.num_val):
        return None
    from mcore_rl.data.prompts import load_prompt_records
    from mcore_rl.engines import build_rollout_engine
    from mcore_rl.engines.sglang_shim import weight_update_group
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.rewards import RewardScorer

    rollout = None
    if ctx.is_controller:
        from mcore_rl.reshard.native import engine_options

        rollout = build_rollout_engine(cfg.rollout, model_dir, dtype=cfg.model.dtype,
                                       seed=cfg.train.seed, log_file=Path(cfg.logging.dir) / "engine.log",
                                       **engine_options(cfg.reshard))
    sync = WeightSync.from_config([getattr(c, "module", c) for c in model.model], arch, cfg.reshard,
                                  engines=[rollout] if rollout else None,
                                  controller=ctx.controller, group=ctx.world_group,
                                  engine=cfg.rollout.engine, sglang_group=weight_update_group)
    return ScoreState(cfg=cfg, ctx=ctx, tokenizer=tokenizer, actor=model, rollout=rollout, sync=sync,
                      reward=RewardScorer.from_config(cfg.reward),
                      val_records=load_prompt_records(cfg.data, "val"), vocab_size=arch.vocab_size)


def greedy_score(state: ScoreState, step: int) -> dict[str, float]:
    """Sync the current weights into the engine, answer the validation prompts greedily,
    and return the mean reward as ``val/score`` (with the sync's own metrics)."""
    from mcore_rl.rl import phases

    state.step = step
    metrics = {} if state.cfg.train.job == "online_dpo" else phases.sync_weights(state)
    batch = phases.score(state, phases.generate(state, state.val_records, greedy=True))
    return {"val/score": batch["scores"].mean().item(),
            **{k: v for k, v in metrics.items() if k == "sync/verify_max_abs_diff"}}


def close(state: ScoreState | None) -> None:
    if state is not None:
        state.reward.close()
    if state is not None and state.rollout is not None:
        state.rollout.close()
