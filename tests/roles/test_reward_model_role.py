"""``reward.name: reward_model`` in the RL graph: a reward model trained by ``train.job: rm``
(its run directory as the path) runs as the reward controller's worker group at TP2 and
scores every rollout; the trainer's greedy validation reaches the same model
(``val/rm_score``, and ``val/score`` with no ``reward.val_reward``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.roles.graph import run_job
from mcore_rl.config import RewardConfig, load_config, validate_config
from tests.world import shared_world

REPO = Path(__file__).resolve().parents[2]


def _train_reward_model(rank, world_size, log_dir: str) -> None:
    from mcore_rl.parallel import destroy_parallel
    from mcore_rl.roles.graph import run_in_this_world

    cfg = validate_config(load_config(REPO / "configs" / "rm_quickstart.yaml", [
        f"logging.dir={log_dir}", "train.steps=3", "train.val_every=0"]), world_size)  # DP2
    try:
        run_in_this_world(cfg)
    finally:
        destroy_parallel()


def _rm_scores(rank, world_size, path: str, prompts, responses):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.rl.reward_model import build_reward_model

    ctx = initialize_parallel(tp=1, pp=1)
    model = build_reward_model(RewardConfig(reward_model_path=path), ctx)
    scores = model.score(prompts, responses)[0]
    destroy_parallel()
    return scores.tolist()


def test_the_reward_controller_scores_rollouts_with_a_trained_reward_model(ray_cluster, tmp_path):
    world = shared_world(2)
    world.run(_train_reward_model, str(tmp_path / "rm"))
    run = tmp_path / "rl"
    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", [
        "rollout.engine=hf", "train.steps=2", "train.val_every=2", "train.warm_start_steps=0",
        "data.prompts_per_step=4", "rollout.n_samples_per_prompt=2", "data.num_val=4",
        "logging.samples_every=1", "checkpoint.save_every=0", "logging.backends=[jsonl]",
        "logging.progress_bar=false", f"logging.dir={run}", "reward.name=reward_model",
        f"reward.reward_model_path={tmp_path / 'rm'}", "reward.rm_tp=2"]), 1)
    stats = run_job(cfg)
    assert [stats.roles[r].calls for r in ("rollout", "reward", "trainer")] == [2, 2, 2]

    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    validated = [h for h in history if "val/rm_score" in h]
    assert [h["step"] for h in validated] == [0, 2]
    assert all(h["val/score"] == h["val/rm_score"] for h in validated)  # no reward.val_reward
    assert all(h["reward/rm_truncated"] == 0 for h in history if h["step"] > 0)

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16
    expected = world.run(_rm_scores, str(tmp_path / "rm"), [s["prompt"] for s in samples],
                         [s["response"] for s in samples])[0]
    assert [s["reward"] for s in samples] == pytest.approx(expected, abs=1e-4)
    assert len({round(s["reward"], 4) for s in samples}) > 2  # scores, not a 0/1 check


def test_a_one_rank_reward_model_on_gpus_puts_its_rank_in_the_bundle():
    """A reward model served at 1x1x1 is still a worker group: on GPUs its one rank takes the
    bundle (its controller's process would hand the group no placement)."""
    from types import SimpleNamespace

    from mcore_rl.flow import GPUs, Megatron
    from mcore_rl.flow.gpu_placement import demands_of, runs_ranks
    from mcore_rl.roles.reward_model import ServedMegatron

    spec = SimpleNamespace(role="reward", index=0, num_workers=1, devices=GPUs(),
                           strategy=ServedMegatron(Megatron()))
    assert runs_ranks(spec)
    [demand] = demands_of([spec])
    assert (demand.tp, demand.pp, demand.dp) == (1, 1, 1)
