"""Faults inside a run: a NaN gradient stops it (or is skipped, as configured) and never
reaches the weights or a checkpoint; a broken ``latest`` checkpoint is skipped on resume and
earlier logs stay; a checkpoint directory that fills up gives one line and no partial step.

Runs on the in-process ``hf`` rollout engine, in the shared one-rank world.
"""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from mcore_rl.train.run_checkpoints import RunCheckpoints
from tests.world import shared_world

REPO = Path(__file__).resolve().parents[2]
BASE = ["rollout.engine=hf", "train.warm_start_steps=20", "train.val_every=0",
        "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "logging.progress_bar=false",
        "logging.backends=[jsonl]", "logging.samples_every=0", "reshard.verify=false"]


def _train(rank, world_size, overrides, nan_at_update=None):
    """Train; ``nan_at_update``: the actor's n-th RL update (1-based) gets a NaN gradient.
    Returns ("ok", weights finite) or (error class name, message)."""
    import torch

    from mcore_rl.config import load_config, validate_config
    from mcore_rl.errors import UsageError
    from mcore_rl.parallel import destroy_parallel
    from mcore_rl.rl import phases
    from mcore_rl.roles.graph import run_in_this_world

    update_actor, calls, states = phases.update_actor, [], []

    def poisoned(state, batch):
        calls.append(1)
        states[:] = [state]
        handles = []
        if len(calls) == nan_at_update:
            param = next(state.actor.model[0].parameters())
            handles.append(param.register_hook(lambda g: g * float("nan")))
        try:
            return update_actor(state, batch)
        finally:
            for h in handles:
                h.remove()

    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", overrides), world_size)
    phases.update_actor = poisoned
    try:
        run_in_this_world(cfg)
        state = states[0]
        finite = all(torch.isfinite(p).all().item() for c in state.actor.model for p in c.parameters())
        return "ok", finite
    except UsageError as err:
        return type(err).__name__, str(err)
    finally:
        phases.update_actor = update_actor
        destroy_parallel()


def _steps(log_dir: Path) -> dict[int, dict]:
    rows = [json.loads(l) for l in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_a_nan_gradient_stops_the_run_naming_the_step_and_no_checkpoint_holds_it(tmp_path):
    trackers = "logging.backends=[jsonl,tests.tracking.user_trackers:RecordsOutcome]"
    result = shared_world(1).run(_train, BASE + ["train.steps=4", "checkpoint.save_every=1",
                                                 f"logging.dir={tmp_path}", trackers], 3)[0]
    assert result[0] == "NonFiniteError", result
    assert result[1].startswith("step 3: the actor's loss or gradient is not finite"), result[1]
    assert "train.on_nonfinite=skip" in result[1]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == ["step_000001", "step_000002"], saved
    assert sorted(_steps(tmp_path)) == [1, 2]
    assert (tmp_path / "outcome.txt").read_text() == "failed"  # the trackers' runs say so


def test_a_nan_gradient_is_skipped_and_counted_when_configured(tmp_path):
    result = shared_world(1).run(_train, BASE + ["train.steps=4", "train.on_nonfinite=skip",
                                                 "checkpoint.save_every=0",
                                                 f"logging.dir={tmp_path}"], 3)[0]
    assert result == ("ok", True), result
    steps = _steps(tmp_path)
    assert [steps[s]["actor/skipped_updates"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 0.0]
    assert all(steps[s]["actor/loss"] == steps[s]["actor/loss"] for s in (1, 2, 4))  # not NaN


def test_a_broken_latest_checkpoint_is_skipped_and_earlier_logs_stay(tmp_path):
    first = BASE + ["train.steps=3", "checkpoint.save_every=1", "checkpoint.keep_last=3",
                    f"logging.dir={tmp_path}"]
    assert shared_world(1).run(_train, first)[0][0] == "ok"
    before = _steps(tmp_path)
    latest = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "step_000003"
    (latest / "run_state.json").unlink()
    again = BASE + ["train.steps=5", "checkpoint.save_every=1", "checkpoint.keep_last=3",
                    "checkpoint.resume=auto", f"logging.dir={tmp_path}"]
    resume = RunCheckpoints(tmp_path / "checkpoints").resolve_resume("auto", ["actor"], tmp_path)
    assert resume.path == tmp_path / "checkpoints" / "step_000002"
    assert resume.skipped == ["step_000003 has no run_state.json (its save did not finish)"]
    assert shared_world(1).run(_train, again)[0][0] == "ok"
    after = _steps(tmp_path)
    assert sorted(after) == [1, 2, 3, 4, 5]
    # the earlier run's records stay as written (timings included: they were not run again)
    assert after[1] == before[1] and after[2] == before[2]
    assert after[3]["time/step"] != before[3]["time/step"]  # step 3 ran again


@pytest.fixture()
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs (too small for a checkpoint of the tiny model)."""
    mount = tmp_path / "tiny_fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"mounting a tmpfs failed: {done.stderr}"
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_checkpoint_disk_is_one_line_and_leaves_no_partial_step(tmp_path, tiny_fs):
    run = BASE + ["train.steps=2", "checkpoint.save_every=1", f"checkpoint.dir={tiny_fs}/ckpt",
                  f"logging.dir={tmp_path}"]
    result = shared_world(1).run(_train, run)[0]
    assert result[0] == "CheckpointSpaceError", result
    assert result[1].startswith(f"checkpoint.dir {tiny_fs}/ckpt has "), result[1]
    assert " free, but saving step 1 needs about" in result[1] and "\n" not in result[1]
    assert not list((tiny_fs / "ckpt").glob("step_*")) if (tiny_fs / "ckpt").exists() else True


def _train_with_no_room_check(rank, world_size, overrides):
    """As `_train`, with the room check before a save switched off, so the disk fills up
    in the middle of writing."""
    from mcore_rl.train.run_checkpoints import RunCheckpoints

    check_room = RunCheckpoints._check_room
    RunCheckpoints._check_room = lambda self, step, engines: 1
    try:
        return _train(rank, world_size, overrides)
    finally:
        RunCheckpoints._check_room = check_room


def test_a_disk_that_fills_up_mid_save_is_one_line_and_the_partial_step_is_removed(tmp_path, tiny_fs):
    run = BASE + ["train.steps=2", "checkpoint.save_every=1", f"checkpoint.dir={tiny_fs}/ckpt",
                  f"logging.dir={tmp_path}"]
    result = shared_world(1).run(_train_with_no_room_check, run)[0]
    assert result[0] == "CheckpointSpaceError", result
    assert result[1].startswith(f"checkpoint.dir {tiny_fs}/ckpt: no space left while saving step 1"), result[1]
    assert "the partial step was removed" in result[1]
    assert list((tiny_fs / "ckpt").glob("step_*")) == []
    assert shutil.disk_usage(tiny_fs).used < 2**20 // 2  # nothing left filling it


def broken_reward(prompt, response, meta):
    """A reward function with a bug: every call raises."""
    return meta["no_such_field"]


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_initial_model(tmp_path):
    run = BASE + ["train.steps=2", "checkpoint.save_every=0", f"logging.dir={tmp_path}",
                  f"reward.name={__name__}:broken_reward"]
    result = shared_world(1).run(_train, run)[0]
    assert result[0] == "RewardError" and "broken_reward raised KeyError" in result[1], result
    assert not (tmp_path / "initial_model").exists()
    assert not list(tmp_path.glob("initial_model*"))


def _verify_nan(rank, world_size):
    """Engine and trainer log-probs where the trainer's are NaN: the check must fail."""
    import torch

    from mcore_rl.engines.base import Rollouts, RolloutSample
    from mcore_rl.rl.engine_verify import LogprobMismatchError, verify_engine_logprobs

    class Engine:
        weight_version = 1

        def generate(self, prompts, sampling):
            return Rollouts([RolloutSample(0, 0, prompts[0], [4, 5], [-1.0, -2.0], "length", 1)])

    class Trainer:
        def forward(self, batch, temperature):
            return {"logprobs": torch.full(batch["input_ids"].shape, float("nan"))}

    try:
        verify_engine_logprobs(Trainer(), Engine(), [[1, 2, 3]], temperature=1.0, tolerance=0.05)
    except LogprobMismatchError as err:
        return str(err)
    return None


def test_engine_verification_treats_nan_as_a_mismatch():
    message = shared_world(1).run(_verify_nan)[0]
    assert message is not None and "differ by up to nan" in message, message


def _train_any(rank, world_size, overrides):
    """`_train`, any error as (its class name, message)."""
    try:
        return _train(rank, world_size, overrides)
    except Exception as err:  # noqa: BLE001 - the test reads which rank raised what
        return type(err).__name__, str(err)


def test_a_reward_failing_on_rank_0_ends_every_rank_of_a_launchers_world(tmp_path):
    """Under torchrun or srun the roles run fused into rank 0: when its reward fails while
    the other ranks wait for the next batch, they end too, not at a collective's timeout."""
    run = BASE + ["train.steps=2", "checkpoint.save_every=0", f"logging.dir={tmp_path}",
                  f"reward.name={__name__}:broken_reward"]
    first, second = shared_world(2).run(_train_any, run)
    assert first[0] == "RewardError" and "broken_reward raised KeyError" in first[1], first
    assert second == ("LeaderFailed", "rank 0 failed before handing over the next item; its "
                                      "error is the one to read"), second
