"""Everything one RL run holds: models and their engines, the rollout engine and the weight
sync, data, reward, KL control, logs and checkpoints (`RunState`, built by `build_run`)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist

from mcore_rl.algos import ADVANTAGE_ESTIMATORS, NEEDS_CRITIC, KLController
from mcore_rl.config import RLConfig
from mcore_rl.data.prompts import PromptRecord, PromptStream, load_prompt_records
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.parallel import ParallelContext
from mcore_rl.rewards import REWARDS
from mcore_rl.metrics_log import MetricsLog
from mcore_rl.train.run_checkpoints import RunCheckpoints


@dataclass
class RunState:
    cfg: RLConfig
    ctx: ParallelContext
    model_dir: Path
    """HF directory the run started from (tokenizer, config; the engine's initial weights)."""
    tokenizer: Tokenizer
    actor: object
    """`TrainEngine` of the policy."""
    reference: object | None
    critic: object | None
    rollout: object | None
    """The rollout engine (controller rank only)."""
    sync: object
    """`WeightSync` into the rollout engine (every rank)."""
    prompts: PromptStream
    val_records: list[PromptRecord]
    reward_fn: object
    kl: KLController
    log: MetricsLog
    checkpoints: RunCheckpoints
    vocab_size: int
    step: int = 0
    weight_version: int = 0
    last_batch: object = None
    """The latest step's rollout batch (for sample logs)."""

    @property
    def is_controller(self) -> bool:
        return self.ctx.rank == 0

    def trained_engines(self) -> dict:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}


def prepare_model_dir(cfg: RLConfig, ctx: ParallelContext) -> Path:
    """``model.path`` (a directory, or a built-in model prepared by rank 0 first), or for the
    built-in task a random tiny Llama written once by rank 0."""
    if cfg.model.path:
        from mcore_rl.models.builtin import resolve_model_path

        if ctx.rank == 0:
            resolve_model_path(cfg.model.path)
        dist.barrier()
        return resolve_model_path(cfg.model.path)
    from mcore_rl.data.toy_task import toy_tokenizer
    from mcore_rl.models.random_init import write_random_llama

    out = Path(cfg.logging.dir) / "initial_model"
    if ctx.rank == 0 and not (out / "config.json").exists():
        tok = toy_tokenizer()
        tmp = out.with_name(out.name + ".tmp")
        write_random_llama(cfg.model, tmp, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id,
                           seed=cfg.train.seed)
        tok.save(tmp)
        tmp.rename(out)
    dist.barrier()
    return out


def check_job(cfg: RLConfig) -> None:
    """What can be checked before any rank starts: registered names, the reward function,
    the prompt data (fields present). Raises a one-line `UsageError`."""
    from mcore_rl.algos import POLICY_LOSSES

    ADVANTAGE_ESTIMATORS.get(cfg.algorithm.advantage_estimator)
    POLICY_LOSSES.get(cfg.algorithm.policy_loss)
    REWARDS.get(cfg.reward.name if cfg.reward.name != "builtin" else "exact")
    load_prompt_records(cfg.data, "train")
    load_prompt_records(cfg.data, "val")


def build_run(cfg: RLConfig, ctx: ParallelContext) -> RunState:
    from mcore_rl.engines import build_rollout_engine
    from mcore_rl.models import build_model
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.train.build import build_engine

    algo = cfg.algorithm
    ADVANTAGE_ESTIMATORS.get(algo.advantage_estimator)  # unknown names fail before any work
    reward_fn = REWARDS.get(cfg.reward.name if cfg.reward.name != "builtin" else "exact")
    model_dir = prepare_model_dir(cfg, ctx)
    tokenizer = load_tokenizer(model_dir)
    m = cfg.model
    actor_model = build_model(model_dir, ctx, role="actor", dtype=m.dtype, recompute=m.recompute_activations,
                              seed=cfg.train.seed)
    vocab = actor_model.spec.arch.vocab_size
    actor = build_engine(actor_model.chunks, ctx, vocab_size=vocab, optim=cfg.optimizer,
                         total_steps=cfg.train.steps * algo.ppo_epochs * algo.mini_batches)
    reference = critic = None
    if algo.kl_coef > 0:
        ref_model = build_model(model_dir, ctx, role="reference", dtype=m.dtype)
        reference = build_engine(ref_model.chunks, ctx, vocab_size=vocab)
    if algo.advantage_estimator in NEEDS_CRITIC:
        critic_model = build_model(m.critic_path or model_dir, ctx, role="critic", dtype=m.dtype,
                                   seed=cfg.train.seed)
        critic = build_engine(critic_model.chunks, ctx, kind="value",
                              optim=replace(cfg.optimizer, lr=cfg.optimizer.critic_lr),
                              total_steps=cfg.train.steps * algo.ppo_epochs * algo.mini_batches)
    rollout = None
    if ctx.rank == 0:
        rollout = build_rollout_engine(cfg.rollout, model_dir, dtype=m.dtype, seed=cfg.train.seed)
    sync = WeightSync.from_config([getattr(c, "module", c) for c in actor.model],
                                  actor_model.spec.arch, cfg.reshard,
                                  engines=[rollout] if rollout else None)
    train_records = load_prompt_records(cfg.data, "train")
    val_records = load_prompt_records(cfg.data, "val")
    log = MetricsLog(cfg.logging.dir, cfg.train.steps, tensorboard=cfg.logging.tensorboard,
                     progress_bar=cfg.logging.progress_bar, enabled=ctx.rank == 0)
    return RunState(cfg=cfg, ctx=ctx, model_dir=model_dir, tokenizer=tokenizer, actor=actor,
                    reference=reference, critic=critic, rollout=rollout, sync=sync,
                    prompts=PromptStream(train_records, cfg.data.seed), val_records=val_records,
                    reward_fn=reward_fn, kl=KLController(algo.kl_coef, algo.adaptive_kl_target),
                    log=log, checkpoints=RunCheckpoints.for_config(cfg),
                    vocab_size=vocab)
