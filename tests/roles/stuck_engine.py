"""A rollout engine for tests of the asynchronous schedule: the HF engine, except that one
prompt group of the run is stuck. The first replica to take a new prompt claims it (a file
beside the engine logs, created exclusively, so one replica of the run holds one group):
it holds that request until its weights have moved ``STUCK_VERSIONS`` versions past the
version it was submitted under, while its other requests run past it (its steps return
nothing only when the held request is all it has, so weight syncs still reach it). The
group then finishes too old for ``train.max_staleness=1`` whatever the timing: the trainer
takes two steps without it (a step needs 4 of the 8 groups in flight), and nothing else
waits on it. ``STUCK_S`` caps a hold only so that a broken run fails instead of hanging.

    rollout.engine=tests.roles.stuck_engine:build rollout.replicas=2
"""
from __future__ import annotations

import os
import time
from pathlib import Path

STUCK_VERSIONS = 2
STUCK_S = 120.0
POLL_S = 0.05


def _claim(log_file) -> bool:
    """Whether this process is the first of the run to ask (the claim file is new)."""
    try:
        os.close(os.open(Path(log_file).parent / "stuck_group.claim",
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def build(cfg, model_dir, **kwargs):
    from mcore_rl.engines.hf_engine import HFEngine

    log_file = kwargs.get("log_file") or "."

    class StuckHF(HFEngine):
        claimed = False
        held: dict = {}
        """Request id -> (weight version at submit, time) of the held request."""

        def submit(self, request):
            if not self.claimed:
                self.claimed = True  # one try per replica
                if _claim(log_file):
                    self.held = {request.request_id: (self.weight_version, time.monotonic())}
            super().submit(request)

        def step(self):
            queue = self._queued()
            for rid, (version, since) in list(self.held.items()):
                if self.weight_version - version >= STUCK_VERSIONS or \
                        time.monotonic() - since >= STUCK_S:
                    del self.held[rid]
            waiting = [r for r in queue if r.request_id in self.held]
            if not waiting:
                return super().step()
            if len(waiting) == len(queue):
                time.sleep(POLL_S)
                return []
            queue[:] = [r for r in queue if r.request_id not in self.held]
            try:
                return super().step()
            finally:
                queue[:0] = waiting  # still first in line once released

    return StuckHF(model_dir, tp=cfg.engine_tp, dtype=kwargs.get("dtype", "fp32"),
                   seed=kwargs.get("seed", 0))


DIE_AFTER_STEPS = 3


def build_dying(cfg, model_dir, **kwargs):
    """The HF engine, except that replica ``engine_1`` kills its own process (SIGKILL, as
    the OS would) at its ``DIE_AFTER_STEPS``-th step that has work: a replica lost mid-run."""
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
