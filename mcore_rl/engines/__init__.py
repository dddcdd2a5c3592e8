"""Rollout engines behind one interface (`RolloutEngine`), registered by name in `ENGINES`.

    engine = build_rollout_engine(cfg.rollout, hf_dir, dtype="fp32", seed=cfg.train.seed)
    rollouts = engine.generate(prompt_ids, sampling_from_config(cfg.rollout, stop_ids),
                               seeds=per_prompt_seeds)      # controller (rank 0) only
    batch = rollouts.to_batch(pad_id)     # + rollout_logprobs, finish_reason, weight_version
    ... train ...
    sync.sync(version)          # mcore_rl.reshard.WeightSync, on every trainer rank
    engine.sleep() / engine.wake()        # colocated: around training (frees memory on GPU)

Importing this package never imports vLLM or SGLang; choosing an engine that is not
installed raises a one-line `UsageError` naming the package.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from mcore_rl.engines.base import (RolloutEngine, Rollouts, RolloutSample, SamplingConfig,
                                   WeightSyncError)
from mcore_rl.errors import UsageError


def _vllm(model_dir, **kwargs) -> RolloutEngine:
    from mcore_rl.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, **kwargs)


def _sglang(model_dir, **kwargs) -> RolloutEngine:
    from mcore_rl.engines.sglang_engine import SGLangEngine

    return SGLangEngine(model_dir, **kwargs)


def _hf(model_dir, **kwargs) -> RolloutEngine:
    from mcore_rl.engines.hf_engine import HFEngine

    return HFEngine(model_dir, **kwargs)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"vllm": _vllm, "sglang": _sglang, "hf": _hf}
"""Engine name -> factory ``(model_dir, tp=, dtype=, seed=, placement=, ...) -> RolloutEngine``."""


def build_rollout_engine(cfg, model_dir: str | Path, *, dtype: str = "fp32", seed: int = 0,
                         **kwargs) -> RolloutEngine:
    """The engine ``cfg.engine`` (a `RolloutConfig`) for the HF model in ``model_dir``, with
    TP ``cfg.engine_tp`` and cores split by ``cfg.placement``. Extra keyword arguments go to
    the engine (e.g. ``max_model_len``, ``load_format="dummy"`` to start without weights)."""
    if cfg.engine not in ENGINES:
        raise UsageError(f"unknown rollout engine {cfg.engine!r} (engines: {', '.join(ENGINES)})")
    max_len = kwargs.pop("max_model_len", cfg.max_prompt_tokens + cfg.max_new_tokens)
    if cfg.engine == "vllm":
        kwargs.setdefault("weight_loading", cfg.weight_loading)
    return ENGINES[cfg.engine](model_dir, tp=cfg.engine_tp, dtype=dtype, seed=seed,
                               placement=cfg.placement, max_model_len=max_len,
                               gpu_memory_utilization=cfg.gpu_memory_utilization, **kwargs)


def sampling_from_config(cfg, stop_token_ids=(), seed: int | None = None) -> SamplingConfig:
    """`SamplingConfig` of a `RolloutConfig` (n, temperature, top-p/k, min/max new tokens)."""
    return SamplingConfig(n=cfg.n_samples_per_prompt, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                          min_new_tokens=cfg.min_new_tokens, stop_token_ids=tuple(stop_token_ids), seed=seed)


__all__ = ["ENGINES", "RolloutEngine", "Rollouts", "RolloutSample", "SamplingConfig",
           "WeightSyncError", "build_rollout_engine", "sampling_from_config"]
