"""`configs/smollm2_grpo.yaml` trains the real SmolLM2-135M-Instruct: chat-template prompts
from reasoning-gym, vLLM generation, the reasoning-gym scorer, a sync verified against the
trainer (one short step here; the full run is the same command without the overrides)."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_one_short_step_of_the_smollm2_config_runs_end_to_end(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/smollm2_grpo.yaml",
         "train.steps=1", "train.val_every=0", "data.prompts_per_step=1", "rollout.n_samples_per_prompt=2",
         "rollout.max_new_tokens=8", "checkpoint.save_every=0", "checkpoint.resume=never",
         "logging.progress_bar=false", "logging.backends=[jsonl]", "logging.samples_every=1",
         f"logging.dir={tmp_path}"],
        capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    step = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["step"] == 1 and 0.0 <= step["reward/mean"] <= 1.0
    assert 1 <= step["response/length"] <= 8 and step["actor/kl"] >= 0
    assert step["sync/verify_max_abs_diff"] < 0.05
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["step"] == 1 and s["response"] for s in samples)
    assert {(s["epoch"], type(s["index"])) for s in samples} == {(0, int)}  # the prompt's identity
    # the reasoning-gym prompt text (the chat template is applied to token ids, not logged)
    assert all("<|im_start|>" not in s["prompt"] and len(s["prompt"]) > 10 for s in samples)
