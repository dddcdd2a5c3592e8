"""Cross-field checks of an `RLConfig`, run before any rank starts.

Each failure is a `ConfigError` with one line naming the field, the reason and the fix.
"""
from __future__ import annotations

from pathlib import Path

from mcore_rl.config.sections import RLConfig
from mcore_rl.config.ranges import check_ranges
from mcore_rl.errors import ConfigError


def inline_shape(cfg: RLConfig):
    """The shape of a run's inline architecture (a run without ``model.path``); the shape of a
    checkpoint comes from ``mcore_rl.models.shape.model_shape`` (config/ reads no model)."""
    from types import SimpleNamespace

    m = cfg.model
    return SimpleNamespace(num_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                           num_kv_heads=m.num_kv_heads,
                           max_position_embeddings=m.max_position_embeddings,
                           num_experts=m.num_experts,
                           moe_intermediate_size=m.moe_intermediate_size if m.num_experts else 0)


def _shape(cfg: RLConfig, shape):
    if shape is not None:
        return shape
    if cfg.model.path:
        raise TypeError("validate_config: a run with model.path needs the model's shape "
                        "(mcore_rl.models.shape.model_shape)")
    return inline_shape(cfg)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate_layout(cfg: RLConfig, world_size: int | None = None, shape=None) -> int:
    """Check TP/PP/VPP/DP against the model (its ``shape``: the fields of
    ``mcore_rl.models.shape.ModelShape``) and the world; returns the data-parallel size."""
    p, shape = cfg.parallel, _shape(cfg, shape)
    for name in ("tp", "pp", "cpu_threads_per_rank"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    if world_size is not None and world_size < 1:
        raise ConfigError(f"the world size must be >= 1, got {world_size}; launch at least one rank")
    if shape.num_attention_heads % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide the model's {shape.num_attention_heads} attention "
            f"heads; choose one of {_divisors(shape.num_attention_heads)}")
    if shape.num_kv_heads % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide the model's {shape.num_kv_heads} KV heads "
            f"(Megatron-Core does not replicate KV heads); choose one of {_divisors(shape.num_kv_heads)}")
    if shape.num_layers % p.pp:
        raise ConfigError(f"parallel.pp={p.pp} does not divide the model's {shape.num_layers} "
                          f"layers; choose one of {_divisors(shape.num_layers)}")
    if p.vpp is not None:
        if p.vpp < 1:
            raise ConfigError(f"parallel.vpp must be >= 1 or null, got {p.vpp}")
        if p.pp < 2:
            raise ConfigError(f"parallel.vpp={p.vpp} needs parallel.pp >= 2 (interleaving splits "
                              "pipeline stages); set parallel.vpp=null or raise parallel.pp")
        if shape.num_layers % (p.pp * p.vpp):
            raise ConfigError(
                f"parallel.vpp={p.vpp}: pp*vpp={p.pp * p.vpp} does not divide the model's "
                f"{shape.num_layers} layers; each virtual stage needs a whole number of layers")
    if p.dp is not None and p.dp < 1:
        raise ConfigError(f"parallel.dp must be >= 1 or null, got {p.dp}")
    if p.cp > 1 and shape.num_experts:
        raise ConfigError(f"parallel.cp={p.cp}: context parallelism with a mixture-of-experts "
                          "model is not supported yet; set parallel.cp=1")
    _validate_experts(cfg, shape)
    if world_size is None:
        return p.dp or 1
    dp = _data_parallel_size(cfg, world_size)
    if shape.num_experts:
        etp = p.tp if p.etp is None else p.etp
        if (dp * p.tp) % (p.ep * etp):
            raise ConfigError(
                f"parallel: ep*etp = {p.ep}*{etp} does not divide the {dp * p.tp} ranks of a "
                f"pipeline stage (world size {world_size} / pp {p.pp}); Megatron places each "
                "expert group inside one stage: lower parallel.ep or launch more ranks")
    return dp


def _product(p) -> str:
    """``tp*pp*dp = 1*2*4`` (with cp when it is more than 1)."""
    if p.cp > 1:
        return f"tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp}"
    return f"tp*pp*dp = {p.tp}*{p.pp}*{p.dp}"


def _data_parallel_size(cfg: RLConfig, world_size: int) -> int:
    p = cfg.parallel
    model_parallel = p.tp * p.pp * p.cp
    if p.dp is not None:
        if model_parallel * p.dp != world_size:
            raise ConfigError(
                f"parallel: {_product(p)} = {model_parallel * p.dp} ranks, but the "
                f"world has {world_size}; set parallel.dp={world_size // model_parallel or 1} or "
                f"launch {model_parallel * p.dp} ranks")
        return p.dp
    if world_size % model_parallel:
        raise ConfigError(f"parallel: world size {world_size} is not a multiple of "
                          f"{'tp*pp*cp' if p.cp > 1 else 'tp*pp'} = "
                          f"{model_parallel}; launch a multiple of {model_parallel} ranks")
    return world_size // model_parallel


def _validate_experts(cfg: RLConfig, shape) -> None:
    """parallel.ep / parallel.etp against the model's experts."""
    p = cfg.parallel
    if p.ep < 1 or (p.etp is not None and p.etp < 1):
        raise ConfigError(f"parallel.ep and parallel.etp must be >= 1, got {p.ep} and {p.etp}")
    if not shape.num_experts:
        if p.ep > 1 or p.etp is not None:
            raise ConfigError(f"parallel.ep={p.ep}, parallel.etp={p.etp}: expert parallelism "
                              "needs a mixture-of-experts model and this one is dense; set "
                              "parallel.ep=1 and parallel.etp=null")
        return
    m = cfg.model
    if not m.path and m.experts_per_token > m.num_experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} exceeds model.num_experts="
                          f"{m.num_experts}; route each token to at most {m.num_experts} experts")
    if shape.num_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide the model's {shape.num_experts} "
                          f"experts; choose one of {_divisors(shape.num_experts)}")
    etp = p.tp if p.etp is None else p.etp
    if shape.moe_intermediate_size % etp:
        raise ConfigError(f"parallel.etp={etp} does not divide the model's expert FFN size "
                          f"{shape.moe_intermediate_size}; choose one of "
                          f"{_divisors(shape.moe_intermediate_size)}")


def validate_config(cfg: RLConfig, world_size: int | None = None, shape=None) -> RLConfig:
    """The config's own checks: ranges, layout against the model's ``shape`` (default: the
    inline architecture's), lengths and cross-field rules; raises `ConfigError` on the first
    problem. Which jobs, schedules and placements can run together is checked in one place
    above this (`mcore_rl.roles.rules`)."""
    check_ranges(cfg)
    shape = _shape(cfg, shape)
    dp = validate_layout(cfg, world_size, shape)
    if cfg.parallel.sequence_parallel and cfg.parallel.tp < 2:
        raise ConfigError("parallel.sequence_parallel=true splits each sequence over the tensor-"
                          f"parallel ranks, and parallel.tp={cfg.parallel.tp} has one; set "
                          "parallel.tp >= 2, or parallel.sequence_parallel=false")
    replay = cfg.moe.routing_replay
    if replay != "off" and not shape.num_experts:
        raise ConfigError(f"moe.routing_replay={replay} needs a mixture-of-experts model and this "
                          "one is dense; set moe.routing_replay=off")
    if replay != "off" and cfg.model.recompute == "full":
        raise ConfigError(f"moe.routing_replay={replay} with model.recompute=full: a recomputed "
                          "layer would route by the last micro-batch's replayed experts; set "
                          "model.recompute=selective (attention only) or none")
    r = cfg.rollout
    if r.min_new_tokens > r.max_new_tokens:
        raise ConfigError(f"rollout.min_new_tokens={r.min_new_tokens} exceeds rollout.max_new_tokens="
                          f"{r.max_new_tokens}; lower it or raise rollout.max_new_tokens")
    if cfg.train.job in FINETUNE_JOB_NAMES:
        validate_finetune(cfg, shape, dp)
    generates = (cfg.train.job not in FINETUNE_JOB_NAMES or cfg.train.job == "online_dpo"
                 or cfg.finetune.val_score)
    env = cfg.environment
    if env.name and cfg.train.job == "rl":
        if env.max_response_tokens < r.max_new_tokens:
            raise ConfigError(f"environment.max_response_tokens={env.max_response_tokens} is below "
                              f"rollout.max_new_tokens={r.max_new_tokens}, the length of one turn; "
                              "raise it (it bounds all turns and observations together)")
        if r.max_prompt_tokens + env.max_response_tokens > shape.max_position_embeddings:
            raise ConfigError(
                f"rollout.max_prompt_tokens + environment.max_response_tokens = {r.max_prompt_tokens}"
                f" + {env.max_response_tokens} exceeds the model's {shape.max_position_embeddings} "
                "positions (max_position_embeddings); lower one of them")
    if generates and r.max_prompt_tokens + r.max_new_tokens > shape.max_position_embeddings:
        raise ConfigError(
            f"rollout.max_prompt_tokens + rollout.max_new_tokens = {r.max_prompt_tokens} + "
            f"{r.max_new_tokens} exceeds the model's {shape.max_position_embeddings} positions "
            "(max_position_embeddings); lower one of them")
    o = cfg.optimizer
    if o.min_lr > max(o.lr, o.critic_lr):
        raise ConfigError(f"optimizer.min_lr={o.min_lr:g} is above optimizer.lr={o.lr:g}; the "
                          "decay ends at min_lr: lower it")
    a = cfg.algorithm
    if a.dynamic_sampling and cfg.train.job == "rl":
        if a.advantage_estimator not in GROUP_ESTIMATORS:
            raise ConfigError(f"algorithm.dynamic_sampling filters prompt groups with equal rewards, "
                              f"which only group estimators need; algorithm.advantage_estimator="
                              f"{a.advantage_estimator}: use {' or '.join(GROUP_ESTIMATORS)}, or set "
                              "algorithm.dynamic_sampling=false")
        if r.n_samples_per_prompt < 2:
            raise ConfigError("algorithm.dynamic_sampling compares the samples of a prompt, but "
                              "rollout.n_samples_per_prompt=1; set it to 2 or more")
    _validate_sandbox(cfg)
    validate_paths(cfg)
    return cfg


def _validate_sandbox(cfg: RLConfig) -> None:
    """reward.sandbox=remote needs the service's address."""
    rw = cfg.reward
    if rw.sandbox == "remote" and not rw.sandbox_url.startswith(("http://", "https://")):
        raise ConfigError(f"reward.sandbox=remote needs reward.sandbox_url, the http(s):// address "
                          f"of a sandbox service, got {rw.sandbox_url!r}; set it, or use "
                          "reward.sandbox=namespaces")


FINETUNE_JOB_NAMES = ("sft", "rm", "dpo", "kto", "online_dpo")
GROUP_ESTIMATORS = ("grpo", "rloo")
"""Advantage estimators that compare the samples of a prompt group."""


def validate_finetune(cfg: RLConfig, shape, dp: int) -> None:
    """The supervised and preference jobs: lengths, batch against the layout, warm start."""
    f, p, job = cfg.finetune, cfg.parallel, cfg.train.job
    if f.max_length is not None and f.max_length > shape.max_position_embeddings:
        raise ConfigError(f"finetune.max_length={f.max_length} exceeds the model's "
                          f"{shape.max_position_embeddings} positions (max_position_embeddings); "
                          "lower it")
    unit = "pairs" if job in ("dpo", "rm") else "records"
    per_rank = p.pp if p.vpp else 1  # the interleaved schedule needs pp micro-batches per rank
    if f.batch_size < dp * per_rank:
        need = dp * per_rank
        raise ConfigError(f"finetune.batch_size={f.batch_size} {unit} cannot feed {dp} data-parallel "
                          f"rank(s){' with ' + str(p.pp) + ' interleaved stages' if p.vpp else ''}; "
                          f"set finetune.batch_size >= {need}")
    if job == "online_dpo" and cfg.rollout.n_samples_per_prompt != 2:
        raise ConfigError(f"rollout.n_samples_per_prompt={cfg.rollout.n_samples_per_prompt}: online DPO "
                          "pairs two responses per prompt; set rollout.n_samples_per_prompt=2")
    if job == "rm" and cfg.train.warm_start_steps:
        raise ConfigError("train.warm_start_steps: the supervised warm start trains a causal LM, "
                          "not a reward model's scalar head; set train.warm_start_steps=0 for "
                          "train.job=rm (warm-start the LM with train.job=sft first)")


def validate_paths(cfg: RLConfig) -> None:
    """Output paths that must be directories (or not exist yet)."""
    for name, value in (("logging.dir", cfg.logging.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if not value:
            continue
        path = Path(value)
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            where = "" if existing == path else f" ({existing} is a file)"
            raise ConfigError(f"{name}={value} is not a directory{where}; choose a directory "
                              "for the run's outputs")
