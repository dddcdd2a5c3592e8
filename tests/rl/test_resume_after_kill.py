"""A run killed with SIGKILL in the middle of a step and resumed with resume=auto trains the
step it lost again to exactly the metrics (timings aside) that step had before the kill (the
synchronous schedule), and under the overlapping schedules trains every prompt of the stream
exactly once, by its identity in ``samples.jsonl``: none twice, and none skipped but those
counted as dropped."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_rl.train.run_checkpoints import RunCheckpoints

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
TIMING = ("time/", "perf/", "sync/seconds", "sync/transfer_s", "sync/apply_s")


def command(log_dir, *extra):
    return [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/quickstart.yaml",
            "rollout.engine=hf", "train.warm_start_steps=50", f"train.steps={STEPS}",
            "train.val_every=3", "checkpoint.save_every=2", "checkpoint.resume=auto",
            "logging.progress_bar=false", "logging.backends=[jsonl]", f"logging.dir={log_dir}",
            *extra]


def metrics(log_dir) -> dict[int, dict]:
    out = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = {k: v for k, v in record.items() if not k.startswith(TIMING)}
    return out


def wait_for_step(log_dir: Path, step: int, proc, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    path = log_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        if path.exists() and any(json.loads(l)["step"] >= step for l in path.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached")


def test_sigkill_mid_step_then_resume_auto_redoes_the_lost_step_exactly(tmp_path):
    """Killed while step 4 runs, the run resumes from its checkpoint of step 2: it trains step
    3 again to exactly the metrics it logged before the kill (weights, optimizer state, data
    position and random state all restored), then goes on to the end."""
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_step(killed, 3, proc)  # checkpoint of step 2 is complete; step 4 is running
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    before = metrics(killed)
    latest = RunCheckpoints(killed / "checkpoints").latest()  # where the resume starts
    assert json.loads((latest / "run_state.json").read_text())["step"] == 2
    assert 3 in before and max(before) < STEPS
    subprocess.run(command(killed), cwd=REPO, check=True, capture_output=True, timeout=900)

    lines = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines][-(STEPS - 2):] == list(range(3, STEPS + 1))
    got = metrics(killed)
    assert sorted(got) == list(range(STEPS + 1))
    for step in range(3):  # before the checkpoint: as logged
        assert got[step] == before[step]
    assert got[3] == before[3], "step 3 differs after the resume"  # the last record of step 3


# --- exactly once: every prompt of the stream trained once across a kill and resume, under
# the overlapping schedules (groups in flight at the kill are generated again on resume)

def trained_identities(log_dir) -> dict[tuple[int, int], set[int]]:
    """(epoch, dataset index) of every prompt trained -> the steps that trained it, from
    ``samples.jsonl`` (every sample of every step)."""
    out: dict[tuple[int, int], set[int]] = {}
    for line in (Path(log_dir) / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault((row["epoch"], row["index"]), set()).add(row["step"])
    return out


def stream_identities(steps: int, prompts_per_step: int) -> list[tuple[int, int]]:
    """The first prompts of the quick start's stream, in the order the run takes them."""
    from mcore_rl.config import load_config
    from mcore_rl.data.prompts import PromptStream, load_prompt_records

    cfg = load_config(str(REPO / "configs/quickstart.yaml"), [])
    stream = PromptStream(load_prompt_records(cfg.data, "train"), cfg.data.seed)
    return [(r.meta["data_epoch"], r.meta["data_index"])
            for r in stream.take(steps * prompts_per_step)]


OVERLAP = {"one_step_off": ["train.schedule=one_step_off", "train.max_staleness=1"],
           "async": ["train.schedule=async", "train.max_staleness=2",
                     "rollout.partial_rollout=continue"]}


@pytest.mark.parametrize("schedule", sorted(OVERLAP))
def test_every_prompt_is_trained_exactly_once_across_a_kill_and_resume(tmp_path, schedule):
    run = tmp_path / schedule
    extra = [*OVERLAP[schedule], "rollout.placement=separate", "train.val_every=0",
             "logging.samples_every=1", "logging.samples_per_step=0", "checkpoint.save_every=1"]
    proc = subprocess.Popen(command(run, *extra), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_step(run, 3, proc)  # later groups are in flight or generated, not trained
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert max(metrics(run)) < STEPS
    done = subprocess.run(command(run, *extra), cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    history = metrics(run)
    assert sorted(s for s in history if s > 0) == list(range(1, STEPS + 1))
    trained = trained_identities(run)
    twice = {k: v for k, v in trained.items() if len(v) > 1}
    assert not twice, f"trained in more than one step: {twice}"
    dropped = sum(history[s].get("rollout/stale_dropped_groups", 0) for s in history)
    expected = stream_identities(STEPS, 16)
    assert set(trained) <= set(expected)
    skipped = [k for k in expected if k not in trained]
    assert len(skipped) == dropped, f"{len(skipped)} prompts never trained, {dropped} counted as dropped"
