"""The range of every numeric config field, checked before any rank starts.

Every float must be finite (``.inf`` or ``nan`` never reach a rank); the fields below must
also lie in their range. A field set to ``null`` (where its type allows it) is not checked.
Each failure is one line naming the field, the value, the range and the fix.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

from mcore_rl.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (``<`` where the bound is open); None: unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    fix: str = ""
    """How to choose a value, where the range alone does not say it."""

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"{'<' if self.high_open else '<='} {self.high:g}"


COUNT = Range(low=1)
"""A number of things that cannot be zero."""
NON_NEGATIVE = Range(low=0)
POSITIVE = Range(low=0, low_open=True)
FRACTION = Range(low=0, high=1)

RANGES: dict[str, Range] = {
    **{f"model.{name}": COUNT for name in ("num_layers", "hidden_size", "intermediate_size",
                                           "num_attention_heads", "num_kv_heads", "vocab_size",
                                           "max_position_embeddings", "experts_per_token",
                                           "moe_intermediate_size")},
    "model.num_experts": Range(low=0, fix="0 is a dense model"),
    "parallel.tp": COUNT, "parallel.pp": COUNT, "parallel.vpp": COUNT, "parallel.dp": COUNT,
    "parallel.cp": COUNT,
    "parallel.cpu_threads_per_rank": COUNT, "parallel.ep": COUNT, "parallel.etp": COUNT,
    "moe.aux_loss_coef": NON_NEGATIVE,
    "rollout.engine_tp": COUNT,
    "rollout.replicas": COUNT,
    "rollout.n_samples_per_prompt": Range(low=1, fix="the group size of GRPO/RLOO, e.g. 4 or 8"),
    "rollout.max_new_tokens": COUNT,
    "rollout.min_new_tokens": NON_NEGATIVE,
    "rollout.max_prompt_tokens": COUNT,
    "rollout.temperature": NON_NEGATIVE,
    "rollout.top_k": Range(low=-1, fix="-1 turns top-k off"),
    "rollout.top_p": Range(low=0, high=1, low_open=True),
    "rollout.gpu_memory_utilization": Range(low=0, high=1, low_open=True),
    "rollout.engine_timeout_s": POSITIVE,
    "rollout.batch_rows": COUNT,
    "reshard.bucket_mb": POSITIVE,
    "reshard.writer_threads": COUNT,
    "reshard.verify_every": COUNT,
    "reshard.full_every": COUNT,
    "reshard.verify_tolerance": POSITIVE,
    "reshard.verify_prompts": COUNT,
    "reshard.verify_new_tokens": COUNT,
    "algorithm.clip_ratio_low": Range(low=0, high=1, high_open=True),
    "algorithm.clip_ratio_high": NON_NEGATIVE,
    "algorithm.dual_clip": Range(low=1, low_open=True, fix="c > 1 bounds the loss of negative "
                                                          "advantages; null turns it off"),
    "algorithm.value_clip": POSITIVE,
    "algorithm.gamma": FRACTION,
    "algorithm.lam": FRACTION,
    "algorithm.kl_coef": NON_NEGATIVE,
    "algorithm.adaptive_kl_target": POSITIVE,
    "algorithm.entropy_coef": NON_NEGATIVE,
    "algorithm.ppo_epochs": COUNT,
    "algorithm.mini_batches": COUNT,
    "environment.max_turns": COUNT,
    "environment.max_response_tokens": COUNT,
    "algorithm.dynamic_sampling_max_rounds": Range(low=0, fix="0: no extra round, the step "
                                                              "trains on the informative groups "
                                                              "of its own"),
    "algorithm.is_cap": Range(low=0, low_open=True, fix="the largest importance weight a token "
                                                        "gets, e.g. 2.0"),
    "rollout.mismatch_warn": Range(low=1, fix="the error is >= 1 by definition; e.g. 1.1"),
    "rollout.mismatch_stop": Range(low=1, fix="the error is >= 1 by definition; e.g. 1.5"),
    "algorithm.is_mask_low": NON_NEGATIVE,
    "algorithm.is_mask_high": Range(low=0, low_open=True, fix="the highest trusted ratio of "
                                                              "the current to the behaviour "
                                                              "policy, e.g. 2.0"),
    "optimizer.lr": NON_NEGATIVE,
    "optimizer.critic_lr": NON_NEGATIVE,
    "optimizer.min_lr": NON_NEGATIVE,
    "optimizer.warmup_steps": NON_NEGATIVE,
    "optimizer.weight_decay": NON_NEGATIVE,
    "optimizer.adam_beta1": Range(low=0, high=1, high_open=True),
    "optimizer.adam_beta2": Range(low=0, high=1, high_open=True),
    "optimizer.adam_eps": POSITIVE,
    "optimizer.clip_grad": Range(low=0, fix="0 turns clipping off"),
    "optimizer.micro_batch_tokens": COUNT,
    "data.prompts_per_step": COUNT,
    "data.num_val": Range(low=0, fix="0 means no validation"),
    "reward.workers": Range(low=0, fix="0 scores in the scoring process itself"),
    "reward.rm_tp": COUNT, "reward.rm_pp": COUNT, "reward.rm_dp": COUNT,
    "reward.async_slots": COUNT,
    "reward.timeout_s": Range(low=0, fix="0 turns the limit off"),
    "reward.max_failure_fraction": Range(low=0, high=1, fix="0 stops at the first failed "
                                                            "sample, 1 never stops"),
    "reward.code_time_limit_s": POSITIVE,
    "reward.code_memory_mb": Range(low=16, fix="the program's address space, e.g. 512"),
    "checkpoint.save_every": Range(low=0, fix="0 saves only at the end"),
    "checkpoint.keep_last": COUNT,
    "logging.log_every": COUNT,
    "logging.samples_every": Range(low=0, fix="0 turns sample logs off"),
    "logging.samples_per_step": Range(low=0, fix="0 writes every sample of the step"),
    "launch.nodes": COUNT,
    "launch.gpus_per_node": COUNT,
    "launch.cpus_per_node": Range(low=0, fix="0 takes the cluster's default"),
    "launch.signal_lead_s": NON_NEGATIVE,
    "launch.preflight_timeout_s": COUNT,
    "launch.ray_reconnect_timeout_s": COUNT,
    "train.steps": NON_NEGATIVE,
    "train.val_every": Range(low=0, fix="0 turns validation off"),
    "train.warm_start_steps": NON_NEGATIVE,
    "train.warm_start_lr": NON_NEGATIVE,
    "train.warm_start_batch": COUNT,
    "train.max_staleness": Range(low=0, fix="0 keeps every update on-policy"),
    "finetune.batch_size": COUNT,
    "finetune.max_length": COUNT,
    "finetune.beta": Range(low=0, low_open=True, fix="e.g. 0.1"),
    "finetune.label_smoothing": Range(low=0, high=0.5, high_open=True,
                                      fix="0 is plain DPO; conservative DPO takes e.g. 0.1"),
    "finetune.rpo_alpha": Range(low=0, fix="0 is plain DPO; RPO takes e.g. 1.0"),
    "finetune.desirable_weight": POSITIVE,
    "finetune.undesirable_weight": POSITIVE,
}


UNBOUNDED = ("data.seed", "train.seed", "reward.truncation_penalty", "reward.failure_score",
             "reward.weights")
"""Numeric fields any (finite) value of which is meaningful."""


def fields_of(cfg, prefix: str = ""):
    """(dotted name, value, annotation) of every leaf field of a config dataclass."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from fields_of(value, name + ".")
        else:
            yield name, value, hints[f.name]


def check_ranges(cfg) -> None:
    """Every float finite and every field of `RANGES` in its range; `ConfigError` otherwise."""
    for name, value, _ in _with_mapping_entries(fields_of(cfg)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}; set {name} to a "
                              f"finite value{_range_hint(name)}")
        rng = RANGES.get(name)
        if rng is not None and not rng.holds(value):
            hint = f" ({rng.fix})" if rng.fix else ""
            raise ConfigError(f"{name} must be {rng.describe()}, got {value:g}; set {name} to a "
                              f"value {rng.describe()}{hint}")
    algorithm = getattr(cfg, "algorithm", None)
    if algorithm is not None and hasattr(algorithm, "is_mask_low") \
            and algorithm.is_mask_low >= algorithm.is_mask_high:
        raise ConfigError(f"algorithm.is_mask_low ({algorithm.is_mask_low:g}) must be below "
                          f"algorithm.is_mask_high ({algorithm.is_mask_high:g}); set a band "
                          "such as is_mask_low=0.5 is_mask_high=2.0")


def _with_mapping_entries(fields):
    """The fields, with a mapping field's entries as fields of their own (``a.b.key``)."""
    for name, value, tp in fields:
        if isinstance(value, dict):
            yield from ((f"{name}.{key}", v, tp) for key, v in value.items())
        else:
            yield name, value, tp


def _range_hint(name: str) -> str:
    rng = RANGES.get(name)
    return f" {rng.describe()}" if rng is not None else ""
