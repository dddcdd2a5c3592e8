"""One short quick start sending its metrics to every backend at once: a real ``mlflow
server`` started here on a free port (read back through its REST API), an offline W&B run
(read by W&B's own reader), TensorBoard event files (read by TensorBoard's), each holding
what ``metrics.jsonl`` holds."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.tracking.test_metrics_log import wandb_history

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a free port, its runs in a SQLite file, artifacts served by it."""
    d = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}",
         "--artifacts-destination", str(d / "artifacts")],
        stdout=open(d / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("mlflow server did not start:\n"
                                         + (d / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.fixture(scope="module")
def run(mlflow_server, tmp_path_factory):
    """The quick start, 3 steps, fused placement with the batched HF engine, every backend."""
    d = tmp_path_factory.mktemp("quickstart_trackers")
    env = {**os.environ, "WANDB_CACHE_DIR": str(d / "wandb_cache"),
           "WANDB_CONFIG_DIR": str(d / "wandb_config"), "WANDB_DATA_DIR": str(d / "wandb_data")}
    env.pop("WANDB_API_KEY", None)
    cmd = [sys.executable, "-m", "mcore_rl.cli.main", "train", str(REPO / "configs" / "quickstart.yaml"),
           "rollout.placement=fused", "rollout.engine=hf_batched", f"train.steps={STEPS}",
           "train.warm_start_steps=50", f"train.val_every={STEPS}", f"logging.samples_every={STEPS}",
           f"logging.dir={d / 'run'}", f"checkpoint.dir={d / 'ckpt'}", "logging.progress_bar=false",
           "logging.backends=[jsonl,tensorboard,wandb,mlflow]", "logging.wandb.mode=offline",
           f"logging.mlflow.tracking_uri={mlflow_server}", "logging.mlflow.experiment=quickstart",
           "logging.mlflow.run_name=three-steps"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    return d / "run", records, out.stdout


def test_the_console_has_one_plain_status_line_per_step_and_no_progress_bar_frames(run):
    """Output to a pipe: no carriage return (no bar frames, from us or the libraries), and
    each step's line once, with tokens/s, the phase shares and, from the second step, the
    time left."""
    _, _, out = run
    assert "\r" not in out, [line for line in out.split("\n") if "\r" in line][:3]
    # without Ray's prefix: the process, in color
    lines = [re.sub(r"^(\x1b\[[0-9;]*m)?\(\w+ pid=\d+\)(\x1b\[[0-9;]*m)? ", "", line)
             for line in out.splitlines()]
    for step in range(1, STEPS + 1):
        (line,) = [x for x in lines if x.startswith(f"step {step}/{STEPS}: reward/mean ")]
        assert " tokens/s | generate " in line and "update " in line, line
        assert (" | eta 0:" in line) == (step > 1), line


def _series(records, key):
    return [(r["step"], r[key]) for r in records if key in r]


def _same(got, want, rel=1e-12) -> bool:
    """The same steps, and values equal within ``rel`` (TensorBoard keeps float32)."""
    return [s for s, _ in got] == [s for s, _ in want] and \
        [v for _, v in got] == pytest.approx([v for _, v in want], rel=rel)


def _api(server: str, endpoint: str, **query):
    url = f"{server}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def test_the_mlflow_server_holds_the_runs_metrics_params_and_artifacts(mlflow_server, run):
    run_dir, records, _ = run
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    info = _api(mlflow_server, "runs/get", run_id=run_id)["run"]
    assert info["info"]["status"] == "FINISHED" and info["info"]["run_name"] == "three-steps"
    experiment = _api(mlflow_server, "experiments/get-by-name", experiment_name="quickstart")
    assert info["info"]["experiment_id"] == experiment["experiment"]["experiment_id"]
    params = {p["key"]: p["value"] for p in info["data"]["params"]}
    assert params["train.steps"] == str(STEPS) and params["rollout.engine"] == "hf_batched"
    for key in ("reward/mean", "val/score", "actor/entropy"):
        history = _api(mlflow_server, "metrics/get-history", run_id=run_id, metric_key=key)["metrics"]
        got = sorted((m["step"], m["value"]) for m in history)
        assert _same(got, _series(records, key)), (key, got)
    assert [s for s, _ in _series(records, "reward/mean")] == [1, 2, 3]
    files = {f["path"] for f in _api(mlflow_server, "artifacts/list", run_id=run_id)["files"]}
    assert {"config.yaml", "reward_curve.png", "samples"} <= files
    samples = _api(mlflow_server, "artifacts/list", run_id=run_id, path="samples")["files"]
    assert [f["path"] for f in samples] == [f"samples/step_{STEPS:06d}.json"]


def test_the_offline_wandb_run_holds_what_metrics_jsonl_holds(run):
    run_dir, records, _ = run
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    for key in ("reward/mean", "val/score"):
        got = wandb_history(wandb_run, key)
        assert _same(got, _series(records, key)), (key, got)


def test_tensorboard_holds_what_metrics_jsonl_holds(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, records, _ = run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for key in ("reward/mean", "val/score", "actor/entropy", "time/update"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert _same(got, _series(records, key), rel=1e-6), (key, got)
