"""`mcore-rl plan`, in-process (``mcore_rl.cli.main.main``): the table on stdout, the JSON it
writes, the shipped example costs, and bad input as one line with exit status 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.cli.main import main
from mcore_rl.plan import CostModel

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "plan" / "costs_example.json"
SMALL = {"decode_occupancy": [1, 8, 32], "decode_tokens_per_s": [50, 300, 900],
         "prefill_tokens_per_s": 5000, "update_tokens_per_s": 3000, "sync_s": 0.5,
         "update_overhead_s": 0.2, "reward_s_per_group": 0.01,
         "response_lengths": {"kind": "longtail", "max_new_tokens": 512, "median": 40, "p90": 200},
         "prompt_tokens": 32, "n_samples": 2, "prompts_per_step": 4, "max_seqs_per_replica": 16}


@pytest.fixture()
def costs_file(tmp_path) -> Path:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(SMALL))
    return path


def test_plan_prints_a_table_per_device_count_and_writes_the_rows(costs_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--costs", str(costs_file), "--devices", "4,8", "--engine-share", "0.5,0.75",
            "--k", "0,2", "--steps", "6", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "4 devices:" in printed and "8 devices:" in printed and "one_step_off" in printed
    data = json.loads(out.read_text())
    assert data["devices"] == [4, 8] and data["k"] == [0, 2] and data["steps"] == 6
    assert CostModel.from_dict(data["costs"]) == CostModel.from_dict(SMALL)
    # per device count and share: sync (K=0), one_step_off (K=1), async at each K asked for
    rows = data["rows"]
    assert [(r["devices"], r["engine_share"], r["schedule"], r["k"]) for r in rows] == [
        (d, share, schedule, k) for d in (4, 8) for share in (0.5, 0.75)
        for schedule, k in (("sync", 0), ("one_step_off", 1), ("async", 0), ("async", 2))]
    for row in rows:
        assert row["engine_devices"] + row["trainer_devices"] == row["devices"]
        assert row["groups_trained"] + row["groups_dropped"] == 6 * SMALL["prompts_per_step"]
        assert row["staleness_max"] <= row["k"] and row["trained_tokens_per_s"] > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_colocated_placement_runs_every_replica_and_the_trainer_on_every_device(costs_file,
                                                                                tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--costs", str(costs_file), "--devices", "4", "--placement",
                 "separate,colocated", "--k", "2", "--steps", "6", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    colocated = [r for r in rows if r["placement"] == "colocated"]
    separate = [r for r in rows if r["placement"] == "separate"]
    assert len(colocated) == len(separate) == 3  # sync, one_step_off, async at K=2
    for row in colocated:
        assert row["engine_replicas"] == row["engine_devices"] == row["trainer_devices"] == 4
    for row in separate:
        assert row["engine_devices"] == row["trainer_devices"] == 2
    # one device, engine and trainer in turns: the setup of a single-GPU run
    assert main(["plan", "--costs", str(costs_file), "--devices", "1", "--placement",
                 "colocated", "--steps", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["engine_replicas"], r["trainer_devices"]) for r in rows} == {(1, 1)}


def test_the_example_costs_load_and_plan(tmp_path, capsys):
    costs = CostModel.from_dict(json.loads(EXAMPLE.read_text()))
    assert costs.response_lengths.kind == "longtail"
    assert main(["plan", "--costs", str(EXAMPLE), "--devices", "8", "--k", "1",
                 "--steps", "4"]) == 0
    assert "async" in capsys.readouterr().out


@pytest.mark.parametrize("change, argv, message", [
    (None, ["--costs", "{dir}/missing.json"], "missing.json: no such file"),
    ("{not json", [], "is not valid JSON"),
    ({**SMALL, "decode_occupancy": [8, 1, 32]}, [], "must be strictly ascending"),
    ({**SMALL, "prompts_per_stp": 4}, [], "unknown field(s) prompts_per_stp"),
    (SMALL, ["--devices", "8,x"], "--devices '8,x': give comma-separated integers"),
    (SMALL, ["--engine-share", "1.0"], "engine_share=1.0 must be in (0, 1)"),
    (SMALL, ["--k", "-1"], "K=-1 must be an integer >= 0"),
    (SMALL, ["--placement", "shared"], "--placement 'shared': give separate, colocated or both"),
    (SMALL, ["--out", "{dir}/no/such/dir/plan.json"], "does not exist; create it first"),
])
def test_bad_input_is_one_line_and_exit_2(change, argv, message, tmp_path, capsys):
    path = tmp_path / "costs.json"
    if change is not None:
        path.write_text(change if isinstance(change, str) else json.dumps(change))
    args = ["plan", "--costs", str(path), "--devices", "4", "--steps", "2"]
    args += [a.format(dir=tmp_path) for a in argv]
    assert main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert err[0].startswith("mcore-rl plan: error: ")
    assert captured.out == ""  # refused before any simulation
    assert sorted(p.name for p in tmp_path.iterdir()) == (["costs.json"] if change else [])
