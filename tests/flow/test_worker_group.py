"""How the ranks of a worker group end (`mcore_rl.flow.worker_group`)."""
from __future__ import annotations

import importlib
import time

from mcore_rl.flow import Controller, ControllerGroup, factory, launch
from tests.flow import helpers


def test_closed_ranks_run_their_exit_handlers_and_skip_the_interpreters_module_teardown(
        ray_cluster, tmp_path, monkeypatch):
    """A rank's orderly exit ends after its exit handlers (Ray's, the function's), without
    the module teardown that takes seconds after torch and Megatron and that the launch's
    teardown would wait for (here a teardown that would take 30 s)."""
    log = str(tmp_path / "log.jsonl")
    launch_module = importlib.import_module("mcore_rl.flow.launch")  # `flow.launch`: the function
    monkeypatch.setattr(launch_module, "KILL_WAIT_S", 60.0)  # the launch waits for the ranks
    start = time.monotonic()
    launch(ControllerGroup([Controller("ranks", factory(helpers.ExitRecorder, log), data=[1, 2],
                                       strategy="worker_group", num_workers=2)]))
    assert time.monotonic() - start < 30.0  # no rank went through the 30 s teardown
    started = [r for r in helpers.read(log) if r["event"] == "started"]
    assert sorted(r["rank"] for r in started) == [0, 1]
    events = helpers.read(log)
    assert sorted(r["rank"] for r in events if r["event"] == "atexit") == [0, 1]
    assert [r for r in events if r["event"] == "module_teardown"] == []
