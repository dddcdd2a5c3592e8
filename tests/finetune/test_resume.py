"""A DPO run killed with SIGKILL in the middle of a step and resumed with resume=auto logs
exactly the same metrics (timings aside) as an uninterrupted run, greedy val/score
included (the resumed run syncs the checkpoint's weights into its engine). The warm start
made the reference, so the checkpoint carries it: a reference rebuilt from the initial
model would change every loss."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl.test_resume_after_kill import wait_for_step

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
SKIPPED = ("time/", "perf/", "sync/verify")
"""Timings, and the engine-vs-trainer check, which each process runs at its first sync."""


def command(log_dir):
    return [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/dpo_quickstart.yaml",
            f"train.steps={STEPS}", "checkpoint.save_every=2", "train.val_every=3",
            "train.warm_start_steps=20", "checkpoint.resume=auto", "logging.progress_bar=false",
            f"logging.dir={log_dir}"]


def metrics(log_dir) -> dict[int, dict]:
    out = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = {k: v for k, v in record.items() if not k.startswith(SKIPPED)}
    return out


def test_a_dpo_run_killed_mid_step_resumes_to_the_metrics_of_an_uninterrupted_one(tmp_path):
    full = tmp_path / "full"
    subprocess.run(command(full), cwd=REPO, check=True, capture_output=True, timeout=600)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_step(killed, 3, proc)  # the checkpoint of step 2 is complete; step 4 runs
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert max(metrics(killed)) < STEPS
    subprocess.run(command(killed), cwd=REPO, check=True, capture_output=True, timeout=600)

    expected, got = metrics(full), metrics(killed)
    assert sorted(got) == list(range(STEPS + 1))
    for step in range(STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    assert "val/score" in got[STEPS] and got[4]["loss"] != pytest.approx(expected[1]["loss"])
    state = json.loads((killed / "checkpoints" / "step_000006" / "run_state.json").read_text())
    assert state["step"] == STEPS and len(state["losses"]) == STEPS
    assert (killed / "checkpoints" / "step_000006" / "reference").is_dir()
