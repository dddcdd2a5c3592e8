"""A step's batch made of prompt groups that arrived one by one (the asynchronous schedule):
put back in prompt order, numbered as groups, with what the rollout reported about each.

Groups reach the trainer in the order the engine finished them; sorting them by their key
(step, index) gives the batch the order the synchronous schedule gives it, so that
micro-batching and reductions are the same and ``max_staleness: 0`` reproduces ``sync``.
"""
from __future__ import annotations

import torch

from mcore_rl.data.batch import Batch

SUMMED = ("engine_idle_s", "stale_regenerated", "partial_continued", "partial_restarted")
"""Per-row shares of counts and seconds the rollout spreads over a group's rows."""


def assemble_groups(batch: Batch) -> tuple[Batch, dict[str, float]]:
    """The batch in (step, index) order with ``group_id`` numbered 0.. per group, and the
    rollout's metrics of its groups: ``engine/occupancy`` (mean samples in flight at the
    engine's steps), ``time/engine_idle_s``, ``rollout/replicas_used`` (engine replicas whose
    groups the step holds), ``rollout/stale_regenerated``,
    ``rollout/partial_continued``, ``rollout/partial_restarted``."""
    keys = batch.meta["group_key"]
    order = sorted(range(len(batch)), key=lambda i: (tuple(keys[i]), i))
    batch = batch.select(order)
    keys = [tuple(k) for k in batch.meta["group_key"]]
    number: dict[tuple, int] = {}
    group_id = torch.tensor([number.setdefault(k, len(number)) for k in keys], dtype=torch.long)
    batch = batch.with_tensors(group_id=group_id)
    batch.info["prompts"] = len(number)
    metrics = {"engine/occupancy": sum(batch.meta["engine_occupancy"]) / len(batch),
               "time/engine_idle_s": sum(batch.meta["engine_idle_s"]),
               "rollout/replicas_used": float(len(set(batch.meta["producer"])))}
    for name in SUMMED[1:]:
        metrics[f"rollout/{name}"] = sum(batch.meta[name])
    return batch, metrics


def stream_position(key: tuple[int, int], per_step: int) -> int:
    """The prompt stream position of a streamed group from its key (step, index), which
    `mcore_rl.roles.graph.group_items` numbers by that position."""
    step, index = key
    return (step - 1) * per_step + index


def token_staleness(batch: Batch, current_version: int) -> dict[str, float]:
    """Staleness of every response token (the version being updated minus the one that
    generated it): ``rollout/token_staleness_max`` and ``_mean``."""
    mask = batch["response_mask"].bool()
    if "token_versions" not in batch or not bool(mask.any()):
        return {}
    staleness = (current_version - batch["token_versions"])[mask].float()
    return {"rollout/token_staleness_max": float(staleness.max()),
            "rollout/token_staleness_mean": float(staleness.mean())}
