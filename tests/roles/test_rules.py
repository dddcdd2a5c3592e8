"""Which job, schedule, placement, replicas and reward go together: one place refuses what
cannot run, in one line naming the setting and the fix, before anything starts."""
from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.config import load_config
from mcore_rl.errors import UsageError
from mcore_rl.roles.rules import check_config

REPO = Path(__file__).resolve().parents[2]


def check(overrides, driver="train"):
    return check_config(load_config(None, overrides), driver=driver)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.placement=fused", "train.schedule=one_step_off", "train.max_staleness=1"],
     r"rollout.placement=fused runs rollout, reward and update in line .* train.schedule="
     r"one_step_off needs the engine in a controller of its own"),
    (["rollout.placement=fused", "train.schedule=async", "train.max_staleness=1"],
     r"train.schedule=async needs the engine in a controller of its own"),
    (["rollout.placement=fused", "rollout.replicas=2"],
     r"rollout.replicas=2 need controllers of their own: set rollout.placement=colocated"),
    (["rollout.placement=fused", "rollout.engine_tp=2"], r"rollout.engine_tp=2 needs workers"),
    (["rollout.placement=fused", "reward.name=reward_model"],
     r"rollout.placement=fused \(every role in the trainer's ranks\) does not start"),
    (["train.schedule=one_step_off"], r"train.max_staleness=0 allows none; set "
                                      r"train.max_staleness=1"),
    (["train.on_stale=regenerate"], r"train.on_stale=regenerate needs train.schedule=async"),
    (["environment.name=calculator", "rollout.replicas=2"],
     r"multi-turn rollouts run turn by turn over a batch on one engine"),
    (["environment.name=calculator", "train.schedule=async", "train.max_staleness=1"],
     r"multi-turn rollouts"),
])
def test_combinations_that_cannot_run_are_refused_in_one_line(overrides, message):
    with pytest.raises(UsageError, match=message) as err:
        check(overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["rollout.placement=fused"],
    ["rollout.replicas=2"],  # sync with two engines: a step's groups spread by load
    ["rollout.replicas=2", "rollout.placement=separate", "train.schedule=one_step_off",
     "train.max_staleness=1"],
    ["rollout.replicas=3", "train.schedule=async", "train.max_staleness=2"],
])
def test_every_schedule_runs_with_replicas_and_sync_runs_fused(overrides):
    check(overrides)


def test_the_python_api_runs_rl_and_the_offline_jobs_without_a_reward_model_controller():
    check(["rollout.placement=fused"], driver="api")
    with pytest.raises(UsageError, match="RLTrainer runs train.job rl, sft, rm, dpo, kto, not 'smoke'"):
        check(["train.job=smoke"], driver="api")
    with pytest.raises(UsageError, match="RLTrainer does not start the worker group"):
        check(["reward.name=reward_model"], driver="api")


def test_a_graph_only_placed_reads_no_checkpoint(tmp_path):
    """`mcore-rl placement` and `launch slurm --skip-path-checks` build the graph to place
    it: a checkpoint that exists only on the cluster is not read."""
    from mcore_rl.roles.graph import job_graph

    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      [f"checkpoint.resume={tmp_path}/on_the_cluster/step_10",
                       f"logging.dir={tmp_path}"])
    _, job = job_graph(cfg, dry_run=True)
    assert [c.role for c in job.group.controllers] == ["rollout", "reward", "trainer"]
    with pytest.raises(UsageError, match="on_the_cluster"):  # a run reads it
        job_graph(cfg)
