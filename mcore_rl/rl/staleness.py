"""The staleness contract at consumption: no update consumes a sample generated more than
``train.max_staleness`` weight versions before the weights it updates.

Every sample carries the version of the weights that generated it (``weight_version``).
Samples are kept or dropped by whole prompt group (GRPO's statistics need complete groups;
a group is generated in one call, with one version). On the RL graph the admission side of
the bound is the pacing: ``schedule: one_step_off`` lets at most one step's rollout be in
flight beside the update, so what arrives is at most one version old."""
from __future__ import annotations

import torch

from mcore_rl.data.batch import Batch


def within_staleness(batch: Batch, current_version: int, max_staleness: int
                     ) -> tuple[Batch | None, dict[str, float]]:
    """The samples at most ``max_staleness`` versions older than ``current_version`` (None:
    none left) and the metrics: the staleness of the samples kept (what the update trains
    on), and how many samples and prompt groups were dropped."""
    versions = torch.tensor(batch.meta["weight_version"], dtype=torch.long)
    staleness = current_version - versions
    groups = batch["group_id"]
    stale_groups = groups[staleness > max_staleness].unique()
    keep = ~torch.isin(groups, stale_groups)
    trained = staleness[keep] if bool(keep.any()) else staleness
    metrics = {"rollout/staleness_max": float(trained.max()),
               "rollout/staleness_mean": float(trained.float().mean()),
               "rollout/stale_dropped": float((~keep).sum()),
               "rollout/stale_dropped_groups": float(len(stale_groups))}
    if bool(keep.all()):
        return batch, metrics
    if not bool(keep.any()):
        return None, metrics
    return batch.select(keep.nonzero().flatten()), metrics
