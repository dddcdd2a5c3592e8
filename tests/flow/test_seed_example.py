"""The seed example of the dataflow API with real parts: two actor controllers generating
with the real vLLM engine on disjoint cores, a critic controller scoring, and a trainer
controller updating a Megatron actor at TP2 whose weights stream into both engines after
every update."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mcore_rl.config import load_config
from mcore_rl.config.loader import config_to_dict
from mcore_rl.flow import (Controller, ControllerGroup, DataStream, FlowError, Megatron, factory,
                           launch)
from tests.flow import helpers
from tests.flow.conftest import CORES

REPO = Path(__file__).resolve().parents[2]
ITEMS = 10


def tiny_model(cfg, out: Path) -> Path:
    from mcore_rl.data.toy_task import toy_tokenizer
    from mcore_rl.models.random_init import write_random_model

    tok = toy_tokenizer()
    write_random_model(cfg.model, out, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id,
                       seed=cfg.train.seed)
    tok.save(out)
    return out


def seed_config(tmp_path: Path):
    return load_config(REPO / "configs" / "quickstart.yaml", [
        f"logging.dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt", "parallel.tp=2",
        "rollout.n_samples_per_prompt=4", "optimizer.lr=1e-2", "reshard.verify=false",
        "train.warm_start_steps=0", "train.val_every=0", "checkpoint.save_every=0",
        "train.max_staleness=1000"])  # unpaced: two engines run ahead of the trainer


def seed_graph(tmp_path: Path, log: str, critic=helpers.digit_share, actors: int = 2) -> ControllerGroup:
    """``actors`` vLLM actors (two: on disjoint cores) -> a critic -> a TP2 trainer."""
    cfg = seed_config(tmp_path)
    model_dir = tiny_model(cfg, tmp_path / "model")
    data = config_to_dict(cfg)
    rollout, scored = DataStream("rollout", buffer_size=1), DataStream("scored", buffer_size=1)
    group = ControllerGroup()
    cores = [[CORES[0]], [CORES[1]]] if len(CORES) > 1 else [[CORES[0]], [CORES[0]]]
    for i in range(actors):
        group.add(Controller(role="actor", data_output=rollout, devices=cores[i],
                             function=factory(helpers.recording_generate, log, data,
                                              str(model_dir), f"engine/{i}")))
    group.add(Controller(role="critic", data_input=rollout, data_output=scored, function=critic))
    group.add(Controller(role="trainer", data_input=scored, strategy=Megatron(tp=2),
                         function=factory(helpers.recording_train, log, data, str(model_dir),
                                          [f"engine/{i}" for i in range(actors)])))
    return group


def prompt_items() -> list[list[dict]]:
    return [[{"prompt": f"{k % 10}+{(3 * k) % 10}=", "item": k},
             {"prompt": f"{(7 * k) % 10}+1=", "item": k}] for k in range(ITEMS)]


def test_two_engines_a_critic_and_a_tp2_trainer_run_as_one_graph(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stats = launch(seed_graph(tmp_path, log), data=prompt_items(), num_epochs=1)

    records = helpers.read(log)
    engines = {r["pid"]: r["cores"] for r in records if r["event"] == "engine"}
    generated = [r for r in records if r["event"] == "generate"]
    trained = [r for r in records if r["event"] == "train"]
    # Every item produced is consumed exactly once, and both actors produced.
    assert sorted(r["item"] for r in generated) == list(range(ITEMS))
    assert sorted(r["item"] for r in trained) == list(range(ITEMS))
    assert {r["producer"] for r in trained} == set(engines) and len(engines) == 2
    actors = [s for s in stats.instances if s.role == "actor"]
    assert [s.items_out > 0 for s in actors] == [True, True]
    if len(CORES) > 1:
        assert sorted(engines.values()) == [[CORES[0]], [CORES[1]]]
    # The trainer's weights reach both engines: what either generates after the first
    # update's sync carries version >= 2 (1: the initial sync), and batches generated with
    # the latest weights have the trainer's own log-probs.
    first_sync = min(r["t"] for r in trained)
    later = [r for r in generated if r["t"] > first_sync]
    assert later and {r["pid"] for r in later} == set(engines)
    assert all(min(r["versions"]) >= 2 for r in later)
    assert [r["synced"] for r in trained] == list(range(2, ITEMS + 2))
    fresh = [r for r in trained if r["generated_with"] == r["synced"] - 1]
    assert fresh and all(r["gap"] < 1e-3 for r in fresh)
    assert trained[0]["tp"].startswith("TP2")
    assert not [p for p in engines if helpers.alive(p)]
    assert os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_a_failing_critic_ends_the_launch_and_no_engine_process_survives(ray_cluster, tmp_path):
    """One actor's engine is enough to see that none outlives the failed launch."""
    log = str(tmp_path / "log.jsonl")
    with pytest.raises(FlowError) as caught:
        launch(seed_graph(tmp_path, log, critic=helpers.digit_share_failing_at_2, actors=1),
               data=prompt_items())
    assert "controller 'critic' #0 failed" in str(caught.value).splitlines()[0]
    assert "the critic failed on purpose" in str(caught.value).splitlines()[0]
    records = helpers.read(log)
    engines = [r for r in records if r["event"] == "engine"]
    ranks = [r["pid"] for r in records if r["event"] == "rank"]
    pids = [p for r in engines for p in [r["pid"], *r["children"]]] + ranks
    assert len(engines) == 1 and len(ranks) == 2
    assert all(r["children"] for r in engines)  # vLLM's engine core (and what it started)
    deadline = time.monotonic() + 10.0
    while any(helpers.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if helpers.alive(p)] == []
