"""A process of the run killed on Ray ends ``mcore-rl train`` with exit 1, one last line
naming the process, its role and instance and the cause, no traceback and none of Ray's
death notices on the console, the details in the file the line names, and no process of
the run left (Ray's agents included); a SIGKILLed driver leaves none either.

Each case is one quick-start run (the in-process ``hf`` engine, no warm start) with a Ray of
its own: the test kills its target once step 1 is logged. The deadlines come from the
timeouts involved (`launch.KILL_WAIT_S`, `ray_head.HEAD_POLL_S`, the driver's watcher's)
plus a margin for a busy machine, not from fixed seconds.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mcore_rl.engines import owner_watch
from mcore_rl.flow import ray_head
from tests.rl.test_resume_after_kill import wait_for_step

flow_launch = importlib.import_module("mcore_rl.flow.launch")  # the module, not `launch`
REPO = Path(__file__).resolve().parents[2]
RUN = ["rollout.engine=hf", "train.warm_start_steps=0", "train.steps=500", "train.val_every=0",
       "checkpoint.save_every=0", "logging.backends=[jsonl]", "logging.samples_every=0",
       "reshard.verify=false"]
OVERLAP = ["train.schedule=one_step_off", "train.max_staleness=1"]  # the reward has a process
MARGIN_S = 15.0
EXIT_WITHIN_S = flow_launch.KILL_WAIT_S + flow_launch.POLL_S + ray_head.HEAD_POLL_S + MARGIN_S
GONE_WITHIN_S = owner_watch.LIST_EVERY_S + owner_watch.KILL_WAIT_S + MARGIN_S
START_WITHIN_S = 240.0


def start_run(log_dir: Path, extra: list[str]) -> subprocess.Popen:
    """``mcore-rl train`` of the quick start, console (stdout and stderr) into one file."""
    console = open(log_dir.parent / f"{log_dir.name}.console", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/quickstart.yaml", *RUN,
         *extra, f"logging.dir={log_dir}"],
        stdout=console, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def wait_for_step_1(proc: subprocess.Popen, log_dir: Path) -> dict:
    """Once step 1 is logged: the run's `processes.json`."""
    wait_for_step(log_dir, 1, proc, timeout_s=START_WITHIN_S)
    return json.loads((log_dir / "processes.json").read_text())


def console(log_dir: Path) -> str:
    return (log_dir.parent / f"{log_dir.name}.console").read_text()


def run_tree(pid: int) -> list[psutil.Process]:
    """The driver and every process it started (Ray's own included)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def ray_process(tree: list[psutil.Process], executable: str) -> int:
    """The pid of the Ray head process whose executable is named ``executable``."""
    for proc in tree:
        try:
            if Path(proc.cmdline()[0]).name == executable:
                return proc.pid
        except (psutil.Error, IndexError):
            pass
    raise AssertionError(f"no {executable} among the run's processes")


def wait_gone(tree: list[psutil.Process], within_s: float) -> list[str]:
    """The processes of ``tree`` still running after ``within_s`` (name and pid)."""
    deadline = time.monotonic() + within_s
    while True:
        left = []
        for proc in tree:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.name()} ({proc.pid})")
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


CASES = {  # case: (extra overrides, how to find the target, what the last line names)
    "trainer rank": ([], ("trainer#0", 1), "controller 'trainer' #0 failed while running: "
                                           "rank 0 of controller 'trainer' #0 (pid {pid}) died"),
    "reward controller": (OVERLAP, ("reward#0", 0), "controller 'reward' #0 failed while "
                                                    "running: its process (pid {pid}) died"),
    "stream hub": ([], ("hub", 0), "failed while running: the stream hub (pid {pid}) died"),
    "GCS server": ([], "gcs_server", "Ray's GCS server (pid {pid}) killed by signal 9 (SIGKILL)"),
    "raylet": ([], "raylet", "Ray's raylet (pid {pid}) killed by signal 9 (SIGKILL)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_process_ends_the_run_in_one_line_and_leaves_nothing(tmp_path, case):
    extra, target, names = CASES[case]
    log_dir = tmp_path / "run"
    proc = start_run(log_dir, extra)
    try:
        processes = wait_for_step_1(proc, log_dir)
        tree = run_tree(proc.pid)
        if isinstance(target, tuple):
            role, k = target
            victim = processes["processes"][role][k]
        else:
            victim = ray_process(tree, target)
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        code = proc.wait(timeout=EXIT_WITHIN_S)
        took = time.monotonic() - start
        left = wait_gone(tree, GONE_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left, after the check
        except ProcessLookupError:
            pass
    out = console(log_dir)
    last = out.rstrip("\n").splitlines()[-1]
    assert code == 1, out[-3000:]
    assert last.startswith("mcore-rl train: error: "), out[-3000:]
    assert names.format(pid=victim) in last, last
    details = log_dir / "error.log"
    assert last.endswith(f"; details: {details}"), last
    assert details.read_text().strip(), "the details file is empty"
    assert "Traceback" not in out, out[-3000:]
    assert not any(notice in out for notice in ray_head.DEATH_NOTICES), out[-3000:]
    assert left == [], f"{left} outlived the run by {GONE_WITHIN_S:.0f} s (exit after {took:.1f} s)"


def test_a_sigkilled_driver_leaves_no_process_of_its_run(tmp_path):
    log_dir = tmp_path / "run"
    proc = start_run(log_dir, [])
    try:
        wait_for_step_1(proc, log_dir)
        tree = run_tree(proc.pid)
        assert any("DashboardAgent" in " ".join(p.cmdline()) for p in tree[1:]), \
            "Ray's agents are not among the run's processes"
        proc.kill()
        proc.wait()
        left = wait_gone(tree[1:], GONE_WITHIN_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], f"{left} outlived the SIGKILLed driver by {GONE_WITHIN_S:.0f} s"
