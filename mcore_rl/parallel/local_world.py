"""A long-lived multi-rank gloo world on this machine, driven from one controlling process.

Starting ranks and importing megatron.core costs seconds per process, so tests (one world
per module), benchmarks and local tools start a world once (``SharedWorld(n)``) and run
functions on all of its ranks with ``world.run(fn, *args)``. ``fn`` must be a module-level
(picklable) function ``fn(rank, world_size, *args)``; it runs with torch.distributed
initialised (gloo) and returns a picklable value per rank.

A rank that raises makes ``run`` raise with that rank's traceback; a rank that does not
answer within the timeout (dead, hung in a collective) tears the world down and fails
the test instead of hanging the suite. After a failure the world is restarted lazily for
the next test, so one broken test does not fail the rest of the module.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

from mcore_rl.parallel.ports import serve_store
from mcore_rl.process_exit import end_after_exit_handlers

DEFAULT_TIMEOUT_S = float(os.environ.get("MCORE_RL_RANK_TIMEOUT", "240"))
ERROR_GRACE_S = 15.0  # how long the other ranks may still answer after one failed
IDLE_COLLECT_S = 1.0  # a rank idle this long after a call collects that call's garbage


def _worker(rank: int, world_size: int, store_env: dict[str, str], conn, env: dict[str, str],
            threads: int) -> None:
    try:  # a process group of its own: killing the rank kills what it started too
        os.setpgid(0, 0)
    except OSError:
        pass
    os.environ.update(env)
    _exit_with_parent()
    os.environ.update(store_env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        collected = True
        while True:
            if not collected and not conn.poll(IDLE_COLLECT_S):
                # What the last call left in reference cycles (a model and the process
                # groups it holds, each with gloo threads that keep waking up) goes while
                # this rank waits, not whenever a later call allocates enough.
                gc.collect()
                collected = True
            msg = conn.recv()
            if msg is None:
                break
            fn, args, kwargs = msg
            collected = False
            try:
                conn.send(("ok", fn(rank, world_size, *args, **kwargs)))
            except BaseException:  # noqa: BLE001 - every failure goes back to the test
                conn.send(("error", traceback.format_exc()))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    end_after_exit_handlers(0)  # closed: without the module teardown `close` would wait for


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this rank when the controlling process is gone (even killed with SIGKILL, or
    while this rank is blocked in a collective): ranks are not daemons, so nothing else
    would stop them."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        _kill_group(os.getpid())
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _kill_group(pid: int) -> None:
    """SIGKILL a rank and every process it started (e.g. the multiprocessing manager
    Megatron's checkpoint saving starts, which would otherwise outlive a killed rank)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            return
    except (ProcessLookupError, PermissionError):
        return
    os.kill(pid, signal.SIGKILL)


class RankFailure(AssertionError):
    """A rank raised (its traceback is in the message) or stopped answering.

    An AssertionError so that pytest shows it as a test failure with the rank's traceback."""


class SharedWorld:
    """``world_size`` spawned ranks with a gloo process group, reused across tests."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 env: dict[str, str] | None = None, threads_per_rank: int = 1):
        self.world_size = world_size
        self.threads_per_rank = threads_per_rank
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self._procs: list = []
        self._conns: list = []
        self._store = None
        """The world's TCPStore, served from this process while the ranks live."""

    def __enter__(self) -> "SharedWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        atexit.register(self.close, kill=True)  # ranks are not daemons: never leave them behind
        ctx = mp.get_context("spawn")
        self._store, store_env = serve_store(self.world_size)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world_size, store_env, child, self.env,
                                                      self.threads_per_rank),
                            daemon=False, name=f"rank{rank}")  # ranks may spawn helpers
            p.start()
            self._procs.append(p)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args, timeout_s: float | None = None,
            **kwargs) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; per-rank results."""
        if not self._procs:
            self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        results: dict[int, Any] = {}
        errors: list[str] = []
        while pending:
            ready = wait(list(pending.values()), max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close(kill=True)
                why = "after another rank failed" if errors else f"within {timeout:.0f}s"
                raise RankFailure(
                    f"rank(s) {sorted(pending)} gave no answer {why} running {fn.__name__} "
                    "(hung collective or dead process); world torn down"
                    + ("\n" + "\n".join(errors) if errors else ""))
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    status, value = pending.pop(rank).recv()
                except EOFError:
                    status, value = "error", "process died"
                if status == "error":
                    errors.append(f"--- rank {rank} ---\n{value}")
                    # Peers may block forever in a collective with the failed rank.
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                results[rank] = value
        if errors:
            # Ranks may now disagree on collective state: restart the world for the next test.
            self.close(kill=True)
            raise RankFailure(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        for conn in self._conns:
            try:
                if not kill:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                _kill_group(p.pid)
                p.join(timeout=5)
        self._procs, self._conns = [], []
        self._store = None
