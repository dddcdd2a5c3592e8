"""`RLTrainer` runs the fine-tuning jobs too: a DPO trainer at TP2, driven from this
process with preference records it builds itself, learns the held-out pairs as the
`mcore-rl train` job does; a fine-tuning trainer refuses to sample, and rollouts in place
of records, with one line each."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from mcore_rl import RLTrainer
from mcore_rl.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


def pairs(rng: random.Random, n: int) -> list[dict]:
    """Addition pairs as a user would write them: the right sum chosen, one off rejected."""
    out = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)})
    return out


def test_a_dpo_trainer_at_tp2_learns_from_records_passed_to_update(tmp_path):
    rng = random.Random(0)
    with RLTrainer.from_config(REPO / "configs" / "dpo_quickstart.yaml", [
            "parallel.tp=2", f"logging.dir={tmp_path}", "finetune.val_score=false"]) as trainer:
        first = trainer.update(pairs(rng, 32))
        # the policy starts as the reference: the DPO term is log 2, RPO adds its NLL
        assert first["loss"] - first["nll/chosen"] == pytest.approx(math.log(2), abs=1e-3)
        for _ in range(29):
            trainer.update(pairs(rng, 32))
        held_out = trainer.validate()
        assert held_out["val/preference_accuracy"] >= 0.85, held_out  # from 0 (the reference)
        assert trainer.step == 30
        with pytest.raises(UsageError, match="a dpo trainer has no rollout engine"):
            trainer.sample(["1+2="])
        with pytest.raises(UsageError, match="takes a list of records"):
            trainer.update([["not", "a", "record"]])
        saved = trainer.save()
    assert (saved / "run_state.json").exists()
    logged = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(logged) >= 31  # step 0's validation, 30 updates, the last validation
