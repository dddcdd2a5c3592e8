"""`launch` without a running Ray starts a local one and shuts it down again, leaving the
driver's signal handlers as they were, and a worker-group controller runs its function
SPMD on a gloo world of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.flow import helpers

REPO = Path(__file__).resolve().parents[2]
DRIVER = """
import json, os, sys
import ray
from mcore_rl.flow import Controller, ControllerGroup, DataStream, factory, launch
from tests.flow import helpers

import signal
log = sys.argv[1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the driver's own handler, to be kept
sums = DataStream("sums", 2)
group = ControllerGroup([
    Controller("ranks", factory(helpers.RankSum, log), data_output=sums, strategy="worker_group",
               num_workers=2, devices=[0, 1] if len(os.sched_getaffinity(0)) > 1 else None),
    Controller("sink", factory(helpers.Consume, log), data_input=sums)])
stats = launch(group, data=[1, 2, 3])
print(json.dumps({"initialized": ray.is_initialized(), "steps": stats.steps,
                  "sigterm_kept": signal.getsignal(signal.SIGTERM) is signal.SIG_IGN}), flush=True)
sys.stdin.readline()
"""


def processes_with(mark: str) -> set[int]:
    """Processes whose environment holds ``mark``: the driver's Ray (its head processes and
    workers inherit the driver's environment), and nothing another Ray on this machine
    starts meanwhile (e.g. the package's cluster growing its worker pool)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.add(int(pid))
        except OSError:
            pass
    return found


def test_launch_starts_its_own_ray_and_shuts_it_down_running_a_worker_group(tmp_path):
    log = str(tmp_path / "log.jsonl")
    mark = f"MCORE_RL_TEST_DRIVER={uuid.uuid4().hex}"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, log], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, mark.split("=")[0]: mark.split("=")[1]})
    try:
        line = driver.stdout.readline()  # launch returned; the driver is still alive
        assert json.loads(line) == {"initialized": False, "steps": 3, "sigterm_kept": True}
        deadline = time.monotonic() + 10
        while processes_with(mark) - {driver.pid} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_with(mark) - {driver.pid} == set()
    finally:
        driver.communicate("\n", timeout=30)
    assert driver.returncode == 0
    records = helpers.read(log)
    ranks = sorted((r["rank"], r["cores"]) for r in records if "event" not in r)
    assert [r for r, _ in ranks] == [0, 1]
    if len(os.sched_getaffinity(0)) > 1:
        assert [c for _, c in ranks] == [[0], [1]]
    results = [r["item"] for r in records if r.get("event") == "consume"]
    assert results == [{"x": x, "sum": 3.0 * x, "rank": 0, "world": 2} for x in (1, 2, 3)]
