"""configs/tool_quickstart.yaml learns to use its calculator: the greedy held-out score of
two-step arithmetic rises by >= 0.2 from its warm-start value (real vLLM engine, multi-turn
episodes; 5 of the config's 30 steps)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.learning
def test_the_calculator_run_raises_the_held_out_score(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/tool_quickstart.yaml",
         f"logging.dir={tmp_path}", "logging.progress_bar=false", "train.steps=5",
         "train.val_every=5", "checkpoint.save_every=0", "logging.samples_every=0"],
        capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [(h["step"], h["val/score"]) for h in history if "val/score" in h]
    assert val[0][0] == 0 and val[0][1] <= 0.3, val
    assert val[-1][0] == 5 and val[-1][1] >= val[0][1] + 0.2, val
    steps = [h for h in history if h.get("step", 0) > 0 and "response/turns" in h]
    assert len(steps) == 5 and steps[-1]["response/turns"] > 1.5, steps[-1]  # the tool is used
