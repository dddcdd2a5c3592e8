"""The README's main command learns as stated: greedy validation score <= 0.3 after the warm
start, >= 0.7 after RL (real vLLM engine on CPU), shown by its JSONL metrics and plot."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.learning
def test_quickstart_lifts_the_validation_score_from_at_most_03_to_at_least_07(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/quickstart.yaml",
         f"logging.dir={tmp_path}", "logging.progress_bar=false"],
        capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [(h["step"], h["val/score"]) for h in history if "val/score" in h]
    assert val[0][0] == 0 and val[0][1] <= 0.3, val
    assert val[-1][0] == 30 and val[-1][1] >= 0.7, val
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    assert "validation score" in proc.stdout
