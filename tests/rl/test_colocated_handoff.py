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
    """The HF engine, noting each call of the handoff and the weight session (in ``CALLS``,
    and in ``calls_file`` beside its log when given one)."""

    calls_file = None


def _recorded(name):
    original = getattr(HFEngine, name)

    def method(self, *args, **kwargs):
        CALLS.append(name)
        if self.calls_file is not None:  # in a rollout controller's process: also on disk
            with open(self.calls_file, "a") as f:
                f.write(name + "\n")
        return original(self, *args, **kwargs)

    return method


for _name in RECORDED:
    setattr(RecordingEngine, _name, _recorded(_name))


def build_recording_engine(cfg, model_dir, log_file=None, **kwargs):
    """An engine factory as ``rollout.engine=module:attr`` takes it."""
    engine = RecordingEngine(model_dir, **kwargs)
    if log_file is not None:
        engine.calls_file = str(log_file).replace(".log", ".calls")
    return engine


def _run_and_record(rank, world_size, overrides):
    """The fused placement on this world: the engine in this rank's process, so the trainer's
    updates and the engine's calls land in one list, in order."""
    from mcore_rl.config import load_config, validate_config
    from mcore_rl.parallel import destroy_parallel
    from mcore_rl.roles.graph import run_in_this_world
    from mcore_rl.train.engine import TrainEngine

    train_batch = TrainEngine.train_batch

    def recording_train_batch(self, *args, **kwargs):
        CALLS.append("train")
        return train_batch(self, *args, **kwargs)

    CALLS.clear()
    TrainEngine.train_batch = recording_train_batch
    try:
        cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", overrides), world_size)
        run_in_this_world(cfg)
    finally:
        TrainEngine.train_batch = train_batch
        destroy_parallel()
    return list(CALLS)


def _collapsed(calls: list[str]) -> list[str]:
    return [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1]]


def _overrides(tmp_path) -> list[str]:
    return [f"rollout.engine={__name__}:build_recording_engine", "train.warm_start_steps=2",
            "train.steps=2", "train.val_every=0", "reshard.verify=false",
            "checkpoint.save_every=0", "logging.progress_bar=false",
            "logging.backends=[jsonl]", "logging.samples_every=0", f"logging.dir={tmp_path}"]


def test_rl_steps_hand_the_devices_over_in_order_sleep_train_wake_weights_sync_wake_kv(tmp_path):
    calls = _collapsed(shared_world(1).run(_run_and_record, _overrides(tmp_path))[0])
    handoff = ["sleep", "train", "wake_weights", "begin_update", "finish_update", "wake_kv_cache"]
    assert calls == handoff + ["generate"] + handoff + ["generate"] + handoff, calls


def test_an_engine_beside_the_trainer_is_never_put_to_sleep_or_woken(tmp_path):
    # each sleep or wake would be a round trip to an engine in another process
    from mcore_rl.config import load_config
    from mcore_rl.flow.ray_shim import local_ray
    from mcore_rl.roles.graph import run_job
    from mcore_rl.roles.rules import check_runnable

    overrides = _overrides(tmp_path) + ["rollout.placement=separate"]
    with local_ray(include_dashboard=False):
        run_job(check_runnable(load_config(REPO / "configs" / "quickstart.yaml", overrides), 1))
    calls = _collapsed((tmp_path / "engine_0.calls").read_text().split())
    steps = ["begin_update", "finish_update"]
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
