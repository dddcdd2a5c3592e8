"""`mcore-rl train` on the built-in config: real ranks, real Megatron, the loss falls."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_smoke_run_trains_on_two_ranks_and_loss_falls(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/smoke.yaml",
         "--nproc", "2", "train.steps=8", f"logging.dir={tmp_path}"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "smoke_summary.json").read_text())
    assert summary["layout"] == "TP2xPP1xDP1" and summary["steps"] == 8
    losses = summary["losses"]
    assert losses[-1] < 0.8 * losses[0], losses


def test_train_rejects_a_layout_that_does_not_fit_before_starting_ranks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/smoke.yaml",
         "--nproc", "3", f"logging.dir={tmp_path}"],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "world size 3 is not a multiple of tp*pp = 2" in proc.stderr
    assert not (tmp_path / "smoke_summary.json").exists()
