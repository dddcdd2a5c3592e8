"""`train.schedule: async` on real controllers: two engine replicas on disjoint cores both
serve one run and every weight sync reaches (and is verified on) both (the HF engine: two
vLLM replicas under this schedule are `tests/rl/test_replica_failure.py`'s, a sync verified
on vLLM replicas `tests/reshard/test_vllm_sync.py`'s); the staleness bound holds for every
trained token, no prompt group is trained twice; a group a replica sits on arrives too old
and is dropped, or regenerated, and counted either way; a replica killed mid-run ends the
run with an error that names it, and nothing waits on it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.roles.graph import run_job
from mcore_rl.config import load_config, validate_config

REPO = Path(__file__).resolve().parents[2]
RUN = ["train.schedule=async", "rollout.placement=separate",
       "train.val_every=0", "checkpoint.save_every=0", "logging.progress_bar=false",
       "logging.backends=[jsonl]", "logging.samples_every=0"]


def _history(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_two_replicas_serve_one_run_and_every_sync_is_verified_on_both(ray_cluster, tmp_path):
    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", RUN + [
        f"logging.dir={tmp_path}", "train.steps=3", "train.max_staleness=1", "rollout.replicas=2",
        "rollout.engine=hf",
        "train.warm_start_steps=40", "reshard.verify=true", "reshard.verify_every=1"]), 1)
    stats = run_job(cfg)
    per_replica = [s.items_out for s in stats.instances if s.role == "rollout"]
    assert len(per_replica) == 2 and all(n > 0 for n in per_replica), per_replica
    prompts = cfg.train.steps * cfg.data.prompts_per_step
    assert sum(per_replica) == stats.roles["reward"].items_in == prompts  # each group once
    steps = [h for h in _history(tmp_path) if h["step"] > 0]
    assert [h["sync/verified_replicas"] for h in steps] == [2.0] * cfg.train.steps
    assert all(h["sync/verify_max_abs_diff"] < 1e-3 for h in steps)
    assert max(h["rollout/replicas_used"] for h in steps) == 2
    assert all(h["rollout/token_staleness_max"] <= 1 and h["rollout/staleness_max"] <= 1
               for h in steps)
    assert sum(h["rollout/stale_dropped"] for h in steps) == 0


def test_async_colocated_parks_running_requests_while_the_engine_sleeps(ray_cluster, tmp_path):
    """Colocated, the trainer puts the engine to sleep for every update: the running
    requests stop before it sleeps and go on after it wakes (a step on a sleeping engine
    raises), so every step still trains within the bound."""
    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", RUN + [
        f"logging.dir={tmp_path}", "train.steps=3", "train.max_staleness=1",
        "rollout.placement=colocated", "train.warm_start_steps=40", "rollout.max_new_tokens=40",
        "rollout.min_new_tokens=40",
        "model.max_position_embeddings=64"]), 1)
    stats = run_job(cfg)
    steps = [h for h in _history(tmp_path) if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2, 3]
    assert stats.roles["rollout"].items_out == stats.roles["reward"].items_in == 3 * 16
    assert all(h["rollout/token_staleness_max"] <= 1 for h in steps)
    assert sum(h["rollout/partial_continued"] for h in steps) > 0  # parked and continued


@pytest.mark.parametrize("on_stale", ["drop", "regenerate"])
def test_a_stuck_replicas_groups_are_dropped_or_regenerated_and_counted(ray_cluster, tmp_path, on_stale):
    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", RUN + [
        f"logging.dir={tmp_path}", "train.steps=4", "train.max_staleness=1", "rollout.replicas=2",
        "train.warm_start_steps=0",
        "rollout.engine=tests.roles.stuck_engine:build", "data.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4", f"train.on_stale={on_stale}"]), 1)
    run_job(cfg)
    steps = [h for h in _history(tmp_path) if h["step"] > 0]
    assert all(h["rollout/staleness_max"] <= 1 for h in steps)  # nothing older is trained on
    dropped = sum(h["rollout/stale_dropped"] for h in steps)
    regenerated = sum(h["rollout/stale_regenerated"] for h in steps)
    # the stuck group: its 4 samples dropped, or it is generated once more and trained on.
    # A replica slowed by a loaded machine may let another group age past the bound too:
    # whole groups, and never none
    if on_stale == "drop":
        assert dropped >= 4 and dropped % 4 == 0 and regenerated == 0, (dropped, regenerated)
    else:
        assert regenerated >= 1 and dropped % 4 == 0, (dropped, regenerated)


def test_a_replica_killed_mid_run_ends_the_run_with_an_error_naming_it(ray_cluster, tmp_path):
    import time

    from mcore_rl.flow import FlowError

    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", RUN + [
        f"logging.dir={tmp_path}", "train.steps=6", "train.max_staleness=1", "rollout.replicas=2",
        "train.warm_start_steps=0", "rollout.engine=tests.roles.stuck_engine:build_dying",
        "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4"]), 1)
    start = time.monotonic()
    with pytest.raises(FlowError) as err:
        run_job(cfg)
    first = str(err.value).splitlines()[0]
    assert first.startswith("controller 'rollout' #1 failed while running: its process (pid "), first
    assert (err.value.role, err.value.index) == ("rollout", 1)
    assert time.monotonic() - start < 120  # nothing waited on the dead replica


def test_a_prompt_group_reaching_the_trainer_twice_is_an_error_not_a_second_update():
    from types import SimpleNamespace

    from mcore_rl.trainer import check_once

    state = SimpleNamespace(groups_seen=set(),
                            cfg=SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2)))
    check_once(state, SimpleNamespace(meta={"group_key": [(1, 0), (1, 0), (1, 1), (1, 1)]}))
    with pytest.raises(RuntimeError, match=r"prompt group \(1, 1\) \(step, index\) reached the trainer twice"):
        check_once(state, SimpleNamespace(meta={"group_key": [(2, 0), (2, 0), (1, 1), (1, 1)]}))
    with pytest.raises(RuntimeError, match=r"prompt group \(3, 0\)"):  # twice in one batch
        check_once(state, SimpleNamespace(meta={"group_key": [(3, 0)] * 4}))
