"""`mcore-rl bench train-engine --quick` writes the comparison JSON it promises."""
import json

import pytest

from mcore_rl.cli.main import main


@pytest.mark.bench
def test_train_engine_bench_reports_ours_against_baselines(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "train-engine", "--quick", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {
        f"{p}_{l}" for p in ("forward", "train_step")
        for l in ("tp1", "tp2", "pp2", "moe_ep1", "moe_ep2", "shared_prompts",
                  "packed_vs_padded")}
    for entry in report["results"].values():
        assert entry["unit"] == "tokens/s"
        assert entry["ours"] > 0 and entry["baseline"] > 0
        assert entry["speedup"] == entry["ours"] / entry["baseline"]
    for phase in ("forward", "train_step"):
        row = report["results"][f"{phase}_packed_vs_padded"]
        assert row["padded_to_real"] > 1  # the quick batch's micro-batches hold padding
