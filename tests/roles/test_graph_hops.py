"""The Ray round trips of a synchronous RL step, counted by the runtime (`FlowStats`): at most
eight on the step's critical path, and none when every role is fused into the trainer."""
from __future__ import annotations

from pathlib import Path

from mcore_rl.config import load_config
from mcore_rl.roles.graph import run_job
from mcore_rl.roles.rules import check_runnable

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
BASE = ["rollout.engine=hf", f"train.steps={STEPS}", "train.val_every=0", "train.warm_start_steps=0",
        "reshard.verify=false", "checkpoint.save_every=0", "logging.backends=[jsonl]",
        "logging.samples_every=0"]


def run(tmp_path, placement: str):
    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      BASE + [f"rollout.placement={placement}", f"logging.dir={tmp_path}"])
    return run_job(check_runnable(cfg, 1))


def test_a_synchronous_step_waits_on_at_most_eight_ray_round_trips(ray_cluster, tmp_path):
    stats = run(tmp_path, "colocated")
    roles = stats.roles
    assert stats.steps == roles["trainer"].calls == STEPS
    # the rollout reads its own prompts, paced: one wait for the trainer per step but the first
    assert roles["rollout"].round_trips == STEPS - 1
    # the reward scores in the trainer's first rank: no hand-off of its own
    assert roles["reward"].calls == STEPS and roles["reward"].round_trips == 0
    # the trainer's rank 0 takes the batch (the get from the stream and the fetch: 2), puts
    # the engine to sleep (1) and syncs it in one call (1); the other ranks get the batch
    # from rank 0, not through Ray
    assert roles["trainer"].round_trips == 4 * STEPS
    assert stats.round_trips_per_step <= 8


def test_fused_roles_cross_no_process_boundary(ray_cluster, tmp_path):
    stats = run(tmp_path, "fused")
    assert [stats.roles[r].calls for r in ("rollout", "reward", "trainer")] == [STEPS] * 3
    assert stats.round_trips_per_step == 0
