"""Dynamic sampling (DAPO, Yu et al. 2025): train only on prompt groups that carry a signal.

A group whose rewards are all equal has zero group-relative advantage for every sample, so
GRPO learns nothing from it while it still dilutes the batch. `InformativeGroups` keeps
the groups whose scores differ, pools them across generation rounds until a step has
``groups_per_step`` of them, and gives up after ``max_extra_rounds`` extra rounds: the step
then trains on what it has, and ``rollout/dynamic_short_groups`` says how many groups it
lacked (the warning metric). Groups beyond a step's need are kept for the next step only
when the staleness bound allows one version of lag (``keep_surplus``); otherwise they are
discarded and counted, since the update makes them one version old. A checkpoint keeps
the pool (`state_dict`), so a resumed run trains the groups it held as the uninterrupted run
does.

Pure bookkeeping on `Batch` (``group_id``, ``scores``): the RL graph's trainer
(`mcore_rl.trainer.train_step`) feeds it a scored round at a time, whatever the placement.
"""
from __future__ import annotations

import torch

from mcore_rl.data.batch import Batch


def informative_groups(batch: Batch) -> torch.Tensor:
    """[B] bool: the sample's group has scores that are not all equal."""
    groups, scores = batch["group_id"], batch["scores"].float()
    ids, inverse = torch.unique(groups, return_inverse=True)
    lo = torch.full((len(ids),), float("inf")).scatter_reduce(0, inverse, scores, "amin")
    hi = torch.full((len(ids),), float("-inf")).scatter_reduce(0, inverse, scores, "amax")
    return (hi > lo)[inverse]


def _take_groups(batch: Batch, count: int) -> tuple[Batch, Batch | None]:
    """The first ``count`` groups of ``batch`` (in order of first appearance), the rest."""
    groups = batch["group_id"].tolist()
    order = list(dict.fromkeys(groups))
    first = set(order[:count])
    head = [i for i, g in enumerate(groups) if g in first]
    tail = [i for i, g in enumerate(groups) if g not in first]
    return batch.select(head), (batch.select(tail) if tail else None)


def _renumbered(batch: Batch) -> Batch:
    """``group_id`` numbered 0.. in order of first appearance."""
    number: dict[int, int] = {}
    ids = [number.setdefault(g, len(number)) for g in batch["group_id"].tolist()]
    return batch.with_tensors(group_id=torch.tensor(ids, dtype=torch.long))


COUNTERS = ("_next_id", "discarded_groups", "rounds", "seen_groups", "filtered_groups",
            "score_sum", "samples")
"""`InformativeGroups`' counters, kept by checkpoints with its pool."""


class InformativeGroups:
    """Pools the informative groups of successive scored rounds into steps.

    ``offer(batch)`` takes one scored round and returns the step's batch (exactly
    ``groups_per_step`` groups, renumbered 0..) once the pool holds enough, or what the pool
    holds after ``max_extra_rounds`` extra rounds (the last round as it is when no round had an
    informative group); None while more rounds are wanted. Its metrics describe the step it
    returns; surplus groups discarded while filling it are counted with the next step."""

    def __init__(self, groups_per_step: int, max_extra_rounds: int, keep_surplus: bool):
        if groups_per_step < 1 or max_extra_rounds < 0:
            raise ValueError(f"groups_per_step={groups_per_step} must be >= 1 and "
                             f"max_extra_rounds={max_extra_rounds} >= 0")
        self.groups_per_step = groups_per_step
        self.max_extra_rounds = max_extra_rounds
        self.keep_surplus = keep_surplus
        self.pool: Batch | None = None
        self._next_id = 0
        self._reset_counts()
        self.discarded_groups = 0
        """Informative groups dropped as surplus since the last step returned."""

    def _reset_counts(self) -> None:
        self.rounds = 0
        self.seen_groups = 0
        self.filtered_groups = 0
        self.score_sum = 0.0
        self.samples = 0

    @classmethod
    def for_config(cls, cfg) -> "InformativeGroups | None":
        """The pool of an RL config with ``algorithm.dynamic_sampling`` (else None): surplus
        groups are kept when ``train.max_staleness`` allows a version of lag."""
        a = cfg.algorithm
        if not a.dynamic_sampling:
            return None
        return cls(cfg.data.prompts_per_step, a.dynamic_sampling_max_rounds,
                   keep_surplus=cfg.train.max_staleness >= 1)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the pooled groups and the counters that number and report
        them, those of a step's rounds so far included (a save may come between rounds)."""
        pool = None if self.pool is None else {
            "tensors": self.pool.tensors, "meta": self.pool.meta, "info": self.pool.info}
        return {"pool": pool, **{name: getattr(self, name) for name in COUNTERS}}

    def load_state_dict(self, state: dict) -> None:
        pool = state["pool"]
        self.pool = None if pool is None else Batch(pool["tensors"], pool["meta"], pool["info"])
        for name in COUNTERS:
            setattr(self, name, state[name])

    @property
    def pooled_groups(self) -> int:
        return 0 if self.pool is None else len(set(self.pool["group_id"].tolist()))

    def offer(self, batch: Batch) -> tuple[Batch | None, dict[str, float]]:
        """One scored round in; the step's batch (or None) and its metrics."""
        self.rounds += 1
        keep = informative_groups(batch)
        groups = batch["group_id"]
        self.seen_groups += len(groups.unique())
        self.filtered_groups += len(groups[~keep].unique())
        self.score_sum += float(batch["scores"].float().sum())
        self.samples += len(batch)
        if bool(keep.any()):
            kept = batch.select(keep.nonzero().flatten())
            # ids unique across rounds: the groups of different rounds never merge
            ids = _renumbered(kept)["group_id"]
            kept = kept.with_tensors(group_id=ids + self._next_id)
            self._next_id += int(ids.max()) + 1
            self.pool = kept if self.pool is None else Batch.cat([self.pool, kept])
        if self.pooled_groups < self.groups_per_step and self.rounds <= self.max_extra_rounds:
            return None, {}
        metrics = {"rollout/dynamic_rounds": float(self.rounds),
                   "rollout/dynamic_filtered_frac": self.filtered_groups / max(self.seen_groups, 1),
                   "rollout/dynamic_score_mean": self.score_sum / max(self.samples, 1),
                   "rollout/dynamic_short_groups": float(max(0, self.groups_per_step - self.pooled_groups))}
        self._reset_counts()
        metrics["rollout/dynamic_discarded_groups"] = float(self.discarded_groups)
        self.discarded_groups = 0
        if self.pool is None:  # nothing informative in any round: the last one, as it is
            return _renumbered(batch), metrics
        step, surplus = _take_groups(self.pool, self.groups_per_step)
        if surplus is not None and not self.keep_surplus:
            self.discarded_groups += len(set(surplus["group_id"].tolist()))
            surplus = None
        self.pool = surplus
        return _renumbered(step), metrics
