"""`mcore-rl bench reshard --quick` runs end to end and writes well-formed comparisons."""
from __future__ import annotations

import json

import pytest

from mcore_rl.benchmarks.reshard import main

TIME_KEYS = ["tiny_tp1_sync_time", "tiny_tp1_transfer_time", "tiny_tp1_apply_time"]
RATE_KEYS = ["tiny_tp1_sync_throughput", "tiny_tp1_transfer_throughput"]
MEMORY_KEYS = ["tiny_tp1_transport_peak_extra_memory", "tiny_tp1_sync_peak_extra_memory"]


@pytest.mark.bench
def test_quick_benchmark_writes_time_throughput_and_memory_comparisons(tmp_path, capsys):
    out = tmp_path / "reshard.json"
    assert main(["--quick", "--json", str(out)]) == 0
    assert "[bench reshard]" in capsys.readouterr().out
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["models"]["tiny"]["buckets"] > 1 and meta["bucket_mb"] == 1.0
    comps = data["comparisons"]
    assert set(comps) == set(TIME_KEYS + RATE_KEYS + MEMORY_KEYS)
    for key in TIME_KEYS:
        c = comps[key]
        assert c["unit"] == "s" and c["ours"] > 0 and c["baseline"] > 0, key
        assert abs(c["speedup"] - c["baseline"] / c["ours"]) < 1e-9 * c["speedup"], key
    sync = comps["tiny_tp1_sync_time"]
    assert sync["ours_transfer_s"] > 0 and sync["ours_apply_s"] > 0 and sync["naive_write_s"] > 0
    for key in RATE_KEYS:
        assert comps[key]["unit"] == "GB/s" and comps[key]["ours"] > 0, key
    for key in MEMORY_KEYS:
        c = comps[key]
        assert c["unit"] == "MiB" and {"ours", "baseline", "ratio"} <= set(c), key
    # The bound (one bucket + the largest tensor) is reported next to the measurement; RSS
    # on a shared machine is too noisy to assert on.
    transport = comps["tiny_tp1_transport_peak_extra_memory"]
    assert transport["bound_mib"] >= meta["bucket_mb"] and "within_bound" in transport
