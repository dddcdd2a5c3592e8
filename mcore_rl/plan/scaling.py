"""A device budget split between engine replicas and the trainer, and what each schedule
would make of it (`plan_for_devices`).

Engines: ``engine_share`` of the devices, in replicas of ``costs.devices_per_replica`` each;
every replica runs at the speed of the costs (engine tokens/s scale with the replicas).
Trainer: the rest. Its update tokens/s scale from the ``costs.trainer_devices`` it was
measured on by ``2 * efficiency`` per doubling: ``rate * (d / d0) ** (1 + log2(efficiency))``
(efficiency 1: linear; 0.9: each doubling gives 1.8x). ``placement: separate``: engines and
trainer on disjoint devices; ``colocated``: every device holds an engine replica's share and
the trainer's, the two taking turns (``engine_share`` does not apply).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from mcore_rl.errors import UsageError
from mcore_rl.plan.costs import CostModel
from mcore_rl.plan.result import SimResult
from mcore_rl.plan.simulator import PLACEMENTS, SCHEDULES, simulate

FIXED_K = {"sync": 0, "one_step_off": 1}
"""Schedules whose K is part of their definition; ``async`` takes every K asked for."""


@dataclass(frozen=True)
class Split:
    """How ``devices`` are divided."""

    devices: int
    engine_share: float
    """1.0 colocated: every device runs both, in turns."""
    replicas: int
    engine_devices: int
    trainer_devices: int
    update_tokens_per_s: float
    """The trainer's update rate on its devices (scaled from the one in the costs)."""
    placement: str = "separate"


def split_devices(costs: CostModel, devices: int, engine_share: float,
                  efficiency: float = 0.9, placement: str = "separate") -> Split:
    """Replicas and trainer devices for ``engine_share`` of ``devices`` (at least one of
    each); a share that leaves either side empty is refused with one line. Colocated: a
    replica per ``costs.devices_per_replica`` devices and the trainer on all of them."""
    if placement not in PLACEMENTS:
        raise UsageError(f"placement={placement!r}: choose one of {', '.join(PLACEMENTS)}")
    if not isinstance(devices, int) or devices < (1 if placement == "colocated" else 2):
        raise UsageError(f"devices={devices!r} must be an integer >= 2 (engines and trainer)"
                         if placement == "separate" else
                         f"devices={devices!r} must be an integer >= 1")
    if not 0.0 < efficiency <= 1.0:
        raise UsageError(f"efficiency={efficiency!r} must be in (0, 1]")
    per = costs.devices_per_replica
    if placement == "colocated":
        if devices < per:
            raise UsageError(f"devices={devices} hold no engine replica of {per} device(s); "
                             "give at least devices_per_replica devices")
        replicas = devices // per
        return Split(devices, 1.0, replicas, replicas * per, devices,
                     costs.update_tokens_per_s * _scale(devices, costs, efficiency), "colocated")
    if not 0.0 < engine_share < 1.0:
        raise UsageError(f"engine_share={engine_share!r} must be in (0, 1)")
    replicas = int(round(devices * engine_share)) // per
    trainer = devices - replicas * per
    if replicas < 1 or trainer < 1:
        raise UsageError(f"engine_share={engine_share} of {devices} devices gives {replicas} "
                         f"engine replica(s) of {per} device(s) and {trainer} trainer device(s); "
                         "both need at least one: change --engine-share or --devices")
    return Split(devices, engine_share, replicas, replicas * per, trainer,
                 costs.update_tokens_per_s * _scale(trainer, costs, efficiency))


def _scale(trainer_devices: int, costs: CostModel, efficiency: float) -> float:
    return (trainer_devices / costs.trainer_devices) ** (1.0 + math.log2(efficiency))


def plan_for_devices(costs: CostModel, devices: int, engine_share: float | Sequence[float] = 0.5,
                     schedules: Sequence[str] = SCHEDULES, ks: Sequence[int] = (1, 2),
                     on_stale: str = "drop", partial: str = "continue", steps: int = 40,
                     seed: int = 0, efficiency: float = 0.9,
                     placements: Sequence[str] = ("separate",)) -> list[dict]:
    """One row per (placement, engine share, schedule, K): the split and the simulated
    steady state (``sync`` runs at K=0 and ``one_step_off`` at K=1 whatever ``ks`` holds;
    colocated has one split, whatever the shares). Every input is checked before the first
    simulation."""
    shares = [engine_share] if isinstance(engine_share, (int, float)) else list(engine_share)
    for name in schedules:
        if name not in SCHEDULES:
            raise UsageError(f"schedule {name!r}: choose among {', '.join(SCHEDULES)}")
    for k in ks:
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise UsageError(f"K={k!r} must be an integer >= 0")
    splits = [split_devices(costs, devices, share, efficiency, placement)
              for placement in placements
              for share in (shares if placement == "separate" else shares[:1])]
    rows = []
    for split in splits:
        scaled = replace(costs, update_tokens_per_s=split.update_tokens_per_s)
        for schedule in schedules:
            for k in ([FIXED_K[schedule]] if schedule in FIXED_K else sorted(set(ks))):
                result = simulate(scaled, schedule, k=k, replicas=split.replicas,
                                  on_stale=on_stale, partial=partial, steps=steps, seed=seed,
                                  placement=split.placement)
                rows.append(row_of(split, result))
    return rows


def row_of(split: Split, result: SimResult) -> dict:
    """A plan row: the split, then the result's summary (no per-group detail)."""
    summary = result.to_dict()
    del summary["step_times_s"]
    return {"placement": split.placement, "engine_share": split.engine_share,
            "engine_replicas": split.replicas,
            "engine_devices": split.engine_devices, "trainer_devices": split.trainer_devices,
            "update_tokens_per_s": split.update_tokens_per_s, **summary}


COLUMNS = (("placement", "placement", "{}"), ("schedule", "schedule", "{}"), ("K", "k", "{}"), ("eng", "engine_replicas", "{}"),
           ("trn", "trainer_devices", "{}"), ("tokens/s", "trained_tokens_per_s", "{:.4g}"),
           ("step s", "step_time_s", "{:.4g}"), ("stale mean", "staleness_mean", "{:.2f}"),
           ("max", "staleness_max", "{}"), ("tok stale", "token_staleness_mean", "{:.2f}"),
           ("dropped", "groups_dropped", "{}"), ("regen", "groups_regenerated", "{}"),
           ("occupancy", "engine_occupancy", "{:.1f}"), ("eng idle", "engine_idle_fraction", "{:.0%}"),
           ("trn idle", "trainer_idle_fraction", "{:.0%}"))


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table (one line per row)."""
    cells = [[title for title, _, _ in COLUMNS]]
    cells += [[fmt.format(row[key]) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)
