"""The RL loop learns the built-in task with GRPO at TP2 and PPO (critic + GAE) at PP2; with
the learning rate at 0 nothing moves; PPO's first mini-batch has importance ratio 1 exactly.

These runs use the in-process ``hf`` rollout engine (transformers generate) to keep the
suite fast; the quick start (tests/rl/test_quickstart.py) runs the same loop on vLLM.
"""
import json
from pathlib import Path

import pytest

from tests.world import shared_world

REPO = Path(__file__).resolve().parents[2]
BASE = ["rollout.engine=hf", "train.warm_start_steps=300", "train.steps=10", "train.val_every=5",
        "checkpoint.save_every=0", "logging.progress_bar=false", "logging.backends=[jsonl]",
        "reshard.verify=true", "reshard.verify_every=1"]


def _train(rank, world_size, overrides):
    from mcore_rl.config import load_config, validate_config
    from mcore_rl.parallel import destroy_parallel
    from mcore_rl.roles.graph import run_in_this_world

    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", overrides), world_size)
    try:
        run_in_this_world(cfg)
    finally:
        destroy_parallel()
    path = Path(cfg.logging.dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if rank == 0 else None


def val_scores(history):
    return [h["val/score"] for h in history if "val/score" in h]


@pytest.mark.learning
def test_grpo_at_tp2_improves_the_validation_score(tmp_path):
    history = shared_world(2).run(_train, BASE + ["parallel.tp=2", f"logging.dir={tmp_path}"])[0]
    scores = val_scores(history)
    assert scores[0] <= 0.3, scores
    assert scores[-1] >= scores[0] + 0.3, scores
    verified = [h["sync/verify_max_abs_diff"] for h in history if "sync/verify_max_abs_diff" in h]
    assert len(verified) == 10 and max(verified) < 1e-3, verified


@pytest.mark.learning
def test_ppo_with_critic_at_pp2_improves_reward_and_first_minibatch_ratio_is_exactly_one(tmp_path):
    overrides = BASE + ["parallel.pp=2", "algorithm.advantage_estimator=gae",
                        "algorithm.ppo_epochs=2", "algorithm.mini_batches=2",
                        "optimizer.critic_lr=1e-3", f"logging.dir={tmp_path}"]
    history = shared_world(2).run(_train, overrides)[0]
    steps = [h for h in history if h["step"] > 0]
    assert all(h["actor/first_minibatch_ratio_abs_dev"] == 0.0 for h in steps)
    # later mini-batches are off-policy: their ratios do move
    assert any(h["actor/ratio_abs_dev"] > 0 for h in steps)
    assert all("critic/loss" in h for h in steps)
    scores = val_scores(history)
    assert scores[-1] >= scores[0] + 0.3, scores


def test_with_learning_rate_zero_the_scores_stay_flat(tmp_path):
    history = shared_world(1).run(_train, BASE + ["optimizer.lr=0", f"logging.dir={tmp_path}"])[0]
    scores = val_scores(history)
    assert len(scores) == 3 and len(set(scores)) == 1, scores
