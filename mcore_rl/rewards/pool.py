"""`WorkerPool`: processes that run synchronous reward calls in parallel, one task at a
time each, with a deadline per task.

Unlike `concurrent.futures.ProcessPoolExecutor` (where one dead worker breaks every pending
future), a worker that dies (SIGKILL, the OOM killer) or runs past its task's deadline
(it is killed) costs only its own task: its outcome is ``died`` or ``overtime``, the worker
is replaced, and the other tasks go on. Workers are fresh interpreters
(`mcore_rl.rewards.pool_worker`), started once and reused until `close`.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import weakref
from collections import deque
from multiprocessing import Pipe
from multiprocessing.connection import wait
from typing import Callable, Sequence

from mcore_rl.rewards.outcome import Outcome
from mcore_rl.rewards.registry import first_line

Task = tuple[Callable, tuple, int | None]
"""(function, its arguments, the batch size of a batched call or None)."""


def _worker_env() -> dict[str, str]:
    """The parent's environment, with its import path (user reward modules import alike)."""
    paths = [p or os.getcwd() for p in sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


class _Worker:
    """One worker process and the parent's end of its connection."""

    def __init__(self, env: dict[str, str]):
        self.conn, child = Pipe(duplex=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mcore_rl.rewards.pool_worker", str(child.fileno())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env)
        child.close()

    def kill(self) -> None:
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _close_all(workers: list[_Worker], grace_s: float = 1.0) -> None:
    """Close the connections (an idle worker exits); kill what is still running after
    ``grace_s``."""
    for w in workers:
        w.conn.close()
    end = time.monotonic() + grace_s
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


class WorkerPool:
    """``size`` reward worker processes (see the module docstring)."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a worker pool needs at least one process, got {size}")
        self._env = _worker_env()
        self.workers = [_Worker(self._env) for _ in range(size)]
        self._finalizer = weakref.finalize(self, _close_all, self.workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._env)
        self.workers[self.workers.index(worker)] = fresh
        return fresh

    def run(self, tasks: Sequence[Task], timeouts: Sequence[float],
            stop: Callable[[int, Outcome], bool] | None = None) -> list[Outcome | None]:
        """Each task's `Outcome`, in order; ``timeouts[i]``: task i's time limit (0: none).

        ``stop(i, outcome)`` sees each outcome as it comes; once it answers True nothing
        more is sent, the tasks in flight are abandoned (their workers replaced), and those
        never finished are None."""
        if not self._finalizer.alive:
            raise RuntimeError("the reward worker pool is closed")
        stop = stop or (lambda i, outcome: False)
        outcomes: list[Outcome | None] = [None] * len(tasks)
        todo, idle = deque(range(len(tasks))), list(self.workers)
        busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (task, deadline)
        stopped = False
        while busy or (todo and not stopped):
            while todo and idle and not stopped:
                i = todo.popleft()
                try:
                    message = pickle.dumps(tasks[i])
                except Exception as err:  # noqa: BLE001 - e.g. a lambda, or meta with a lock
                    outcomes[i] = Outcome("raised", message="cannot be sent to a reward worker "
                                          f"process with its arguments ({type(err).__name__}: "
                                          f"{first_line(err)})")
                    stopped = stop(i, outcomes[i])
                    continue
                worker = idle.pop()
                try:
                    worker.conn.send_bytes(message)
                except OSError:  # it died while idle: send to a fresh one
                    worker = self._replace(worker)
                    worker.conn.send_bytes(message)
                busy[worker] = (i, time.monotonic() + timeouts[i] if timeouts[i] else float("inf"))
            if not busy:
                break
            deadline = min(d for _, d in busy.values())
            wait_s = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
            ready = set(wait([w.conn for w in busy], wait_s))
            for worker in [w for w in busy if w.conn in ready]:
                i, _ = busy.pop(worker)
                try:
                    outcomes[i] = worker.conn.recv()
                except (EOFError, OSError):
                    outcomes[i] = Outcome("died", message=self._death(worker))
                    worker = self._replace(worker)
                idle.append(worker)
                stopped = stopped or stop(i, outcomes[i])
            now = time.monotonic()
            for worker, (i, deadline) in list(busy.items()):
                if stopped or deadline <= now:
                    del busy[worker]
                    if not stopped:
                        outcomes[i] = Outcome("overtime", message=f"took longer than "
                                              f"{timeouts[i]:g} s (reward.timeout_s per sample)")
                        stopped = stop(i, outcomes[i])
                    idle.append(self._replace(worker))
        return outcomes

    @staticmethod
    def _death(worker: _Worker) -> str:
        try:
            code = worker.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "lost its worker process (it closed the connection)"
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return f"lost its worker process ({how})"

    def close(self) -> None:
        """Stop the workers (idle ones exit; busy ones are killed after a second)."""
        self._finalizer()
