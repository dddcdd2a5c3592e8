"""A run killed with SIGKILL in the middle of a step and resumed with resume=auto reaches
exactly the same metrics (timings aside) as an uninterrupted run."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
TIMING = ("time/", "perf/", "sync/seconds", "sync/transfer_s", "sync/apply_s")


def command(log_dir, *extra):
    return [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/quickstart.yaml",
            "rollout.engine=hf", "train.warm_start_steps=50", f"train.steps={STEPS}",
            "train.val_every=3", "checkpoint.save_every=2", "checkpoint.resume=auto",
            "logging.progress_bar=false", "logging.tensorboard=false", f"logging.dir={log_dir}",
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


def test_sigkill_mid_step_then_resume_auto_matches_the_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    subprocess.run(command(full), cwd=REPO, check=True, capture_output=True, timeout=900)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_step(killed, 3, proc)  # checkpoint of step 2 is complete; step 4 is running
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert max(metrics(killed)) < STEPS
    subprocess.run(command(killed), cwd=REPO, check=True, capture_output=True, timeout=900)

    expected, got = metrics(full), metrics(killed)
    assert sorted(got) == list(range(STEPS + 1))
    for step in range(STEPS + 1):
        assert got[step] == expected[step], f"step {step} differs after the resume"
