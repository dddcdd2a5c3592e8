"""`mcore-rl train` of an RL job on the dataflow runtime: the RL loop as a graph of
controllers on Ray (`mcore_rl.api.rl_graph`), driven from this process.

A stop request (SIGTERM or SIGUSR1 to this process, or the stop file of
``$MCORE_RL_STOP_FILE``) reaches the trainer ranks through the stop file, so they agree on
a step boundary, checkpoint and end the run; this process then exits with
`stop_exit_code()`. Failures end with one line: bad input found while running (a reward
function that raises) exits 2, an engine that died exits 1."""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from mcore_rl.config import RLConfig
from mcore_rl.errors import UsageError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopForwarding:
    """This process's stop signals turned into the stop file the trainer ranks watch; a
    second signal of the same kind gets its default action."""

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        self.received: set[int] = set()
        self.previous: dict = {}

    def install(self) -> "StopForwarding":
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if signum in self.received:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received.add(signum)
        self.stop_file.touch()

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def run_graph(cfg: RLConfig) -> int:
    from mcore_rl.api.rl_graph import run_rl_graph
    from mcore_rl.engines.liveness import EngineDiedError
    from mcore_rl.flow import FlowError, ray_shim
    from mcore_rl.launch.stop_signal import STOP_FILE_ENV, StopRequested, StopSignal, stop_exit_code

    # vLLM logs every request at INFO; keep the console for the run's own progress.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    given = os.environ.get(STOP_FILE_ENV)
    private = None
    if given:
        stop_file = Path(given)
    else:
        Path(cfg.logging.dir).mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".stop-request.", dir=cfg.logging.dir)
        os.close(fd)
        os.unlink(name)
        stop_file = private = Path(name)
    stop_ray = None
    if not ray_shim.require().is_initialized():
        stop_ray = ray_shim.start_local(include_dashboard=False, logging_level=logging.WARNING)
    forwarding = StopForwarding(stop_file).install()  # after ray.init, which sets its own
    p = cfg.parallel
    world = (p.dp or 1) * p.tp * p.pp
    print(f"mcore-rl: {world} trainer rank(s), TP{p.tp}xPP{p.pp}xDP{world // (p.tp * p.pp)}; "
          f"rollout ({cfg.rollout.engine}) -> reward -> trainer controllers on Ray", flush=True)
    # Ranks print their step lines through Ray's log forwarding, which has no use for a
    # progress bar's carriage returns.
    cfg = replace(cfg, logging=replace(cfg.logging, progress_bar=False))
    try:
        run_rl_graph(cfg, stop=StopSignal(stop_file=stop_file, signals=()))
    except FlowError as err:
        cause = err.cause
        if isinstance(cause, StopRequested):
            print(f"mcore-rl: stopped on request after step {cause.step}; checkpoint "
                  f"{cause.checkpoint}; resume by running the same command again", flush=True)
            return stop_exit_code()
        if isinstance(cause, UsageError):
            print(f"mcore-rl train: error: {cause}", file=sys.stderr, flush=True)
            return 2
        if isinstance(cause, EngineDiedError):
            print(f"mcore-rl train: error: {cause}", file=sys.stderr, flush=True)
            return 1
        raise
    finally:
        forwarding.uninstall()
        if stop_ray is not None:
            stop_ray()
        if private is not None:
            private.unlink(missing_ok=True)
            private.with_name(private.name + ".saved").unlink(missing_ok=True)
    return 0
