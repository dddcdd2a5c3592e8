"""A DPO run killed with SIGKILL in the middle of a step and resumed with resume=auto trains
the step it lost again to the metrics (timings aside) that step logged before the kill,
greedy val/score included (the resumed run syncs the checkpoint's weights into its engine).
The warm start made the reference, so the checkpoint carries it: a reference rebuilt from
the initial model would change every loss."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.train.run_checkpoints import RunCheckpoints
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


def test_a_dpo_run_killed_mid_step_redoes_the_lost_step_to_the_metrics_it_had(tmp_path):
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_step(killed, 3, proc)  # the checkpoint of step 2 is complete; step 4 runs
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    before = metrics(killed)
    latest = RunCheckpoints(killed / "checkpoints").latest()  # where the resume starts
    assert json.loads((latest / "run_state.json").read_text())["step"] == 2
    assert 3 in before and "val/score" in before[3] and max(before) < STEPS
    subprocess.run(command(killed), cwd=REPO, check=True, capture_output=True, timeout=600)

    lines = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines][-(STEPS - 2):] == list(range(3, STEPS + 1))
    got = metrics(killed)  # step 3: its last record, the resumed run's
    assert got[3] == pytest.approx(before[3], rel=1e-6, abs=1e-7)  # val/score included
    assert sorted(got) == list(range(STEPS + 1)) and "val/score" in got[STEPS]
    assert got[4]["loss"] != pytest.approx(got[1]["loss"])
    state = json.loads((killed / "checkpoints" / "step_000006" / "run_state.json").read_text())
    assert state["step"] == STEPS and len(state["losses"]) == STEPS
    assert (killed / "checkpoints" / "step_000006" / "reference").is_dir()
