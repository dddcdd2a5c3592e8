"""The colocated handoff: the engine sleeps while the trainer updates, then wakes its weights
for the sync and its KV cache for the next generation, in that order; an engine asleep
refuses to generate, and one whose weights are asleep refuses a sync."""
from pathlib import Path

import pytest

from mcore_rl.engines import SamplingConfig
from mcore_rl.engines.hf_engine import HFEngine
from tests.models.tiny_hf import save_tiny_hf_model
from tests.world import shared_world

REPO = Path(__file__).resolve().parents[2]
CALLS: list[str] = []
"""What the recording engine and the trainer did, in order (in the rank's process)."""
RECORDED = ("generate", "sleep", "wake_weights", "begin_update", "finish_update", "wake_kv_cache")


class RecordingEngine(HFEngine):
    """The HF engine, noting each call of the handoff and the weight session."""


def _recorded(name):
    original = getattr(HFEngine, name)

    def method(self, *args, **kwargs):
        CALLS.append(name)
        return original(self, *args, **kwargs)

    return method


for _name in RECORDED:
    setattr(RecordingEngine, _name, _recorded(_name))


def build_recording_engine(cfg, model_dir, **kwargs):
    """An engine factory as ``rollout.engine=module:attr`` takes it."""
    return RecordingEngine(model_dir, **kwargs)


def _run_and_record(rank, world_size, overrides):
    from mcore_rl.config import load_config, validate_config
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.engine import TrainEngine
    from mcore_rl.trainer import train

    train_batch = TrainEngine.train_batch

    def recording_train_batch(self, *args, **kwargs):
        CALLS.append("train")
        return train_batch(self, *args, **kwargs)

    CALLS.clear()
    TrainEngine.train_batch = recording_train_batch
    try:
        cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", overrides), world_size)
        ctx = initialize_parallel(tp=1, pp=1, seed=cfg.train.seed)
        train(cfg, ctx)
        destroy_parallel()
    finally:
        TrainEngine.train_batch = train_batch
    return list(CALLS)


def _collapsed(calls: list[str]) -> list[str]:
    return [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1]]


def _overrides(tmp_path) -> list[str]:
    return [f"rollout.engine={__name__}:build_recording_engine", "train.warm_start_steps=2",
            "train.steps=2", "train.val_every=0", "reshard.verify=false",
            "checkpoint.save_every=0", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.samples_every=0", f"logging.dir={tmp_path}"]


def test_rl_steps_hand_the_devices_over_in_order_sleep_train_wake_weights_sync_wake_kv(tmp_path):
    calls = _collapsed(shared_world(1).run(_run_and_record, _overrides(tmp_path))[0])
    handoff = ["sleep", "train", "wake_weights", "begin_update", "finish_update", "wake_kv_cache"]
    assert calls == handoff + ["generate"] + handoff + ["generate"] + handoff, calls


def test_an_engine_beside_the_trainer_is_never_put_to_sleep_or_woken(tmp_path):
    # each sleep or wake would be a round trip to an engine in another process
    overrides = _overrides(tmp_path) + ["rollout.placement=separate"]
    calls = _collapsed(shared_world(1).run(_run_and_record, overrides)[0])
    steps = ["train", "begin_update", "finish_update"]
    assert calls == steps + ["generate"] + steps + ["generate"] + steps, calls


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(str(save_tiny_hf_model("llama-tied", tmp_path_factory.mktemp("handoff"))))


def test_an_engine_generates_only_when_weights_and_kv_cache_are_awake(engine):
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=3)
    before = [s.token_ids for s in engine.generate([[5, 6, 7]], sampling)]
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache, weights\)"):
        engine.generate([[5, 6, 7]], sampling)
    with pytest.raises(RuntimeError, match="weights are asleep: call wake_weights"):
        engine.begin_update("/nonexistent", 1, 1)
    engine.wake_weights()
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache\)"):
        engine.generate([[5, 6, 7]], sampling)
    engine.wake_kv_cache()
    assert [s.token_ids for s in engine.generate([[5, 6, 7]], sampling)] == before
