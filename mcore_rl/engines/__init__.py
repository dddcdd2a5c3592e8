"""Rollout engines behind one interface (`RolloutEngine`), registered by name in `ENGINES`.

    engine = build_rollout_engine(cfg.rollout, hf_dir, dtype="fp32", seed=cfg.train.seed)
    rollouts = engine.generate(prompt_ids, sampling_from_config(cfg.rollout, stop_ids),
                               seeds=per_prompt_seeds)      # controller (rank 0) only
    batch = rollouts.to_batch(pad_id)     # + rollout_logprobs, finish_reason, weight_version
    # sync: mcore_rl.reshard.WeightSync, on every trainer rank
    engine.sleep()          # colocated: the trainer updates (frees memory on GPU)
    engine.wake_weights(); sync.sync(version); engine.wake_kv_cache()   # then generate again

Importing this package never imports vLLM or SGLang; choosing an engine that is not
installed raises a one-line `UsageError` naming the package.
"""
from __future__ import annotations

from pathlib import Path

from mcore_rl.engines.base import (RolloutEngine, Rollouts, RolloutSample, SamplingConfig,
                                   WeightSyncError)
from mcore_rl.registry import Registry

ENGINES: Registry = Registry("rollout engine")
"""Engine name -> factory ``(cfg: RolloutConfig, model_dir, *, dtype, seed, max_model_len,
**kwargs) -> RolloutEngine``; each factory reads the fields of ``cfg`` that concern it and
imports its engine only when called. Facts of an entry: ``cpu_expert_updates`` (default
True: a CPU engine takes new expert weights), ``returns_routes`` (default False: it reports
the experts it routed each token to, for ``moe.routing_replay: rollout``), ``returns_kept_ids``
(default False: it reports each sampled token's kept set, for ``rollout.replay_sampling_mask``;
vLLM on GPUs only)."""


@ENGINES.register("vllm", cpu_expert_updates=False, returns_kept_ids=True)
def _vllm(cfg, model_dir, **kwargs) -> RolloutEngine:
    from mcore_rl.engines.vllm_engine import VLLMEngine

    kwargs.setdefault("weight_loading", cfg.weight_loading)
    kwargs.setdefault("timeout_s", cfg.engine_timeout_s)
    kwargs.setdefault("return_sampling_mask", cfg.replay_sampling_mask)
    # fused: the engine is owned by a trainer rank, stepped there (AsyncLLM's own loop and
    # engine process belong to the rollout role's process of the other placements)
    kwargs.setdefault("frontend", "llm" if cfg.placement == "fused" or kwargs.get("in_process")
                      else "async")
    return VLLMEngine(model_dir, **_common(cfg), **kwargs)


@ENGINES.register("sglang")
def _sglang(cfg, model_dir, **kwargs) -> RolloutEngine:
    from mcore_rl.engines.sglang_engine import SGLangEngine

    return SGLangEngine(model_dir, **_common(cfg), **kwargs)


@ENGINES.register("hf", returns_routes=True)
def _hf(cfg, model_dir, **kwargs) -> RolloutEngine:
    from mcore_rl.engines.hf_engine import HFEngine

    return HFEngine(model_dir, **_common(cfg), **kwargs)


@ENGINES.register("hf_batched", returns_kept_ids=True)
def _hf_batched(cfg, model_dir, **kwargs) -> RolloutEngine:
    from mcore_rl.engines.hf_batched_engine import HFBatchedEngine

    kwargs.setdefault("max_batch_rows", cfg.batch_rows)
    return HFBatchedEngine(model_dir, **_common(cfg), **kwargs)


def _common(cfg) -> dict:
    """The `RolloutConfig` fields every engine takes."""
    return {"tp": cfg.engine_tp, "placement": cfg.placement,
            "gpu_memory_utilization": cfg.gpu_memory_utilization}


def build_rollout_engine(cfg, model_dir: str | Path, *, dtype: str = "fp32", seed: int = 0,
                         **kwargs) -> RolloutEngine:
    """The engine ``cfg.engine`` (a `RolloutConfig`) for the HF model in ``model_dir``, with
    TP ``cfg.engine_tp`` and cores split by ``cfg.placement``. Extra keyword arguments go to
    the engine (e.g. ``max_model_len``, ``load_format="dummy"`` to start without weights)."""
    factory = ENGINES.get(cfg.engine)
    kwargs.setdefault("max_model_len", cfg.max_prompt_tokens + cfg.max_new_tokens)
    return factory(cfg, model_dir, dtype=dtype, seed=seed, **kwargs)


def sampling_from_config(cfg, stop_token_ids=(), seed: int | None = None) -> SamplingConfig:
    """`SamplingConfig` of a `RolloutConfig` (n, temperature, top-p/k, min/max new tokens)."""
    return SamplingConfig(n=cfg.n_samples_per_prompt, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                          min_new_tokens=cfg.min_new_tokens, stop_token_ids=tuple(stop_token_ids), seed=seed,
                          return_kept_ids=cfg.replay_sampling_mask)


__all__ = ["ENGINES", "RolloutEngine", "Rollouts", "RolloutSample", "SamplingConfig",
           "WeightSyncError", "build_rollout_engine", "sampling_from_config"]
