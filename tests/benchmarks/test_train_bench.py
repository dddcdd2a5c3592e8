"""`mcore-rl bench train` runs our loop and TRL's GRPOTrainer on the same work and compares them."""
import json

import pytest

from mcore_rl.cli.main import main
from mcore_rl.config import load_config


def test_quick_bench_trains_both_on_the_same_fixed_length_batches_and_compares_per_phase(tmp_path):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--json", str(out), "--quick"]) == 0
    report = json.loads(out.read_text())["results"]["quickstart"]
    cfg = load_config("configs/quickstart.yaml", [])
    responses = cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt
    # Every response has exactly max_new_tokens tokens on both sides (stop tokens masked), and
    # every prompt of the built-in task is <bos> + "a+b=": the same work per step.
    tokens = responses * (1 + 4 + cfg.rollout.max_new_tokens)
    for side in ("ours", "baseline"):
        assert report["responses_per_step"][side] == responses
        assert report["tokens_per_step"][side] == tokens
        assert all(s["tokens"] == tokens for s in report["per_step"][side])
    tps = report["tokens_per_s"]
    assert tps["unit"] == "tokens/s" and tps["speedup"] == pytest.approx(tps["ours"] / tps["baseline"], rel=2e-3)
    for phase in ("generate", "update"):
        c = report["phases"][phase]
        assert c["ours"] > 0 and c["baseline"] > 0
        assert c["speedup"] == pytest.approx(c["baseline"] / c["ours"], rel=2e-3)
    assert report["ours_only"]["sync_s"] > 0
    assert report["steps_measured"] == {"ours": 2, "baseline": 2}


def test_unknown_size_is_one_line_with_exit_2(tmp_path, capsys):
    assert main(["bench", "train", "--json", str(tmp_path / "x.json"), "--sizes", "huge"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown size 'huge'; choose from quickstart, smollm2" in err[0]
