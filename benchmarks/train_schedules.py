"""`mcore-rl bench train --schedule sync,one_step_off,async`: the training schedules against
``sync`` in one run, with natural response lengths.

Per size, each schedule trains ``mcore-rl train`` from the same initial weights on the same
prompts, each in a fresh process, with responses that end at end-of-sequence (up to the
config's ``rollout.max_new_tokens``): ``sync`` (K = 0), ``one_step_off`` (K = 1) and
``async`` (K = ``--k``), each with the config's placement. Figures are medians over the
steps of the steady state: after the warm-up steps, and before the last step (during which
an overlapping schedule has no next step to generate):

- **tokens/s end to end**: prompt + response tokens of a step over its wall time as the
  graph runs it (``time/batch_interval``: with overlap, the time per trained batch);
  ``one_step_off_vs_sync`` and ``async_vs_sync`` compare them (target >= 0.95x);
- **response lengths**: the median over steps of each step's p50 and p90, and the longest;
- **idle and occupancy**: the trainer's share of the steps' wall time spent waiting for its
  batch, the engine's share spent generating (``time/generate``; ``async``: the step's wall time less
  the rollout's idle seconds), the engine's mean batch occupancy (``async``), the largest
  token staleness;
- **engine_continuous_batching** (``mcore_rl.benchmarks._engine_batching``): engine tokens
  per busy second, continuous batching on vLLM's ``AsyncLLM`` (a sequence admitted as
  another finishes, up to the K+1 steps' sequences that the async schedule admits at
  ``--k``) against static batching (one step's prompts per blocking call, waiting for the
  longest), on the same prompts (target >= 1.2x); **engine_async_vs_stepped**: the same
  continuous batching on ``AsyncLLM`` against the blocking engine stepped from Python
  (target >= 1.0x), and **engine_stepped_continuous_batching** that stepped engine against
  static batching; with the decode rate at several occupancies and the prefill rate.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from mcore_rl.benchmarks._common import run_spec_module, throughput_comparison
from mcore_rl.errors import UsageError

SCHEDULES = ("sync", "one_step_off", "async")
TARGETS = {"engine_continuous_batching": 1.2, "engine_async_vs_stepped": 1.0,
           "engine_stepped_continuous_batching": 1.0,
           "one_step_off_vs_sync": 0.95, "async_vs_sync": 1.0}
ENGINE = {
    "quickstart": {"prompts": 16, "occupancies": [1, 8, 32], "decode_tokens": 8},
    "smollm2": {"prompts": 32, "occupancies": [1, 8, 16, 32, 64], "decode_tokens": 32},
}
"""The engine benchmark per size: prompts (four or eight steps' worth),
occupancies of the decode-rate curve and the tokens decoded at each."""


LENGTHS = {"smollm2": ["rollout.max_new_tokens=256", "optimizer.micro_batch_tokens=2048"]}
"""Natural lengths need room: the size's changes for this benchmark (SmolLM2's responses
run long: up to 256 tokens). Micro-batches of 2048 tokens instead of 4096 keep the trainer
rank's peak at 9 GB instead of 11 GB in fp32 on CPU (one 32-sequence update at these
lengths), beside the engine within a 24 GB machine, at the same step time."""


def parse_schedules(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCHEDULES]
    if unknown or not names:
        raise UsageError(f"--schedule {text!r}: give comma-separated schedules of "
                         f"{', '.join(SCHEDULES)}, e.g. --schedule sync,one_step_off,async")
    if "sync" not in names:
        raise UsageError(f"--schedule {text!r} has no sync: every schedule is compared against "
                         "sync in the same run; add it, e.g. --schedule sync,async")
    return names


def staleness_k(schedule: str, k: int) -> int:
    return {"sync": 0, "one_step_off": 1}.get(schedule, k)


def _share(steps: list[dict], part) -> float | None:
    """``part``'s share of the steps' wall time, over all of them together (the rollout
    reports idle seconds with the groups that finish after them, so per step they come in
    lumps), within [0, 1]."""
    measured = [s for s in steps if part(s) is not None]
    if not measured:
        return None
    share = sum(part(s) for s in measured) / sum(s["step"] for s in measured)
    return min(1.0, max(0.0, share))


def schedule_figures(schedule: str, steps: list[dict]) -> dict:
    """Throughput, lengths, idle and occupancy of one schedule's measured steps."""
    from mcore_rl.benchmarks.train import tokens_per_s

    busy = (lambda s: s["step"] - s["engine_idle_s"] if "engine_idle_s" in s else None) \
        if schedule == "async" else (lambda s: s["generate"])
    occupancy = [s["engine_occupancy"] for s in steps if "engine_occupancy" in s]
    return {
        "tokens_per_s": tokens_per_s(steps),
        "step_s": statistics.median(s["step"] for s in steps),
        "response_lengths": {
            "p50": statistics.median(s["length_p50"] for s in steps),
            "p90": statistics.median(s["length_p90"] for s in steps),
            "max": max(s["length_max"] for s in steps)},
        "trainer_idle_share": _share(steps, lambda s: s.get("trainer_idle_s")),
        "engine_busy_share": _share(steps, busy),
        "engine_occupancy": statistics.mean(occupancy) if occupancy else None,
        "staleness_max": max((s.get("staleness_max", 0.0) for s in steps), default=0.0),
    }


def continuous_capacity(cfg, k: int) -> int:
    """Sequences the continuous engine may hold: those of the K+1 steps of prompt groups that
    the async schedule admits at once."""
    return (k + 1) * cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt


def engine_batching(out: dict) -> dict:
    """The continuous-batching comparison of the engine benchmark's output."""
    rate = {mode: out[mode]["tokens"] / out[mode]["seconds"]
            for mode in ("static", "continuous", "continuous_async")}
    lengths = sorted(out["static"]["lengths"])
    unit = "tokens per busy second"
    return {"comparisons": {
                "engine_continuous_batching": throughput_comparison(
                    rate["continuous_async"], rate["static"], unit),
                "engine_async_vs_stepped": throughput_comparison(
                    rate["continuous_async"], rate["continuous"], unit),
                "engine_stepped_continuous_batching": throughput_comparison(
                    rate["continuous"], rate["static"], unit)},
            "response_lengths": {"p50": lengths[len(lengths) // 2],
                                 "p90": lengths[int(0.9 * (len(lengths) - 1))],
                                 "max": lengths[-1]},
            "continuous_mean_occupancy": out["continuous"]["mean_occupancy"],
            "continuous_async_mean_occupancy": out["continuous_async"]["mean_occupancy"],
            "continuous_capacity": out["continuous"]["capacity"],
            "decode_tokens_per_s": dict(zip(map(str, out["decode"]["occupancy"]),
                                            out["decode"]["tokens_per_s"])),
            "prefill_tokens_per_s": out["decode"]["prefill_tokens_per_s"],
            "prompt_tokens_mean": out["prompt_tokens_mean"]}


def bench_schedules(name: str, size, schedules: list[str], k: int, steps: int | None,
                    warmup: int | None, threads: int, dtype: str, log) -> dict:
    from mcore_rl.benchmarks.train import _config_path, our_overrides, run_ours
    from mcore_rl.config import load_config
    from mcore_rl.rl.job_check import check_registered_names

    steps = steps or size.steps
    warmup = size.warmup if warmup is None else warmup
    config = _config_path(size.config)
    size_overrides = size.overrides + LENGTHS.get(name, [])
    base = load_config(str(config), size_overrides + size.extra)
    check_registered_names(base)
    runs, overrides = {}, {}
    with tempfile.TemporaryDirectory(prefix=f"mcore-rl-bench-schedules-{name}-") as tmp:
        work = Path(tmp)
        for schedule in schedules:
            overrides[schedule] = size_overrides + our_overrides(
                base, steps, work / schedule, threads, dtype, fixed_lengths=False) + size.extra + [
                f"train.schedule={schedule}", f"train.max_staleness={staleness_k(schedule, k)}"]
            log(f"{name}: mcore-rl train, schedule {schedule}, {steps} steps")
            # steady state: the warm-up steps and the last one (nothing is generated for a
            # next step during it: an overlapping schedule's drain) are left out
            runs[schedule] = run_ours(config, overrides[schedule], work / schedule)[warmup:-1]
            if not runs[schedule]:
                raise RuntimeError("no steps left after the warm-up steps and the last one; "
                                   "raise --steps")
        log(f"{name}: engine, static against continuous batching")
        cfg = load_config(str(config), overrides["sync"])
        if cfg.model.path:
            from mcore_rl.models.builtin import resolve_model_path

            model_dir = resolve_model_path(cfg.model.path)
        else:  # the random tiny model the sync run started from
            model_dir = work / "sync" / "initial_model"
        engine = run_spec_module(
            "mcore_rl.benchmarks._engine_batching",
            {"config": str(config), "overrides": overrides["sync"], "model_dir": str(model_dir),
             "static_prompts": cfg.data.prompts_per_step,
             "capacity": continuous_capacity(cfg, k),
             **ENGINE[name]}, work, "engine", "the engine batching benchmark")
    figures = {s: schedule_figures(s, runs[s]) for s in schedules}
    batching = engine_batching(engine)
    comparisons = batching.pop("comparisons")
    for s in schedules:
        if s != "sync":
            comparisons[f"{s}_vs_sync"] = throughput_comparison(
                figures[s]["tokens_per_s"], figures["sync"]["tokens_per_s"], "tokens/s")
    return {"config": size.config, "overrides": overrides, "k": {s: staleness_k(s, k) for s in schedules},
            "settings": {"prompts_per_step": cfg.data.prompts_per_step,
                         "group_size": cfg.rollout.n_samples_per_prompt,
                         "max_new_tokens": cfg.rollout.max_new_tokens, "placement": cfg.rollout.placement,
                         "threads": threads, "warmup_steps": warmup, "dtype": cfg.model.dtype},
            "comparisons": comparisons,
            "targets": {c: {"speedup": TARGETS[c], "met": comparisons[c]["speedup"] >= TARGETS[c]}
                        for c in comparisons},
            "schedules": figures, "engine": batching,
            "per_step": runs}
