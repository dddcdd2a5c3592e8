"""`RLTrainer` drives a TP2 and a PP2 GRPO run from this (driver) process: its ranks are Ray
actors, the engine sits beside rank 0 (the real vLLM engine at TP2; the example script at PP2
runs with the in-process HF engine, its subject being the script), and rewards are computed
here."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mcore_rl import RLTrainer
from mcore_rl.data.toy_task import toy_tokenizer
from mcore_rl.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(3, 4), (1, 2), (5, 0), (2, 2)]]


def exact(rollouts) -> list[float]:
    return [float(r.strip() == m["answer"]) for r, m in zip(rollouts["response"], rollouts["meta"])]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    with RLTrainer.from_config(QUICKSTART, ["parallel.tp=2", f"logging.dir={out}",
                                            f"checkpoint.dir={out}/ckpt",
                                            "train.warm_start_steps=30"]) as t:
        yield t


def test_sample_returns_the_engines_tokens_text_logprobs_and_weight_version(trainer):
    tok = toy_tokenizer()
    ids = tok.encode_prompt("6+1=", False)
    r = trainer.sample([PROMPTS[0], ids], n=3)
    assert len(r) == 6
    assert r["prompt"] == ["3+4="] * 3 + ["6+1="] * 3  # token-id prompts get their text
    assert r["prompt_ids"] == [tok.encode_prompt("3+4=", False)] * 3 + [ids] * 3
    for response_ids, text, logprobs in zip(r["response_ids"], r["response"], r["logprobs"]):
        assert response_ids and tok.decode(response_ids) == text
        assert len(logprobs) == len(response_ids) and all(lp <= 0 for lp in logprobs)
    assert set(r["weight_version"]) == {trainer.weight_version}
    assert trainer.weight_version >= 1  # the warm start's weights were synced
    ranks = trainer.rank_processes  # (Ray node, pid) per rank: one local node, two processes
    assert len(ranks) == 2 and len({pid for _, pid in ranks}) == 2 and len({n for n, _ in ranks}) == 1


def test_update_trains_and_the_new_weights_reach_the_engine(trainer):
    before = trainer.weight_version
    r = trainer.sample(PROMPTS)
    assert len(r) == 4 * 8  # rollout.n_samples_per_prompt of the config
    r["reward"] = exact(r)
    stats = trainer.update(r)
    assert stats["reward/mean"] == pytest.approx(sum(exact(r)) / len(r))
    assert stats["actor/grad_norm"] > 0 and trainer.weight_version == before + 1
    assert trainer.step == 1
    r2 = trainer.sample(PROMPTS)
    assert set(r2["weight_version"]) == {before + 1}
    r2["reward"] = exact(r2)
    stats2 = trainer.update(r2)
    # The engine generated r2 with the synced weights: its log-probs are the trainer's.
    assert stats2["actor/engine_logprob_gap"] < 1e-3
    history = [json.loads(line) for line in (Path(trainer.cfg.logging.dir) / "metrics.jsonl")
               .read_text().splitlines()]
    assert [h["step"] for h in history if "actor/loss" in h] == [1, 2]


def test_validate_and_save(trainer):
    score = trainer.validate()
    assert 0.0 <= score <= 1.0
    path = trainer.save()
    assert path.name == "step_000002" and (path / "actor").is_dir()


def test_bad_calls_are_refused_with_one_line(trainer):
    r = trainer.sample(PROMPTS[:1], n=2)
    with pytest.raises(UsageError, match="set rollouts\\['reward'\\]"):
        trainer.update(r)
    with pytest.raises(UsageError, match="n must be >= 1"):
        trainer.sample(PROMPTS, n=0)
    with pytest.raises(UsageError, match="takes the Rollouts"):
        trainer.update({"reward": [1.0]})


def test_a_bad_config_is_refused_before_any_rank_starts():
    with pytest.raises(UsageError, match="parallel.tp=3"):
        RLTrainer.from_config(QUICKSTART, ["parallel.tp=3"])
    with pytest.raises(UsageError, match="algo='dpo' is not known"):
        RLTrainer(algo="dpo")


def test_the_example_script_runs_grpo_at_pp2(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import python_api
    finally:
        sys.path.remove(str(REPO / "examples"))
    result = python_api.main(["--pp", "2", "--steps", "2", "--val-every", "2",
                              "--logdir", str(tmp_path), "train.warm_start_steps=30",
                              "rollout.engine=hf"])
    assert sorted(result["validation"]) == [0, 2]
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    updates = [h for h in history if "actor/loss" in h]
    assert [h["step"] for h in updates] == [1, 2]
    assert updates[-1]["actor/engine_logprob_gap"] < 1e-3
    assert (tmp_path / "checkpoints" / "step_000002" / "actor").is_dir()
    assert not os.environ.get("RAY_ADDRESS")
