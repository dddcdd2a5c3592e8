"""The shared local world: a failing or hung rank fails the test quickly instead of hanging."""
import time

import pytest

from tests.lingering import linger
from tests.world import RankFailure, SharedWorld


def _sum_of_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises_while_rank0_waits_in_a_collective(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone


def test_failing_rank_reports_its_traceback_and_the_world_restarts():
    with SharedWorld(2) as world:
        assert world.run(_sum_of_ranks) == [1.0, 1.0]
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="boom on rank 1"):
            world.run(_rank1_raises_while_rank0_waits_in_a_collective, timeout_s=120)
        assert time.monotonic() - t0 < 60, "a hung peer must not cost the full timeout"
        assert world.run(_sum_of_ranks) == [1.0, 1.0]  # a fresh world for the next test


def _pid(rank, world_size):
    import os

    return os.getpid()


def _block(rank, world_size):
    """Rank 0 waits in a collective that rank 1 (asleep) never joins."""
    import time

    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


CONTROLLER = """
from mcore_rl.parallel.local_world import SharedWorld
from tests.parallel.test_local_world import _block, _pid
world = SharedWorld(2)
print(" ".join(map(str, world.run(_pid))), flush=True)
world.run(_block)
"""


def test_ranks_blocked_in_a_collective_exit_when_the_controlling_process_is_killed():
    import os
    import signal
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True,
                            cwd=repo)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(1)  # both ranks are now inside _block
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert not alive, f"ranks {alive} outlived their controller"


_HELPERS = []


def _start_a_helper_process(rank, world_size):
    """A process a rank starts and keeps (a multiprocessing manager)."""
    import multiprocessing as mp

    manager = mp.get_context("spawn").Manager()
    _HELPERS.append(manager)
    return manager._process.pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_torn_down_world_takes_the_processes_its_ranks_started_with_it():
    with SharedWorld(2, timeout_s=60) as world:
        helpers = world.run(_start_a_helper_process)
        assert all(_alive(pid) for pid in helpers)
        with pytest.raises(RankFailure):
            world.run(_rank1_raises_while_rank0_waits_in_a_collective)  # ranks killed
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in helpers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in helpers), "a killed rank left its helper behind"


class _Cycle:
    def __init__(self):
        self.me = self


_LEFT: list = []  # in each rank: a weak reference to what the last call left in a cycle


def _leave_a_cycle(rank, world_size):
    import gc
    import weakref

    gc.disable()  # no collection while the call runs: only the rank's idle one may free it
    try:
        _LEFT[:] = [weakref.ref(_Cycle())]
    finally:
        gc.enable()


def _cycle_freed(rank, world_size):
    return _LEFT[0]() is None


def test_an_idle_rank_collects_the_reference_cycles_its_last_call_left():
    """A model holds its process groups in cycles, and each gloo group has threads that keep
    waking up: an idle rank must not keep them until a later call allocates enough."""
    from mcore_rl.parallel.local_world import IDLE_COLLECT_S

    with SharedWorld(2) as world:
        world.run(_leave_a_cycle)
        time.sleep(IDLE_COLLECT_S + 1.0)  # the ranks wait idle
        assert world.run(_cycle_freed) == [True, True]


def _linger_at_exit(rank, world_size, log):
    import atexit

    def note():
        with open(log, "a") as f:
            f.write(f"atexit {rank}\n")

    atexit.register(note)
    linger(log, "module_teardown\n")


def test_closing_runs_the_ranks_exit_handlers_without_waiting_for_their_module_teardown(tmp_path):
    log = tmp_path / "exit.log"
    world = SharedWorld(2)
    world.run(_linger_at_exit, str(log))
    start = time.monotonic()
    world.close()
    assert time.monotonic() - start < 10  # the rank's 30 s teardown did not run (nor a kill)
    assert sorted(log.read_text().splitlines()) == ["atexit 0", "atexit 1"]
