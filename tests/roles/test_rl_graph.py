"""The RL graph launched on Ray replays the golden runs (recorded with every role fused into
the trainer's ranks, tests/rl/golden/runs.py) to round-off in the CPU placements that move
roles between processes: rollout, reward and trainer controllers of their own taking turns
(colocated) or beside each other (separate). Those here cover every phase the placements
move; fused, the placement the golden runs are recorded in, replays all six in
tests/rl/test_golden_runs.py, and launched on Ray in tests/roles/test_graph_hops.py."""
from __future__ import annotations

import json

import pytest

from mcore_rl.config import load_config, validate_config
from mcore_rl.roles.graph import run_job
from tests.rl.golden.runs import BASE, REPO, RUNS, comparable
from tests.rl.test_golden_runs import _mismatches, golden


# TP2 GRPO, PPO with a critic and two epochs over two mini-batches: between them every
# phase of the loop that the placements move between controllers.
@pytest.mark.golden
@pytest.mark.parametrize("name, placement", [("grpo_tp2", "colocated"), ("ppo_tp1", "colocated"),
                                             ("grpo_tp1", "separate")])
def test_the_graph_replays_the_golden_run(ray_cluster, tmp_path, name, placement):
    expected = golden(name)
    size, overrides = RUNS[name]
    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", BASE + overrides + [
        f"logging.dir={tmp_path}", f"rollout.placement={placement}"]), size)
    stats = run_job(cfg)
    assert [stats.roles[r].calls for r in ("rollout", "reward", "trainer")] == [3, 3, 3]
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    problems = _mismatches(expected, comparable(history))
    assert not problems, "\n".join(problems[:20])
    # one step at a time: the rollout of step k+1 was generated with the weights of step k
    assert [h["rollout/weight_version"] for h in history if "rollout/weight_version" in h] == \
        [h["weight_version"] - 1 for h in history if "weight_version" in h]


def test_one_step_off_trains_each_step_on_the_rollout_of_the_weights_before(ray_cluster, tmp_path):
    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", BASE + [
        f"logging.dir={tmp_path}", "train.steps=5", "train.val_every=0",
        "train.schedule=one_step_off", "train.max_staleness=1", "rollout.placement=separate"]), 1)
    stats = run_job(cfg)
    assert stats.roles["trainer"].calls == 5
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if "weight_version" in h]
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5]
    assert all(h["rollout/staleness_max"] <= 1 and h["rollout/stale_dropped"] == 0 for h in steps)
    # the generation of step k+1 overlapped the update of step k: it used older weights
    assert any(h["rollout/staleness_max"] == 1 for h in steps[1:]), steps


@pytest.mark.golden
@pytest.mark.parametrize("schedule", [
    ["train.schedule=async", "train.max_staleness=0", "rollout.placement=separate"],
    ["rollout.replicas=2"],  # sync, colocated: a step's groups spread over two engines
], ids=["async-k0", "sync-two-replicas"])
def test_prompt_groups_streamed_a_step_at_a_time_replay_the_golden_run(ray_cluster, tmp_path, schedule):
    """train.schedule=async with max_staleness 0 admits one step's prompt groups at a time:
    the synchronous schedule, step for step, whatever order the groups finish in; so does
    sync with two engine replicas taking the groups by load."""
    name = "ppo_tp1"
    expected = golden(name)
    size, overrides = RUNS[name]
    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", BASE + overrides + [
        f"logging.dir={tmp_path}", *schedule]), size)
    stats = run_job(cfg)
    prompts = cfg.train.steps * cfg.data.prompts_per_step
    assert stats.roles["rollout"].items_out == stats.roles["reward"].items_in == prompts
    assert stats.roles["trainer"].calls == cfg.train.steps
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # A step merges its prompt groups' batches, which keep the first batch's reward-function
    # counters (reward/<name>/*): a known limit of async batches; every other metric replays.
    expected = [{k: v for k, v in row.items() if not k.startswith("reward/builtin/")}
                for row in expected]
    problems = _mismatches(expected, comparable(history))
    assert not problems, "\n".join(problems[:20])
    assert all(h["rollout/token_staleness_max"] == 0 for h in history if h["step"] > 0)
    used = [h["rollout/replicas_used"] for h in history if h["step"] > 0]
    assert max(used) == cfg.rollout.replicas, used

