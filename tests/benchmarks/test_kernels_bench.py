"""`mcore-rl bench kernels --quick` runs end to end and writes well-formed, consistent results."""
from __future__ import annotations

import json

from mcore_rl.benchmarks.kernels import main

TIME_KEYS = [
    "gae_8x64", "gae_8x64_mask_holes", "gae_4x256", "gae_4x256_mask_holes",
    "token_logprobs_fwd_time", "token_logprobs_fwd_bwd_time", "token_logprobs_fwd_bwd_inplace_time",
    "linear_token_logprobs_fwd_time", "linear_token_logprobs_fwd_bwd_time",
    "truncated_logprobs_top_k50_top_p0.9_fwd_bwd_time", "truncated_logprobs_top_p0.95_fwd_bwd_time",
]
MEMORY_KEYS = [
    "token_logprobs_fwd_peak_memory", "token_logprobs_fwd_bwd_peak_memory",
    "token_logprobs_fwd_bwd_inplace_peak_memory", "linear_token_logprobs_fwd_peak_memory",
    "linear_token_logprobs_fwd_bwd_peak_memory",
    "truncated_logprobs_top_k50_top_p0.9_fwd_bwd_peak_memory", "truncated_logprobs_top_p0.95_fwd_bwd_peak_memory",
]


def test_quick_benchmark_writes_ratios_and_ours_matches_the_baselines(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["--quick", "--json", str(out)]) == 0
    assert "[bench kernels]" in capsys.readouterr().out  # progress is shown as it goes
    data = json.loads(out.read_text())

    meta = data["metadata"]
    for key in ("device", "torch", "shapes", "timing", "memory", "dtype"):
        assert key in meta, key
    comps = data["comparisons"]
    assert set(comps) == set(TIME_KEYS) | set(MEMORY_KEYS)
    for key in TIME_KEYS:
        entry = comps[key]
        assert entry["unit"] == "ms" and entry["ours"] > 0 and entry["baseline"] > 0, key
        assert abs(entry["speedup"] - entry["baseline"] / entry["ours"]) < 1e-6 * entry["speedup"], key
    for key in MEMORY_KEYS:
        entry = comps[key]
        assert entry["unit"] == "MiB" and set(entry) >= {"ours", "baseline", "ratio"}, key

    # the fast paths compute what the baselines compute (fp32 log-probs / advantages, bf16 inputs)
    for key in TIME_KEYS:
        assert comps[key]["max_abs_diff"] < 1e-4, (key, comps[key]["max_abs_diff"])
    # bf16 gradients, compared relative to their largest entry: one bf16 ulp is <= 2^-7
    for key in ("token_logprobs_fwd_bwd_time", "token_logprobs_fwd_bwd_inplace_time",
                "linear_token_logprobs_fwd_bwd_time"):
        assert comps[key]["max_rel_grad_diff"] < 2e-2, (key, comps[key]["max_rel_grad_diff"])
