"""Bad input stops a run with one clear line (exit 2) and never corrupts a checkpoint."""
import json
import subprocess
import sys
from pathlib import Path

from mcore_rl.train.run_checkpoints import RunCheckpoints

REPO = Path(__file__).resolve().parents[2]
TINY = ["rollout.engine=hf", "train.warm_start_steps=0", "data.prompts_per_step=4",
        "rollout.n_samples_per_prompt=2", "train.val_every=0", "logging.progress_bar=false",
        "logging.backends=[jsonl]", "reshard.verify=false"]

_calls = 0


def reward_failing_at_step_3(prompt, response, meta):
    """Exact match for two steps (8 responses each), then a broken lookup."""
    global _calls
    _calls += 1
    if _calls > 16:
        return meta["no_such_field"]
    return float(response.strip() == meta["answer"])


def train(*overrides):
    return subprocess.run([sys.executable, "-m", "mcore_rl.cli.main", "train",
                           "configs/quickstart.yaml", *TINY, *overrides],
                          capture_output=True, text=True, cwd=REPO, timeout=600)


def test_missing_dataset_field_is_one_line_before_any_rank_starts(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    proc = train("data.source=jsonl", f"data.path={data}", "data.num_val=0",
                 f"logging.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"mcore-rl train: error: {data}: row 1 has no field 'prompt' (data.prompt_key); "
        "fields there: answer, question"]
    assert not (tmp_path / "run").exists()


def test_unknown_reward_is_one_line_before_any_rank_starts(tmp_path):
    proc = train("reward.name=exactt", f"logging.dir={tmp_path}")
    assert proc.returncode == 2 and "unknown reward 'exactt'; did you mean 'exact'?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_reward_that_raises_mid_run_stops_cleanly_and_checkpoints_stay_loadable(tmp_path):
    proc = train("reward.name=tests.rl.test_bad_input:reward_failing_at_step_3", "train.steps=4",
                 "checkpoint.save_every=1", f"logging.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mcore-rl train: error")]
    assert len(errors) == 1 and "reward_failing_at_step_3 raised KeyError: 'no_such_field'" in errors[0]
    latest = RunCheckpoints(tmp_path / "checkpoints").latest()
    assert latest is not None and json.loads((latest / "run_state.json").read_text())["step"] == 2
    # The run continues from that checkpoint with a working reward.
    proc = train("reward.name=exact", "train.steps=4", "checkpoint.save_every=1",
                 "checkpoint.resume=auto", f"logging.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
