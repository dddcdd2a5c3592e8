"""A rollout engine for tests of the asynchronous schedule: the HF engine, except that the
replica whose log file names ``engine_1`` is stuck. It holds each new prompt's request
until its weights have moved ``STUCK_VERSIONS`` versions past the version it was submitted
under (its steps return nothing meanwhile, so weight syncs still reach it), so that group
finishes too old for ``train.max_staleness=1`` whatever the timing. A prompt it has seen
before (a group generated again) runs at once. ``STUCK_S`` caps a hold, so that a run's
last groups end even when no new weights come.

    rollout.engine=tests.api.stuck_engine:build rollout.replicas=2
"""
from __future__ import annotations

import time

STUCK_VERSIONS = 2
STUCK_S = 6.0
POLL_S = 0.05


def build(cfg, model_dir, **kwargs):
    from mcore_rl.engines.hf_engine import HFEngine

    stuck = "engine_1" in str(kwargs.get("log_file", ""))

    class StuckHF(HFEngine):
        def submit(self, request):
            seen = self.__dict__.setdefault("_seen", set())
            key = tuple(request.prompt)
            if key not in seen:
                seen.add(key)
                self.__dict__.setdefault("_held", {})[request.request_id] = (
                    self.weight_version, time.monotonic())
            super().submit(request)

        def step(self):
            queue = self._queued()
            held = self.__dict__.get("_held", {})
            if stuck and queue and queue[0].request_id in held:
                version, since = held[queue[0].request_id]
                if self.weight_version - version < STUCK_VERSIONS and \
                        time.monotonic() - since < STUCK_S:
                    time.sleep(POLL_S)
                    return []
                del held[queue[0].request_id]
            return super().step()

    return StuckHF(model_dir, tp=cfg.engine_tp, dtype=kwargs.get("dtype", "fp32"),
                   seed=kwargs.get("seed", 0))


DIE_AFTER_STEPS = 3


def build_dying(cfg, model_dir, **kwargs):
    """The HF engine, except that replica ``engine_1`` kills its own process (SIGKILL, as
    the OS would) at its ``DIE_AFTER_STEPS``-th step that has work: a replica lost mid-run."""
    import os
    import signal

    from mcore_rl.engines.hf_engine import HFEngine

    dying = "engine_1" in str(kwargs.get("log_file", ""))

    class DyingHF(HFEngine):
        def step(self):
            if dying and self._queued():
                self.__dict__["_busy_steps"] = self.__dict__.get("_busy_steps", 0) + 1
                if self._busy_steps >= DIE_AFTER_STEPS:
                    os.kill(os.getpid(), signal.SIGKILL)
            return super().step()

    return DyingHF(model_dir, tp=cfg.engine_tp, dtype=kwargs.get("dtype", "fp32"),
                   seed=kwargs.get("seed", 0))
