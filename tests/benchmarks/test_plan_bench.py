"""`mcore-rl bench plan`: a recorded calibration and its held-out measurements replayed
through the simulator (``--replay``: nothing runs), on a report whose figures are worked
out by hand; and bad input as one line with exit status 2."""
from __future__ import annotations

import json

import pytest

from mcore_rl.cli.main import main


def _trainer_step(tokens: int, turn_s: float) -> dict:
    return {"tokens": tokens, "engine_sleep": 0.0, "logprobs": 0.25 * turn_s, "values": 0.0,
            "update": 0.75 * turn_s, "generate": 5.0, "score": 0.0, "sync": 1.0,
            "step": 5.0 + turn_s + 1.0}


def _report(measured: dict[str, float]) -> dict:
    """2 prompts x 4 samples of 100 tokens a step, colocated: 5 s of generation (8 sequences
    at 160 tokens/s), a 1 s turn (0.2 s + 800 tokens at 1000/s), a 1 s sync: 7 s a step."""
    return {
        "settings": {"prompts_per_step": 2, "group_size": 4, "placement": "colocated",
                     "steps": 5, "warmup": 1},
        "calibration": {
            "engine": {"decode": {"occupancy": [1, 8, 32], "tokens_per_s": [20.0, 160.0, 320.0],
                                  "prefill_tokens_per_s": 1e9},
                       "static": {"lengths": [100] * 8}, "prompt_tokens_mean": 0.0},
            "trainer": [{"length": 100, "steps": [_trainer_step(800, 1.0)]},
                        {"length": 200, "steps": [_trainer_step(1600, 1.8)]}]},
        "runs": [{"cap": 100, "schedule": schedule, "k": k, "steps": [],
                  "measured_tokens_per_s": measured[schedule]}
                 for schedule, k in (("sync", 0), ("one_step_off", 1))]}


@pytest.mark.parametrize("scale, met", [(1.1, True), (0.5, False)])
def test_replay_predicts_each_run_and_its_ratio_to_sync(tmp_path, scale, met):
    # colocated one_step_off does not overlap either: its turn waits for the next batch
    step_s = 5.0 + 1.0 + 1.0
    recorded = tmp_path / "recorded.json"
    recorded.write_text(json.dumps(_report({"sync": scale * 800 / step_s,
                                            "one_step_off": 800 / step_s})))
    out = tmp_path / "replayed.json"
    assert main(["bench", "plan", "--replay", str(recorded), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sync, off = report["predictions"]["sync_k0_cap100"], report["predictions"]["one_step_off_k1_cap100"]
    assert sync["predicted"] == pytest.approx(800 / step_s, rel=1e-4)
    assert off["predicted"] == pytest.approx(800 / step_s, rel=1e-4)
    assert sync["error"] == pytest.approx(1 / scale - 1, abs=1e-4)
    assert off["error"] == pytest.approx(0.0, abs=1e-4)
    ratio = report["ratios"]["one_step_off_k1_vs_sync_cap100"]
    assert ratio["predicted"] == pytest.approx(1.0, rel=1e-4)
    assert ratio["measured"] == pytest.approx(1 / scale, rel=1e-4)
    assert report["costs"]["100"]["update_tokens_per_s"] == pytest.approx(1000)
    assert report["costs"]["100"]["update_overhead_s"] == pytest.approx(0.2)
    assert report["target"]["met"] is met


@pytest.mark.parametrize("argv, message", [
    (["--replay", "{dir}/missing.json"], "missing.json: no such file"),
    (["--replay", "{dir}/bad.json"], "is not a `bench plan` output"),
    (["--replay", "{dir}/no_runs.json"], "it holds no held-out runs"),
    (["--cal-lengths", "32,32"], "give at least two different lengths"),
    (["--caps", "64,x"], "--caps '64,x': give comma-separated integers"),
    (["--schedule", "sync,fast"], "--schedule 'sync,fast': choose among"),
    (["--steps", "2"], "keep --warmup >= 1"),
    (["--k", "-1"], "--k '-1': give comma-separated integers >= 0"),
])
def test_bad_input_is_one_line_with_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "bad.json").write_text(json.dumps({"runs": []}))
    (tmp_path / "no_runs.json").write_text(json.dumps({**_report({"sync": 1.0, "one_step_off": 1.0}), "runs": []}))
    args = ["bench", "plan", "--json", str(tmp_path / "out.json")]
    assert main(args + [a.format(dir=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out.json").exists()
