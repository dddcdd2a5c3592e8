"""The colocated hand-off's fence (`RolloutEngine.sleep`, `wake_weights`, `wake_kv_cache`)
and `wait_awake`, which a rollout role blocks on until the trainer's sync wakes the engine."""
from __future__ import annotations

import threading

from mcore_rl.engines.base import RolloutEngine


class _Engine(RolloutEngine):
    name = "fake"

    def _generate(self, prompts, sampling, seeds):
        raise NotImplementedError

    def begin_update(self, path, nbytes, version):
        raise NotImplementedError

    def load_bucket(self, manifest):
        raise NotImplementedError

    def _finish_session(self, complete):
        raise NotImplementedError


def test_wait_awake_holds_until_both_parts_are_awake():
    engine = _Engine()
    assert engine.wait_awake(0)  # a new engine is awake
    engine.sleep()
    assert engine.asleep and not engine.wait_awake(0.01)
    engine.wake_weights()  # the weight sync's half: generation must still wait
    assert engine.asleep and not engine.wait_awake(0.01)
    engine.wake_kv_cache()
    assert not engine.asleep and engine.wait_awake(0)
    engine.sleep()
    engine.wake_kv_cache()  # the other order: awake once the weights are too
    assert not engine.wait_awake(0.01)
    engine.wake_weights()
    assert engine.wait_awake(0)


def test_a_wake_on_another_thread_ends_the_wait():
    engine = _Engine()
    engine.sleep()
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(engine.wait_awake(60)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not woke
    engine.wake()
    waiter.join(10)  # well before the 60 s timeout: the wake ended the wait
    assert woke == [True]
