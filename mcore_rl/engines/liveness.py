"""Engines in processes of their own: no wait on them is unbounded, and none outlives its owner.

- `EngineOutput` takes what the engine's processes print (they inherit it while the engine
  starts) into the run's engine log (or this process's stderr), keeping the last lines
  for the error that reports the engine's death.
- `EngineProcesses` knows the engine's processes and says when one is gone (exited, killed,
  a zombie, stopped), with its exit status where it can be read.
- `EngineCalls` runs each call into the engine on a thread of its own and waits in short
  slices, checking the processes between them: a dead engine ends the wait with
  `EngineDiedError` within about a second, and any call ends after ``timeout_s``.
- `watch_owner` starts a small watcher process that kills the engine's processes (every
  descendant of the owner) as soon as the owner dies, SIGKILL included: the pipe it reads
  from closes with the owner.
"""
from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, TypeVar

T = TypeVar("T")
POLL_S = 0.5
"""How often a wait on the engine checks that its processes live."""


class EngineDiedError(RuntimeError):
    """An engine process is gone, or a call into the engine did not return in time."""


class EngineOutput:
    """The engine's stdout and stderr: written to ``log_file`` (or forwarded to our stderr
    when there is none), the last lines kept."""

    def __init__(self, log_file: str | os.PathLike | None = None, keep: int = 30):
        self.log_file = log_file
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)

    @contextlib.contextmanager
    def captured(self):
        """While the engine starts, its processes inherit a pipe as stdout and stderr."""
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        if self.log_file is not None:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)
            out_fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        else:
            out_fd = os.dup(saved[1])
        thread = threading.Thread(target=self._forward, args=(read_fd, out_fd),
                                  name="engine-output", daemon=True)
        thread.start()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)

    def _forward(self, read_fd: int, out_fd: int) -> None:
        partial = b""
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while True:
                try:
                    chunk = pipe.read(65536)
                except OSError:
                    break
                if not chunk:
                    break
                with contextlib.suppress(OSError):
                    os.write(out_fd, chunk)
                partial += chunk
                *done, partial = partial.split(b"\n")
                self.lines.extend(line.decode(errors="replace").rstrip() for line in done if line.strip())
        os.close(out_fd)

    def where(self) -> str:
        return f" (all of it in {self.log_file})" if self.log_file is not None else ""

    def tail(self) -> str:
        return "\n".join(f"  | {line}" for line in self.lines) or "  | (nothing)"


def _zombie_status(pid: int) -> int | None:
    """The wait status of a process that ended and is not reaped yet (``/proc/PID/stat``,
    field 52), without reaping it; None once it is reaped."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
        fields = stat[stat.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None
    if fields[0] not in ("Z", "X") or len(fields) < 50:
        return None
    return int(fields[49])


def describe_exit(code: int) -> str:
    """An exit status as `subprocess` and `multiprocessing` give it: negative for the signal
    that killed the process."""
    if code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


def untitled_spawn(cmdline: list[str]) -> bool:
    """Whether a command line is still that of a process `multiprocessing` spawned: its
    title (vLLM's ``VLLM::...``) did not take (`mcore_rl.process_title`)."""
    return "from multiprocessing.spawn import" in " ".join(cmdline)


def _label(proc, handle) -> str:
    """How a failure names an engine process: its title (vLLM's ``VLLM::EngineCore``), or
    where the title did not take, the name it was started under."""
    cmdline = proc.cmdline() or [proc.name()]
    if handle is not None and untitled_spawn(cmdline):
        return handle.name
    return cmdline[0]


class EngineProcesses:
    """The processes of one engine, fixed when the engine started: how each is named, and
    where this process started them itself, their `multiprocessing` handles (which know the
    exit code even after the engine's own client reaped the process)."""

    def __init__(self, name: str, pids: set[int]):
        import multiprocessing

        import psutil

        self.name = name
        self.procs, self.labels = {}, {}
        self.handles = {p.pid: p for p in multiprocessing.active_children() if p.pid in pids}
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self.procs[pid] = psutil.Process(pid)
                self.labels[pid] = _label(self.procs[pid], self.handles.get(pid))
        self.exit_codes: dict[int, int] = {}
        """How our children ended, read the moment they did (whoever reaps them later)."""
        self._noted = {pid: threading.Event() for pid in self.handles}
        for pid, handle in self.handles.items():
            threading.Thread(target=self._note_exit, args=(pid, handle), daemon=True,
                             name=f"{name}-exit-{pid}").start()
        self.ended: str | None = None

    def _note_exit(self, pid: int, handle) -> None:
        import multiprocessing.connection

        multiprocessing.connection.wait([handle.sentinel])
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the pipe closes a moment before the exit status exists
            status = _zombie_status(pid)
            if status is not None:
                self.exit_codes[pid] = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                                        else os.WEXITSTATUS(status))
                break
            if handle._popen is not None and handle._popen.returncode is not None:
                self.exit_codes[pid] = handle._popen.returncode  # reaped through the handle
                break
            time.sleep(0.005)
        self._noted[pid].set()

    def problem(self) -> str | None:
        """Which process is gone and how; None while all of them run."""
        if self.ended is not None:
            return self.ended
        for pid, proc in self.procs.items():
            state = self._state(pid, proc)
            if state == "running":
                continue
            if state == "gone" and pid in self._noted:
                self._noted[pid].wait(timeout=3.0)  # our child: its exit status is a moment away
            code = self.exit_codes.get(pid)
            how = ("is stopped" if state == "stopped"
                   else describe_exit(code) if code is not None else "is gone")
            self.ended = f"{self.labels.get(pid, 'an engine process')} (pid {pid}) {how}"
            return self.ended
        return None

    def _state(self, pid: int, proc) -> str:
        """"running", "stopped" or "gone" (exited, killed, a zombie)."""
        import psutil

        if pid in self.exit_codes:
            return "gone"
        try:
            state = proc.status()
        except psutil.Error:
            return "gone"
        if state == psutil.STATUS_STOPPED:
            return "stopped"
        return "gone" if state in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else "running"


class EngineCalls:
    """One daemon thread that every call into an engine runs on, and the waits on it. A call
    stuck in a dead engine is left behind on that thread, which never holds up the exit."""

    def __init__(self, processes: EngineProcesses, output: EngineOutput, timeout_s: float):
        self.processes = processes
        self.output = output
        self.timeout_s = timeout_s
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=f"{processes.name}-calls",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    future.set_exception(err)

    def run(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on the engine's thread; `EngineDiedError` as soon as an
        engine process is gone, or after ``timeout_s``."""
        self.raise_if_dead(what)
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        start = time.monotonic()
        while True:
            try:
                return future.result(timeout=POLL_S)
            except FutureTimeout:
                pass
            except Exception:
                self.raise_if_dead(what)  # an error caused by the death: report the death
                raise
            self.raise_if_dead(what)
            if time.monotonic() - start > self.timeout_s:
                raise EngineDiedError(
                    f"the {self.processes.name} engine did not answer {what} within "
                    f"{self.timeout_s:g} s (rollout.engine_timeout_s); its last output"
                    f"{self.output.where()}:\n{self.output.tail()}")

    def raise_if_dead(self, what: str) -> None:
        """`EngineDiedError` naming the process that is gone, how, and the engine's last output."""
        problem = self.processes.problem()
        if problem is not None:
            raise EngineDiedError(f"the {self.processes.name} engine died during {what}: {problem}; "
                                  f"its last output{self.output.where()}:\n{self.output.tail()}")

    def close(self) -> None:
        self._calls.put(None)


_WATCHER: subprocess.Popen | None = None


def watch_owner() -> None:
    """Start (once per process) the watcher that kills this process's descendants when this
    process dies: it reads a pipe only this process writes to, which closes with it."""
    global _WATCHER
    if _WATCHER is not None and _WATCHER.poll() is None:
        return
    # Run as a file, not as a module of this package, whose import would load torch:
    # seconds of CPU per watcher, for a loop over psutil (-P, from Python 3.11: the file's
    # folder kept off the module path).
    from mcore_rl.engines import owner_watch

    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    _WATCHER = subprocess.Popen(
        [sys.executable, *safe_path, owner_watch.__file__, str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
