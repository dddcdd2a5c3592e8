"""`mcore-rl bench flow` runs the same RL steps with every role fused into the trainer, through
controllers of their own (`mcore-rl train`'s default), `RLTrainer` and the one-step-off
schedule, and compares their step times and Ray round trips."""
import json

import pytest

from mcore_rl.cli.main import main
from mcore_rl.config import load_config


@pytest.mark.bench
def test_quick_bench_runs_the_same_steps_two_ways_and_compares_them(tmp_path, capsys):
    # The fused placement against the synchronous graph of its own controllers, with the
    # in-process HF engine (the placements compared are the subject; vLLM has its own tests).
    out = tmp_path / "flow.json"
    assert main(["bench", "flow", "--json", str(out), "--quick", "--modes", "fused,cli",
                 "rollout.engine=hf"]) == 0
    report = json.loads(out.read_text())
    assert report["overrides"] == ["rollout.engine=hf"]
    cfg = load_config("configs/quickstart.yaml", [])
    responses = cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt
    tokens = responses * (1 + 4 + cfg.rollout.max_new_tokens)  # <bos> "a+b=" + fixed-length answers
    assert report["tokens_per_step"] == {m: tokens for m in ("fused", "cli")}
    assert report["steps_measured"] == {"fused": 3, "cli": 3}
    assert set(report["step_time"]) == {"cli_vs_fused"}
    for c in report["step_time"].values():
        assert c["unit"] == "s" and c["ours"] > 0 and c["baseline"] > 0
        assert c["speedup"] == pytest.approx(c["baseline"] / c["ours"], rel=2e-3)
    trips = report["round_trips_per_step"]
    assert trips["fused"] == 0 and 0 < trips["cli"] <= 8
    assert "trainer" in capsys.readouterr().out


def test_too_few_steps_is_one_line_with_exit_2(tmp_path, capsys):
    assert main(["bench", "flow", "--json", str(tmp_path / "x.json"), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps 2 leaves too few steps after --warmup 2" in err[0]


def test_an_unknown_mode_is_one_line_with_exit_2(tmp_path, capsys):
    assert main(["bench", "flow", "--json", str(tmp_path / "x.json"), "--modes", "fused,fast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--modes fused,fast" in err[0] and "graph" in err[0]


def test_a_bad_override_is_one_line_with_exit_2_before_any_run(tmp_path, capsys):
    assert main(["bench", "flow", "--json", str(tmp_path / "x.json"), "--quick",
                 "rollout.engin=hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.engin" in err[0], err
    assert not (tmp_path / "x.json").exists()
