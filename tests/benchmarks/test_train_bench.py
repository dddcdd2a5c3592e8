"""`mcore-rl bench train` runs our loop and TRL's GRPOTrainer on the same work and compares them."""
import json

import pytest

from mcore_rl.cli.main import main
from mcore_rl.config import load_config


@pytest.mark.bench
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


@pytest.mark.bench
def test_quick_schedule_bench_compares_each_schedule_and_continuous_batching_with_sync(tmp_path):
    out = tmp_path / "schedules.json"
    assert main(["bench", "train", "--json", str(out), "--quick", "--schedule", "sync,async"]) == 0
    report = json.loads(out.read_text())["results"]["quickstart"]
    cfg = load_config("configs/quickstart.yaml", [])
    assert set(report["comparisons"]) == {"engine_continuous_batching", "engine_async_vs_stepped",
                                          "engine_stepped_continuous_batching", "async_vs_sync"}
    for c in report["comparisons"].values():
        assert c["ours"] > 0 and c["baseline"] > 0
        assert c["speedup"] == pytest.approx(c["ours"] / c["baseline"], rel=2e-3)
    assert report["comparisons"]["async_vs_sync"]["baseline"] == report["schedules"]["sync"]["tokens_per_s"]
    assert report["k"] == {"sync": 0, "async": 2}
    for name, figures in report["schedules"].items():
        lengths = figures["response_lengths"]
        assert 1 <= lengths["p50"] <= lengths["p90"] <= lengths["max"] <= cfg.rollout.max_new_tokens
        assert figures["staleness_max"] <= report["k"][name]
        assert 0 <= figures["trainer_idle_share"] <= 1 and 0 <= figures["engine_busy_share"] <= 1
        steps = report["per_step"][name]
        assert len(steps) == 2 and all(s["responses"] == 128 for s in steps)
    assert 0 < report["schedules"]["async"]["engine_occupancy"]
    engine = report["engine"]
    # continuous batching holds what async admits at K=2: three steps' sequences
    capacity = 3 * cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt
    assert engine["continuous_capacity"] == capacity
    assert 0 < engine["continuous_mean_occupancy"] <= capacity
    assert 0 < engine["continuous_async_mean_occupancy"] <= capacity
    assert set(engine["decode_tokens_per_s"]) == {"1", "8", "32"}


@pytest.mark.parametrize("schedules, message", [
    ("async", "has no sync: every schedule is compared against sync"),
    ("sync,fast", "give comma-separated schedules of sync, one_step_off, async")])
def test_a_bad_schedule_list_is_one_line_with_exit_2(tmp_path, capsys, schedules, message):
    assert main(["bench", "train", "--json", str(tmp_path / "x.json"), "--schedule", schedules]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_set_overrides_reach_our_run_and_the_settings_trl_shares(tmp_path, monkeypatch):
    from mcore_rl.benchmarks import train
    from mcore_rl.data.toy_task import toy_tokenizer

    seen = {}
    step = {"step": 0.2, "generate": 0.1, "score": 0.0, "logprobs": 0.0, "update": 0.1,
            "values": 0.0, "sync": 0.01, "engine_sleep": 0.0, "tokens": 360, "responses": 40}

    def ours(config, overrides, log_dir):
        seen["ours"] = overrides
        (log_dir / "initial_model").mkdir(parents=True)  # TRL starts from our initial model
        toy_tokenizer().save(log_dir / "initial_model")
        return [step] * 4

    monkeypatch.setattr(train, "run_ours", ours)
    monkeypatch.setattr(train, "run_trl", lambda spec, work: seen.setdefault("trl", spec) and [step] * 4)
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--json", str(out), "--quick", "--set", "rollout.engine=hf_batched",
                 "--set", "data.prompts_per_step=5", "--set", "parallel.cpu_threads_per_rank=1"]) == 0
    # applied last: over the benchmark's own thread setting
    assert seen["ours"][-3:] == ["rollout.engine=hf_batched", "data.prompts_per_step=5",
                                 "parallel.cpu_threads_per_rank=1"]
    assert sum(o.startswith("parallel.cpu_threads_per_rank=") for o in seen["ours"]) == 2
    assert seen["trl"]["prompts_per_step"] == 5
    assert "rollout.engine=hf_batched" in json.loads(out.read_text())["results"]["quickstart"]["overrides"]


@pytest.mark.parametrize("override, message", [
    ("rollout.engine", "--set 'rollout.engine': write it as KEY=VALUE"),
    ("rollout.engin=hf", "rollout.engin"),
    ("rollout.engine=hf_batchd", "unknown rollout engine 'hf_batchd'; did you mean 'hf_batched'")])
@pytest.mark.parametrize("mode", [[], ["--schedule", "sync,async"]], ids=["trl", "schedules"])
def test_a_bad_set_override_is_one_line_with_exit_2_before_any_run(tmp_path, capsys, monkeypatch, override,
                                                                   message, mode):
    from mcore_rl.benchmarks import train

    monkeypatch.setattr(train, "run_ours", lambda *a, **kw: pytest.fail("a run started"))
    assert main(["bench", "train", "--json", str(tmp_path / "x.json"), "--quick", "--set", override,
                 *mode]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
