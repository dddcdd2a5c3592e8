"""A `CostModel` from microbenchmarks, and the simulator's figure for a run measured the way
`mcore-rl bench train --schedule` measures one (`mcore-rl bench plan`).

The microbenchmarks (`mcore_rl.benchmarks.plan` runs them):

- **engine**: decode tokens/s at several batch occupancies, prefill tokens/s, the prompts'
  mean length and the natural response lengths of the task's prompts (stop at
  end-of-sequence) up to the longest cap;
- **trainer**: the per-step phase timers (``time/*``) of short ``sync`` runs with
  fixed-length responses of at least two lengths: the trainer's turn (engine hand-over,
  log-probs, KL, values, advantages, update) fitted as a fixed part plus tokens over a rate
  (`fit_update`), the weight sync, the reward per group, and the rest of the step (hand-offs
  between controllers).

Pure Python: replaying a recorded calibration needs no torch.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from mcore_rl.errors import UsageError
from mcore_rl.plan.costs import CostModel, LengthDistribution
from mcore_rl.plan.simulator import simulate

TURN_PHASES = ("engine_sleep", "logprobs", "values", "update")
"""The trainer's turn in a step record of `mcore_rl.benchmarks.train.run_ours` (its
``logprobs`` holds the KL penalty and the advantages too): what stops a colocated engine."""


@dataclass(frozen=True)
class TrainerCosts:
    update_overhead_s: float
    update_tokens_per_s: float
    sync_s: float
    reward_s_per_group: float
    step_overhead_s: float


def fit_update(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of seconds = overhead + tokens / rate over (tokens, seconds) points;
    (overhead, rate). The overhead is floored at 0 (then the rate is refitted through the
    origin). Refused with one line without two distinct token counts or with a rate that
    does not come out positive."""
    if len({tokens for tokens, _ in points}) < 2:
        raise UsageError("the trainer's calibration needs steps of at least two different "
                         "token counts (two response lengths)")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    overhead = my - slope * mx
    if overhead < 0:
        overhead, slope = 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    if slope <= 0:
        raise UsageError(f"the trainer's calibration steps took no longer with more tokens "
                         f"({points}): the timings are noise; calibrate with longer responses")
    return overhead, 1.0 / slope


def trainer_costs(steps: Sequence[dict], prompts_per_step: int) -> TrainerCosts:
    """The trainer's costs from per-step records of fixed-length ``sync`` runs (keys of
    `run_ours`: ``tokens``, ``step``, ``generate``, ``score``, ``sync`` and `TURN_PHASES`)."""
    if not steps:
        raise UsageError("no calibration steps: raise the calibration runs' steps")
    turn = [sum(s[p] for p in TURN_PHASES) for s in steps]
    overhead, rate = fit_update([(s["tokens"], t) for s, t in zip(steps, turn)])
    rest = [s["step"] - s["generate"] - s["score"] - t - s["sync"] for s, t in zip(steps, turn)]
    return TrainerCosts(update_overhead_s=overhead, update_tokens_per_s=rate,
                        sync_s=statistics.median(s["sync"] for s in steps),
                        reward_s_per_group=statistics.median(s["score"] for s in steps) / prompts_per_step,
                        step_overhead_s=max(0.0, statistics.median(rest)))


def calibrated_costs(engine: dict, trainer: TrainerCosts, cap: int, prompts_per_step: int,
                     n_samples: int, max_seqs: int = 256, micro_batch_tokens: int = 0) -> CostModel:
    """The `CostModel` of a run whose responses end at end-of-sequence, up to ``cap`` tokens:
    the engine microbenchmark's output (``decode``, ``static.lengths``,
    ``prompt_tokens_mean``; its lengths measured up to a cap >= ``cap``) and the trainer's.
    ``micro_batch_tokens``: the runs' micro-batch budget, so that the update is charged for
    the padding natural lengths bring (the fixed-length calibration has none to speak of)."""
    decode = engine["decode"]
    lengths = tuple(min(cap, max(1, length)) for length in engine["static"]["lengths"])
    return CostModel(
        decode_occupancy=tuple(float(o) for o in decode["occupancy"]),
        decode_tokens_per_s=tuple(decode["tokens_per_s"]),
        prefill_tokens_per_s=decode["prefill_tokens_per_s"],
        update_tokens_per_s=trainer.update_tokens_per_s, update_overhead_s=trainer.update_overhead_s,
        sync_s=trainer.sync_s, reward_s_per_group=trainer.reward_s_per_group,
        step_overhead_s=trainer.step_overhead_s,
        response_lengths=LengthDistribution("empirical", cap, lengths=lengths),
        prompt_tokens=round(engine["prompt_tokens_mean"]), n_samples=n_samples,
        prompts_per_step=prompts_per_step, max_seqs_per_replica=max(max_seqs, n_samples),
        micro_batch_tokens=micro_batch_tokens)


def predicted_tokens_per_s(costs: CostModel, schedule: str, k: int, steps: int, warmup: int,
                           placement: str = "separate", replicas: int = 1,
                           partial: str = "continue", on_stale: str = "drop",
                           seeds: int = 5) -> float:
    """What `mcore-rl bench train --schedule` would report for the run: the median over steps
    ``warmup + 1 .. steps - 1`` (the warm-up steps and the last one left out) of a step's
    tokens over its wall time, averaged over ``seeds`` draws of the response lengths. (A
    simulated batch too stale to train on is no step, where a real run trains on until it
    has ``steps`` steps: with drops the two windows may differ by a step.)"""
    if warmup < 1 or steps - warmup < 2:
        raise UsageError(f"steps={steps}, warmup={warmup}: keep warmup >= 1 (a run's first "
                         "step has no interval) and a step between it and the last one")
    figures = []
    for seed in range(seeds):
        result = simulate(costs, schedule, k=k, replicas=replicas, on_stale=on_stale,
                          partial=partial, steps=steps, seed=seed, placement=placement)
        records = result.step_records
        ends = [0.0] + [r.ended_at for r in records]
        rates = [r.tokens / (ends[i + 1] - ends[i]) for i, r in enumerate(records)][warmup:-1]
        if not rates:  # batches with nothing young enough are no steps: fewer than asked
            raise UsageError(f"the simulated run took {len(records)} steps of {steps}: none "
                             "left after the warm-up; raise the steps")
        figures.append(statistics.median(rates))
    return statistics.mean(figures)
