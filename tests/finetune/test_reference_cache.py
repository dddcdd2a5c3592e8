"""Cached reference log-probs: looked up by sequence, written once, read back; a cached DPO
run logs the same metrics as one that computes them on the fly, and computes nothing after
its first pass; a second run on the same model and data computes nothing at all."""
import json
from pathlib import Path

import pytest
import torch

from mcore_rl.data.batch import Batch
from mcore_rl.finetune.reference_cache import ReferenceCache, row_keys
from tests.finetune.test_jobs_learn import _run
from tests.world import shared_world


def test_lookup_computes_only_missing_sequences_and_the_file_round_trips(tmp_path):
    batch = Batch.from_sequences([[1, 5, 6], [1, 5, 7], [1, 5, 6]], prompt_lens=[2, 2, 1])
    keys = row_keys(batch)
    assert keys[0] != keys[1] and keys[0] != keys[2]  # other tokens, other completion start
    calls = []

    def compute(b):
        calls.append(len(b))
        return -b["input_ids"].sum(-1).float()

    cache = ReferenceCache(tmp_path / "c.pt")
    assert cache.lookup(batch, compute).tolist() == [-12.0, -13.0, -12.0]
    assert cache.lookup(batch.select([1, 0]), compute).tolist() == [-13.0, -12.0]
    assert calls == [3] and cache.computed == 3
    cache.save(is_writer=True)
    again = ReferenceCache(tmp_path / "c.pt")
    assert again.lookup(batch, compute).tolist() == [-12.0, -13.0, -12.0] and calls == [3]


def _history(path: Path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_cached_dpo_matches_on_the_fly_and_is_reused(tmp_path):
    world = shared_world(1)
    base = ["train.steps=4", "train.val_every=2", "train.warm_start_steps=20", "finetune.val_score=false"]
    fly = world.run(_run, "dpo_quickstart.yaml", base + [f"logging.dir={tmp_path / 'fly'}"])[0]
    cached_dir = tmp_path / "cached"
    cached = world.run(_run, "dpo_quickstart.yaml", base + [
        f"logging.dir={cached_dir}", "finetune.reference_logps=cached"])[0]
    assert [h["step"] for h in cached] == [h["step"] for h in fly]
    for a, b in zip(fly, cached):
        for k in a:
            if not k.startswith(("time/", "perf/")):
                assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7), (a["step"], k)
    assert all(h["reference/computed"] == 0 for h in cached if h["step"] > 0)
    (cache_file,) = (cached_dir / "reference_cache").glob("*.pt")
    assert len(torch.load(cache_file, weights_only=True)) == 2 * (80 + 20)  # every pair, both sides
    stamp = cache_file.stat().st_mtime_ns
    again = world.run(_run, "dpo_quickstart.yaml", base + [
        f"logging.dir={cached_dir}", "finetune.reference_logps=cached", "checkpoint.resume=never"])[0]
    assert cache_file.stat().st_mtime_ns == stamp, "the second run must read the cache, not rewrite it"
    assert [h.get("loss") for h in again] == pytest.approx([h.get("loss") for h in cached])
