"""GRPO with a mixture-of-experts policy learns the quick-start task: a tiny Qwen3-MoE at
expert parallelism 2, Megatron's load-balancing loss on (logged), the engine's routes
replayed in the update (`configs/moe_quickstart.yaml`, as shipped)."""
import json
from pathlib import Path

import pytest

from mcore_rl.roles.graph import run_job
from mcore_rl.config import load_config, validate_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.learning
def test_grpo_with_a_moe_policy_at_ep2_raises_the_validation_score(tmp_path, capsys):
    cfg = validate_config(load_config(REPO / "configs" / "moe_quickstart.yaml", [
        f"logging.dir={tmp_path}", "logging.progress_bar=false", "logging.samples_every=0"]), 2)
    stats = run_job(cfg)
    assert stats.roles["trainer"].calls == cfg.train.steps
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [h["val/score"] for h in history if "val/score" in h]
    assert val[0] <= 0.3 and val[-1] >= 0.7, val
    balance = [h["actor/moe/load_balancing_loss"] for h in history if h["step"] > 0]
    assert len(balance) == cfg.train.steps and all(0.9 < b < 2.0 for b in balance), balance
    assert "TP1xPP1xDP2xEP2" in capsys.readouterr().out
