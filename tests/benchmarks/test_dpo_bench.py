"""`mcore-rl bench dpo` trains our DPO job and TRL's DPOTrainer on the same batches and compares them."""
import json
import statistics

import pytest

from mcore_rl.cli.main import main

REL = 2e-3
"""The report's floats carry 4 significant digits."""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_dpo") / "dpo.json"
    assert main(["bench", "dpo", "--json", str(out), "--quick"]) == 0
    return json.loads(out.read_text())


def measured(variants: dict) -> dict:
    return {name: v for name, v in variants.items() if "skipped" not in v}


@pytest.mark.bench
def test_both_sides_count_the_same_tokens_in_the_same_batches(report):
    s, variants = report["settings"], report["results"]["variants"]
    ours, trl = measured(variants["ours"]), measured(variants["baseline"])
    assert set(ours) == {"on_the_fly", "cached"}
    assert {"default", "precompute_ref_log_probs"} <= set(trl)
    # Step k of every run trains on the same pairs: each side's own count of the non-pad
    # tokens in its batch agrees, step by step.
    first = [step["tokens"] for step in ours["on_the_fly"]["per_step"]]
    assert len(first) == s["steps"] and all(t > 0 for t in first)
    for v in [*ours.values(), *trl.values()]:
        assert [step["tokens"] for step in v["per_step"]] == first
        assert v["steps_measured"] == s["steps"] - s["warmup_steps"]
        assert v["tokens_measured"] == sum(first[s["warmup_steps"]:])
        rates = [step["tokens"] / step["step"] for step in v["per_step"][s["warmup_steps"]:]]
        assert v["tokens_per_s"] == pytest.approx(statistics.median(rates), rel=REL)
    # The cached run computes no reference log-probs during its steps.
    assert all(step["reference_computed"] == 0 for step in ours["cached"]["per_step"])
    assert all(step["reference"] == 0 for step in trl["precompute_ref_log_probs"]["per_step"])
    ref = report["results"]["reference"]
    assert ref["pass_tokens"]["ours"] == ref["pass_tokens"]["baseline"] > 0
    assert ref["pass_sequences"]["ours"] == ref["pass_sequences"]["baseline"] == 2 * s["pairs"]


@pytest.mark.bench
def test_the_best_variant_of_each_side_is_compared(report):
    r = report["results"]
    ours, trl = measured(r["variants"]["ours"]), measured(r["variants"]["baseline"])
    o_best = max(ours, key=lambda n: ours[n]["tokens_per_s"])
    t_best = max(trl, key=lambda n: trl[n]["tokens_per_s"])
    assert r["best"] == {"ours": o_best, "baseline": t_best}
    tps = r["tokens_per_s"]
    assert tps["unit"] == "tokens/s"
    assert (tps["ours"], tps["baseline"]) == (ours[o_best]["tokens_per_s"], trl[t_best]["tokens_per_s"])
    assert tps["speedup"] == pytest.approx(tps["ours"] / tps["baseline"], rel=REL)
    step = r["step_time"]
    assert step["speedup"] == pytest.approx(step["baseline"] / step["ours"], rel=REL)
    for entry in r["like_for_like"].values():
        assert entry["ours"] == ours[entry["ours_variant"]]["tokens_per_s"]
        assert entry["baseline"] == trl[entry["baseline_variant"]]["tokens_per_s"]
        assert entry["speedup"] == pytest.approx(entry["ours"] / entry["baseline"], rel=REL)
    precomputed = r["like_for_like"]["reference_before_training"]["baseline_variant"]
    assert trl[precomputed]["options_in_effect"]["precompute_ref_log_probs"]
    assert not trl[r["like_for_like"]["reference_each_step"]["baseline_variant"]]["options_in_effect"][
        "precompute_ref_log_probs"]


@pytest.mark.bench
def test_the_reference_pass_is_reported_on_its_own(report):
    r = report["results"]
    ref, ours, trl = r["reference"], r["variants"]["ours"], r["variants"]["baseline"]
    mine = ours["cached"]["reference_pass"]
    theirs = trl[r["like_for_like"]["reference_before_training"]["baseline_variant"]]["reference_pass"]
    assert (ref["pass_time"]["ours"], ref["pass_time"]["baseline"]) == (mine["seconds"], theirs["seconds"])
    assert ref["pass_time"]["speedup"] == pytest.approx(theirs["seconds"] / mine["seconds"], rel=REL)
    rate = ref["pass_tokens_per_s"]
    assert rate["ours"] == pytest.approx(mine["tokens"] / mine["seconds"], rel=REL)
    assert rate["baseline"] == pytest.approx(theirs["tokens"] / theirs["seconds"], rel=REL)
    per_step = ref["per_step_time"]
    assert per_step["ours"] == ours["on_the_fly"]["reference_s"] > 0
    assert per_step["speedup"] == pytest.approx(per_step["baseline"] / per_step["ours"], rel=REL)
    assert ours["on_the_fly"]["reference_pass"] is None


@pytest.mark.bench
def test_every_trl_variant_is_recorded_with_its_figure_or_why_it_did_not_run(report):
    trl = report["results"]["variants"]["baseline"]
    assert set(trl) == {"default", "precompute_ref_log_probs", "padding_free",
                        "precompute_ref_log_probs+padding_free"}
    for v in trl.values():
        assert v.get("skipped") or v["tokens_per_s"] > 0
    if "skipped" not in trl["padding_free"]:
        assert trl["padding_free"]["options_in_effect"]["padding_free"]
    assert report["settings"]["trl"] and report["machine"]["cpu_count"]


def test_too_few_steps_is_one_line_with_exit_2(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert main(["bench", "dpo", "--json", str(out), "--quick", "--steps", "2", "--warmup", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps 2 leaves nothing after --warmup 2" in err[0]
    assert not out.exists()
