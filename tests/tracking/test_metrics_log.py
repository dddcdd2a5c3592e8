"""`MetricsLog` over its trackers, without a model: the steps each backend holds after a
kill and resume (read back with the backend's own reader), a failing tracker dropped in one
line, the W&B run continued on resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.config import load_config
from mcore_rl.metrics_log import MetricsLog


def _log(directory: Path, backends: list[str], *overrides: str) -> MetricsLog:
    cfg = load_config(None, [f"logging.dir={directory}", f"logging.backends={backends}",
                             "logging.progress_bar=false", *overrides])
    return MetricsLog.for_config(cfg, enabled=True)


def _attempt(directory, backends, resumed_after, steps, scale, *overrides, stop=True):
    log = _log(directory, backends, *overrides)
    log.truncate_after(resumed_after)
    for step in steps:
        log.log(step, {"reward/mean": scale * step, "loss": float("nan")}, console=False)
        log.samples(step, [{"prompt": f"p{step}", "response": "r|x", "reward": scale * step}])
    log.close("stopped" if stop else "finished")
    return log


def test_after_a_kill_and_resume_jsonl_and_tensorboard_hold_each_step_once_the_resumed_value(tmp_path):
    """The killed attempt logged steps 1-4, its last checkpoint was at step 2; the resumed
    attempt logs 3-5 with other values. TensorBoard's own reader must see steps 1-5 once
    each, 3-5 with the resumed values (the writer purges what followed the checkpoint);
    metrics.jsonl the same records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _attempt(tmp_path, ["jsonl", "tensorboard"], -1, [1, 2, 3, 4], 1.0)
    _attempt(tmp_path, ["jsonl", "tensorboard"], 2, [3, 4, 5], 10.0, stop=False)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    seen = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert seen == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    assert "loss" not in events.Tags()["scalars"]  # NaN is not written
    assert events.Tags()["tensors"] == ["samples/text_summary"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == seen
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples] == ["p1", "p2", "p3", "p4", "p5"]


def test_a_fresh_run_in_the_same_directory_starts_its_logs_over(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _attempt(tmp_path, ["jsonl", "tensorboard"], -1, [1, 2, 3], 1.0, stop=False)
    log = _attempt(tmp_path, ["jsonl", "tensorboard"], -1, [1, 2], 5.0, stop=False)
    assert [(h["step"], h["reward/mean"]) for h in log.history()] == [(1, 5.0), (2, 10.0)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    # the earlier run's event file stays on disk, and TensorBoard shows none of its steps
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 5.0), (2, 10.0)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_half_written_last_record_of_a_killed_attempt_is_dropped_on_resume(tmp_path):
    _attempt(tmp_path, ["jsonl"], -1, [1, 2], 1.0)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/mea')  # the kill came mid-write
    log = _attempt(tmp_path, ["jsonl"], 2, [3], 10.0, stop=False)
    assert [(h["step"], h["reward/mean"]) for h in log.history()] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_tracker_that_fails_is_dropped_in_one_line_and_the_run_and_other_trackers_go_on(
        tmp_path, capsys):
    from tests.tracking.user_trackers import FailsAtStep2

    FailsAtStep2.seen.clear()
    log = _log(tmp_path, ["jsonl", "tests.tracking.user_trackers:FailsAtStep2"])
    log.truncate_after(-1)
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": float(step)}, console=False)
    log.close()
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["mcore-rl: the tests.tracking.user_trackers:FailsAtStep2 tracker failed "
                   "(ConnectionError: the tracking server went away); it records nothing more, "
                   "the run goes on"]
    assert FailsAtStep2.seen == [1]
    assert [h["step"] for h in log.history()] == [1, 2, 3]


def _wandb_records(run_dir: Path) -> list[dict]:
    """The records of an offline W&B run, read by W&B's own reader of its transaction log."""
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", str(run_dir),
                          "--json"], capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    return [(r["history"]["step"]["num"], r["history"]["item"][key])
            for r in _wandb_records(run_dir) if r["type"] == "history" and key in r["history"]["item"]]


@pytest.fixture()
def wandb_env(tmp_path, monkeypatch):
    """W&B's own directories under the test's, and no key: offline runs only."""
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc with a key


def test_an_offline_wandb_run_holds_the_metrics_config_and_samples_and_resume_continues_it(
        tmp_path, wandb_env):
    run_dir = tmp_path / "run"
    _attempt(run_dir, ["wandb"], -1, [1, 2, 3], 1.0, "logging.wandb.mode=offline",
             "logging.wandb.project=tests", "train.steps=5")
    first_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    _attempt(run_dir, ["wandb"], 2, [3, 4, 5], 10.0, "logging.wandb.mode=offline",
             "logging.wandb.project=tests", "train.steps=5", stop=False)
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(first_id) for r in runs), runs
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"] == first_id
    assert wandb_history(runs[0], "reward/mean") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert wandb_history(runs[1], "reward/mean") == [(3, 30.0), (4, 40.0), (5, 50.0)]
    records = _wandb_records(runs[0])
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["train"]["steps"] == 5 and config["logging"]["backends"] == ["wandb"]
    assert "git_revision" in config
    table = next((runs[0] / "files" / "media" / "table").glob("samples_2_*.table.json"))
    assert json.loads(table.read_text())["data"] == [["p2", "r|x", 2.0]]


def test_wandb_online_without_a_key_is_refused_before_any_rank_starts(
        tmp_path, wandb_env, capsys, no_rank_starts):
    from mcore_rl.cli.main import main

    quick = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
    assert main(["train", quick, f"logging.dir={tmp_path / 'run'}", "logging.backends=[wandb]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no W&B API key is set" in err[0], err
    assert "logging.wandb.mode=offline" in err[0]
    assert not (tmp_path / "run").exists()
    os.environ["WANDB_API_KEY"] = "x" * 40  # with a key, the check passes (no network is asked)
    try:
        from mcore_rl.tracking import check_trackers

        check_trackers(load_config(None, ["logging.backends=[wandb]"]).logging)
    finally:
        del os.environ["WANDB_API_KEY"]


def test_mlflow_in_its_default_database_keeps_everything_in_logging_dir_and_resume_continues_the_run(
        tmp_path, monkeypatch):
    """No tracking URI: a SQLite database and its artifacts in ``logging.dir`` (nothing in
    the working directory); the resumed attempt continues the same run, which keeps both
    values of a step logged twice (the killed attempt's first)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    _attempt(run_dir, ["mlflow"], -1, [1, 2, 3], 1.0, "logging.mlflow.experiment=tests")
    first = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    _attempt(run_dir, ["mlflow"], 2, [3, 4], 10.0, "logging.mlflow.experiment=tests", stop=False)
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(first)
    assert run.info.status == "FINISHED" and run.data.params["logging.backends"] == "['mlflow']"
    history = [(m.step, m.value) for m in client.get_metric_history(first, "reward/mean")]
    assert sorted(history) == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 40.0)]
    assert "loss" not in run.data.metrics  # NaN is not sent
    assert {a.path for a in client.list_artifacts(first)} == {"config.yaml", "samples"}
    assert (run_dir / "mlartifacts").is_dir()
