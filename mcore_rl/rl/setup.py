"""Everything one RL run holds: models and their engines, the rollout engine and the weight
sync, data, reward, KL control, logs and checkpoints (`RunState`, built by `build_run`)."""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from mcore_rl.algos import KLController, needs_critic
from mcore_rl.config import RLConfig
from mcore_rl.data.prompts import PromptRecord, PromptStream, load_prompt_records
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.metrics_log import MetricsLog
from mcore_rl.parallel import ParallelContext
from mcore_rl.rewards import RewardScorer
from mcore_rl.rewards.reward_model import REWARD_MODEL, check_reward_model
from mcore_rl.rl.dynamic_sampling import InformativeGroups
from mcore_rl.train.run_checkpoints import RunCheckpoints

if TYPE_CHECKING:  # heavy (Megatron, engines); built lazily in `build_run`
    from mcore_rl.data.batch import Batch
    from mcore_rl.engines.base import RolloutEngine
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.train.engine import TrainEngine


@dataclass
class RunState:
    cfg: RLConfig
    ctx: ParallelContext
    model_dir: Path
    """HF directory the run started from (tokenizer, config; the engine's initial weights)."""
    tokenizer: Tokenizer
    actor: TrainEngine
    """The policy."""
    reference: TrainEngine | None
    """The frozen reference policy (``algorithm.kl_coef > 0``)."""
    critic: TrainEngine | None
    """The value model (estimators that need a critic)."""
    rollout: RolloutEngine | None
    """The first rollout engine (controller rank only): a rollout role's, reached directly
    when fused into this rank, else through a proxy."""
    sync: WeightSync
    """Streams the actor's weights into the rollout engine (every rank)."""
    prompts: PromptStream
    val_records: list[PromptRecord]
    reward: RewardScorer
    """Scores responses (on the controller; its worker processes start with the first batch)."""
    kl: KLController
    log: MetricsLog
    checkpoints: RunCheckpoints
    vocab_size: int
    step: int = 0
    weight_version: int = 0
    last_batch: Batch | None = None
    """The latest step's rollout batch (for sample logs)."""
    stale_dropped: float = 0.0
    """Samples dropped as too stale since the last step (reported with the next one)."""
    stale_dropped_groups: float = 0.0
    """Their prompt groups."""
    stale_batches: int = 0
    """Batches the trainer took that made no step: every group in them was too stale."""
    taken_ahead: set = field(default_factory=set)
    """Stream positions past ``prompts.position`` whose streamed prompt groups the trainer
    has taken (they arrive in the order they finish; `mcore_rl.trainer.take_groups`)."""
    groups_seen: set = field(default_factory=set)
    """(step, index) of every prompt group taken (`mcore_rl.trainer.check_once`)."""
    dynamic: InformativeGroups | None = None
    """Dynamic sampling's pool of informative prompt groups (``algorithm.dynamic_sampling``),
    kept by checkpoints."""
    val_metrics: Callable[[Batch], dict[str, float]] | None = None
    """More metrics of the greedy validation responses, computed on the controller rank
    (e.g. ``val/rm_score``, the score of a reward model that runs elsewhere)."""

    @property
    def is_controller(self) -> bool:
        return self.ctx.is_controller

    @property
    def colocated(self) -> bool:
        """Engine and trainer take turns on the same devices (``rollout.placement``:
        colocated, or fused into the trainer's first rank)."""
        return self.cfg.rollout.placement in ("colocated", "fused")

    @property
    def validates(self) -> bool:
        """Greedy validation every ``train.val_every`` steps (off at 0 or ``data.num_val=0``)."""
        return bool(self.cfg.train.val_every and self.val_records)

    def trained_engines(self) -> dict[str, TrainEngine]:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}


def prepare_model_dir(cfg: RLConfig, ctx: ParallelContext) -> Path:
    """``model.path`` (a directory, or a built-in model prepared by rank 0 first), or for the
    built-in task a random tiny Llama written once by rank 0."""
    if cfg.model.path:
        from mcore_rl.models.builtin import resolve_model_path

        if ctx.is_controller:
            resolve_model_path(cfg.model.path)
        ctx.barrier()
        return resolve_model_path(cfg.model.path)
    if ctx.is_controller:
        write_initial_model(cfg)
    ctx.barrier()
    return initial_model_path(cfg)


def write_initial_model(cfg: RLConfig) -> Path:
    """The random tiny Llama (and the built-in task's tokenizer) of a run without
    ``model.path``, written once (temporary directory, then rename); the model is copied
    from the machine's cache of random models (`mcore_rl.models.random_init`)."""
    from mcore_rl.data.toy_task import toy_tokenizer
    from mcore_rl.models.random_init import copy_random_model

    out = initial_model_path(cfg)
    if not (out / "config.json").exists():
        tok = toy_tokenizer(cfg.data.source)
        tmp = out.with_name(out.name + ".tmp")
        copy_random_model(cfg.model, tmp, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id,
                          seed=cfg.train.seed)
        tok.save(tmp)
        tmp.rename(out)
    return out


def initial_model_path(cfg: RLConfig) -> Path:
    """Where a run without ``model.path`` writes its random initial model."""
    return Path(cfg.logging.dir) / "initial_model"


def writes_initial_model(cfg: RLConfig) -> bool:
    """Whether a run of ``cfg`` starting now writes its random initial model."""
    return not cfg.model.path and not initial_model_path(cfg).exists()


@contextmanager
def initial_model_removed_on_failure(cfg: RLConfig, ctx: ParallelContext, wrote: bool | None = None):
    """A run that fails before its first checkpoint takes the random initial model it wrote
    with it: a failed start leaves no ``initial_model/`` behind (after a checkpoint, resuming
    needs it, so it stays). ``wrote``: whether this run writes it (`writes_initial_model`
    when it started; default: asked now)."""
    wrote = writes_initial_model(cfg) if wrote is None else wrote
    try:
        yield
    except BaseException:
        if wrote and ctx.is_controller:
            remove_initial_model(cfg)
        raise


def remove_initial_model(cfg: RLConfig) -> None:
    """After a failed start: the random initial model removed, unless a checkpoint of the
    run needs it to resume."""
    if RunCheckpoints.for_config(cfg).latest() is None:
        shutil.rmtree(initial_model_path(cfg), ignore_errors=True)


def check_job(cfg: RLConfig) -> None:
    """What can be checked before any rank starts: registered names, the reward function,
    the prompt data (fields present). Raises a one-line `UsageError`."""
    import torch

    from mcore_rl.models.shape import model_shape
    from mcore_rl.rl.job_check import check_engine_capabilities, check_registered_names

    check_registered_names(cfg)
    if cfg.reward.name == REWARD_MODEL:  # scored by a worker group of its own
        check_reward_model(cfg)
    else:
        RewardScorer.from_config(cfg.reward)  # a reward that cannot run here refuses (starts nothing)
    check_engine_capabilities(cfg, model_shape(cfg.model).num_experts, torch.cuda.is_available())
    load_prompt_records(cfg.data, "train")
    load_prompt_records(cfg.data, "val")
    RunCheckpoints.for_config(cfg).resolve_resume(cfg.checkpoint.resume, trained_parts(cfg),
                                                  cfg.logging.dir)


def moe_options(cfg: RLConfig, policy: bool = False):
    """How the config's mixture-of-experts layers run (ignored by dense models). Only the
    ``policy`` replays routes (``moe.routing_replay``): the reference and the critic route
    by themselves."""
    from mcore_rl.models.moe import MoeOptions

    return MoeOptions(dispatcher=cfg.moe.dispatcher, aux_loss_coef=cfg.moe.aux_loss_coef,
                      routing_replay=policy and cfg.moe.routing_replay != "off")


def trained_parts(cfg: RLConfig) -> list[str]:
    """Names of the models a run trains and checkpoints (`RunState.trained_engines`)."""
    return ["actor"] + (["critic"] if needs_critic(cfg.algorithm.advantage_estimator) else [])


def build_run(cfg: RLConfig, ctx: ParallelContext, engines: list,
              reward: RewardScorer | None = None) -> RunState:
    """Everything a run holds, built collectively by the trainer ranks. ``engines``: the
    rollout engines (proxies of the rollout roles' engines, `mcore_rl.flow.lookup`), given on
    the controller rank (empty elsewhere): the weight sync streams into all of them;
    ``rollout`` is the first. ``reward``: what scores responses, as a `RewardScorer` does
    (default: the one of ``cfg.reward``)."""
    from mcore_rl.engines.sglang_shim import weight_update_group
    from mcore_rl.models import build_model
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.rl.job_check import check_registered_names
    from mcore_rl.train.build import build_engine

    algo = cfg.algorithm
    check_registered_names(cfg)  # unknown names fail before any work
    if reward is None:
        reward = RewardScorer.from_config(cfg.reward)  # a reward that cannot run refuses here
    model_dir = prepare_model_dir(cfg, ctx)
    tokenizer = load_tokenizer(model_dir)
    m = cfg.model
    moe = moe_options(cfg)
    sp = cfg.parallel.sequence_parallel
    actor_model = build_model(model_dir, ctx, role="actor", dtype=m.dtype, recompute=m.recompute,
                              seed=cfg.train.seed, moe=moe_options(cfg, policy=True), sequence_parallel=sp)
    vocab = actor_model.spec.arch.vocab_size
    share, packed = cfg.train.share_prompts, cfg.train.packing
    actor = build_engine(actor_model.chunks, ctx, vocab_size=vocab, optim=cfg.optimizer,
                         total_steps=cfg.train.steps * algo.ppo_epochs * algo.mini_batches,
                         share_prompts=share, packing=packed)
    reference = critic = None
    if algo.kl_coef > 0:
        ref_model = build_model(model_dir, ctx, role="reference", dtype=m.dtype, moe=moe, sequence_parallel=sp)
        reference = build_engine(ref_model.chunks, ctx, vocab_size=vocab, share_prompts=share,
                                 packing=packed)
    if needs_critic(algo.advantage_estimator):
        critic_model = build_model(m.critic_path or model_dir, ctx, role="critic", dtype=m.dtype,
                                   seed=cfg.train.seed, moe=moe, sequence_parallel=sp)
        critic = build_engine(critic_model.chunks, ctx, kind="value",
                              optim=replace(cfg.optimizer, lr=cfg.optimizer.critic_lr),
                              total_steps=cfg.train.steps * algo.ppo_epochs * algo.mini_batches,
                              share_prompts=share, packing=packed)
    rollout = engines[0] if ctx.is_controller and engines else None
    sync = WeightSync.from_config([getattr(c, "module", c) for c in actor.model],
                                  actor_model.spec.arch, cfg.reshard,
                                  engines=list(engines) if ctx.is_controller else None,
                                  controller=ctx.controller, group=ctx.world_group,
                                  engine=cfg.rollout.engine, sglang_group=weight_update_group)
    sync.drop_dead_engines = cfg.rollout.on_replica_failure == "continue"
    train_records = load_prompt_records(cfg.data, "train")
    val_records = load_prompt_records(cfg.data, "val")
    log = MetricsLog.for_config(cfg, enabled=ctx.is_controller)
    return RunState(cfg=cfg, ctx=ctx, model_dir=model_dir, tokenizer=tokenizer, actor=actor,
                    reference=reference, critic=critic, rollout=rollout, sync=sync,
                    prompts=PromptStream(train_records, cfg.data.seed), val_records=val_records,
                    reward=reward, kl=KLController(algo.kl_coef, algo.adaptive_kl_target),
                    log=log, checkpoints=RunCheckpoints.for_config(cfg),
                    vocab_size=vocab, dynamic=InformativeGroups.for_config(cfg))
