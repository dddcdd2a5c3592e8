"""Cross-field checks of an `RLConfig`, run before any rank starts.

Each failure is a `ConfigError` with one line naming the field, the reason and the fix.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mcore_rl.config.sections import RLConfig
from mcore_rl.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """What the layout checks need to know about the model."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int


def model_shape(cfg: RLConfig) -> ModelShape:
    """From the model's config.json when ``model.path`` is set, else the inline fields."""
    m = cfg.model
    if not m.path:
        return ModelShape(m.num_layers, m.num_attention_heads, m.num_kv_heads)
    from mcore_rl.models.builtin import resolve_model_path

    config_file = resolve_model_path(m.path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path: '{m.path}' has no config.json; point it at a HuggingFace "
                          "checkpoint directory or a `mcore-rl convert hf-to-mcore` output")
    hf = json.loads(config_file.read_text())
    try:
        heads = int(hf["num_attention_heads"])
        return ModelShape(int(hf["num_hidden_layers"]), heads,
                          int(hf.get("num_key_value_heads") or heads))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"model.path: {config_file} lacks {err}; is it a decoder LM config?") from None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate_layout(cfg: RLConfig, world_size: int | None = None) -> int:
    """Check TP/PP/VPP/DP against the model and the world; returns the data-parallel size."""
    p, shape = cfg.parallel, model_shape(cfg)
    for name in ("tp", "pp", "cpu_threads_per_rank"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
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
    if world_size is None:
        return p.dp or 1
    model_parallel = p.tp * p.pp
    if p.dp is not None:
        if model_parallel * p.dp != world_size:
            raise ConfigError(
                f"parallel: tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {model_parallel * p.dp} ranks, but the "
                f"world has {world_size}; set parallel.dp={world_size // model_parallel or 1} or "
                f"launch {model_parallel * p.dp} ranks")
        return p.dp
    if world_size % model_parallel:
        raise ConfigError(f"parallel: world size {world_size} is not a multiple of tp*pp = "
                          f"{model_parallel}; launch a multiple of {model_parallel} ranks")
    return world_size // model_parallel


def validate_config(cfg: RLConfig, world_size: int | None = None) -> RLConfig:
    """All cross-field checks; raises `ConfigError` on the first problem."""
    validate_layout(cfg, world_size)
    r = cfg.rollout
    if r.n_samples_per_prompt < 1:
        raise ConfigError("rollout.n_samples_per_prompt must be >= 1")
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if r.temperature < 0:
        raise ConfigError(f"rollout.temperature must be >= 0, got {r.temperature}")
    if cfg.reshard.verify_every < 1:
        raise ConfigError(f"reshard.verify_every must be >= 1, got {cfg.reshard.verify_every}")
    if not 0 <= r.min_new_tokens <= r.max_new_tokens:
        raise ConfigError(f"rollout.min_new_tokens must be between 0 and rollout.max_new_tokens="
                          f"{r.max_new_tokens}, got {r.min_new_tokens}")
    if cfg.algorithm.dual_clip is not None and cfg.algorithm.dual_clip <= 1.0:
        raise ConfigError(f"algorithm.dual_clip must be > 1 (or null), got {cfg.algorithm.dual_clip}")
    if cfg.optimizer.lr < 0:
        raise ConfigError(f"optimizer.lr must be >= 0, got {cfg.optimizer.lr}")
    if cfg.train.steps < 0:
        raise ConfigError(f"train.steps must be >= 0, got {cfg.train.steps}")
    return cfg
