"""The reward role: a rollout `Batch` -> the same batch with ``scores``."""
from __future__ import annotations

import time

from mcore_rl.config import config_from_dict
from mcore_rl.data.batch import Batch


class Score:
    """A reward role: a rollout `Batch` -> the same batch with ``scores`` (the config's
    rewards, one per response, by a `RewardScorer` that lives as long as the role) and
    the scorer's metrics (``reward/*``) in ``info``, beside ``time/score``."""

    def __init__(self, cfg_data: dict):
        from mcore_rl.rewards import RewardScorer

        self.cfg = config_from_dict(cfg_data)
        self.scorer = RewardScorer.from_config(self.cfg.reward)

    def __call__(self, batch: Batch) -> Batch:
        from mcore_rl.rl.phases import score_rollouts

        t = time.perf_counter()
        scores, metrics = score_rollouts(self.scorer, batch)
        batch = batch.with_tensors(scores=scores)
        batch.info.update(metrics)
        batch.info["time/score"] = time.perf_counter() - t
        return batch

    def close(self) -> None:
        self.scorer.close()
