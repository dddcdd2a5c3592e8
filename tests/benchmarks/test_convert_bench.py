"""`mcore-rl bench convert` measures both directions and the baseline in fresh processes."""
import json

import pytest

from mcore_rl.cli.main import main
from tests.models.tiny_hf import save_tiny_hf_model


def test_bench_convert_writes_time_and_peak_rss_next_to_model_size(tmp_path, capsys):
    hf_dir = save_tiny_hf_model("qwen2-tied", tmp_path / "hf")
    out = tmp_path / "report" / "convert.json"
    assert main(["bench", "convert", "--json", str(out), "--hf-dir", str(hf_dir)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "convert"
    assert report["model"]["safetensors_bytes"] > report["model"]["largest_tensor_bytes"] > 0
    assert report["model"]["parameters"] > 0
    for direction in ("hf_to_mcore", "mcore_to_hf"):
        seconds, rss = report[direction]["seconds"], report[direction]["peak_rss"]
        assert seconds["unit"] == "s" and seconds["ours"] > 0 and seconds["baseline"] > 0
        assert seconds["speedup"] == pytest.approx(seconds["baseline"] / seconds["ours"], rel=0.02)
        assert rss["unit"] == "MiB" and rss["ours"] > 50 and rss["baseline"] > 50
        assert "ratio" in report[direction]["peak_rss_above_imports"]
