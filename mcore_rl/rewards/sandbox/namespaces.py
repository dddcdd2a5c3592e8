"""`NamespaceSandbox`: runs a program on this machine in Linux user, mount, PID, network,
IPC and UTS namespaces (the process tree of `namespace_init`, see there for what the
program sees and may do).

This side starts ``python -I -S namespace_init.py FD`` (an allow-listed environment, no
file descriptors but its pipes, its own session), writes its uid/gid maps once it has
unshared, sends the job on its stdin and reads one JSON report from its stdout; past the
time limit it kills the init of the PID namespace (whose pid the helper writes on FD), and
with it everything in the namespace.

Id maps: a parent running as root maps ids 0 and 65534 to themselves, so the program runs
as the host's nobody (its processes count against RLIMIT_NPROC, which root's do not); any
other parent maps 65534 to its own uid and gid, the only ids an unprivileged process may
map. Either way the program is not root and has no capabilities.
"""
from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mcore_rl.rewards.sandbox.protocol import Run, RunResult, SandboxError, SandboxLimits

INIT = Path(__file__).with_name("namespace_init.py")
SANDBOX_ID = 65534  # as in namespace_init, which imports nothing of this package
SETUP_FAILED = 70  # namespace_init's exit status when it cannot set the sandbox up
STDOUT_BYTES = 4 << 20  # the most of a program's output namespace_init reports
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp",
       "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment of the sandbox: nothing of the trainer's."""
WORKDIR_MB = 64
"""Size of the program's writable /tmp (a tmpfs), and the largest file it may write."""
MAX_PROCESSES = 64
"""RLIMIT_NPROC of the program: its processes and threads, in its own user namespace."""


def write_id_maps(pid: int) -> None:
    """The uid/gid maps of ``pid``'s new user namespace (see the module docstring)."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        maps = {"uid_map": f"0 0 1\n{SANDBOX_ID} {SANDBOX_ID} 1\n",
                "gid_map": f"0 0 1\n{SANDBOX_ID} {SANDBOX_ID} 1\n"}
    else:
        Path(f"/proc/{pid}/setgroups").write_text("deny")  # before an unprivileged gid_map
        maps = {"uid_map": f"{SANDBOX_ID} {uid} 1\n", "gid_map": f"{SANDBOX_ID} {gid} 1\n"}
    for name, text in maps.items():
        Path(f"/proc/{pid}/{name}").write_text(text)


def _job(run: Run, limits: SandboxLimits) -> bytes:
    return json.dumps({"program": run.program, "mode": run.mode, "tests": list(run.tests),
                       "stdin": run.stdin, "memory_bytes": limits.memory_mb << 20,
                       "cpu_s": math.ceil(limits.time_limit_s) + 1, "file_bytes": WORKDIR_MB << 20,
                       "processes": MAX_PROCESSES, "workdir_mb": WORKDIR_MB}).encode()


def _readable(fd: int, timeout_s: float) -> bool:
    poll = select.poll()  # not select(): a trainer may hold more than 1024 descriptors
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(max(0.0, timeout_s) * 1e3))


def _wait_ready(proc: subprocess.Popen, deadline: float) -> bool:
    """Whether the helper unshared (it writes one byte) before ``deadline``."""
    if not _readable(proc.stdout.fileno(), deadline - time.monotonic()):
        raise subprocess.TimeoutExpired(proc.args, 0)
    return os.read(proc.stdout.fileno(), 1) == b"R"


def _result(code: int, out: bytes, err: bytes, mode: str) -> RunResult:
    try:
        report = json.loads(out) if out else None
    except ValueError:
        report = None
    if report is None:
        line = (err.decode("utf-8", "replace").strip().splitlines() or [""])[-1][:300]
        if code == SETUP_FAILED and line.startswith("sandbox: "):
            raise SandboxError(line.removeprefix("sandbox: "))
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return RunResult("failure", message=f"the sandbox ended with {how} and no report: {line}")
    exit_code = report["exit"]
    if report["stdout_bytes"] > len(report["stdout"].encode()):
        return RunResult("failure", message=f"the program printed {report['stdout_bytes']} "
                                            f"bytes, more than the {STDOUT_BYTES} reported")
    if exit_code != 0:
        how = f"signal {-exit_code}" if exit_code < 0 else f"exit status {exit_code}"
        last = (report["stderr"].strip().splitlines() or [""])[-1][:200]
        return RunResult("failure", report["stdout"],
                         message=f"the program ended with {how}" + (f": {last}" if last else ""))
    results = report["results"]
    if mode in ("tests", "values") and results is None:
        return RunResult("failure", report["stdout"],
                         message="the program ended before reporting its tests' results")
    return RunResult("ok", report["stdout"], None if results is None else tuple(results))


def _init_pid(fd: int) -> int | None:
    """The host pid of the namespace's init, if the helper has told it yet."""
    if not _readable(fd, 0.0):
        return None
    line = os.read(fd, 32)
    return int(line) if line.strip().isdigit() else None


def _stop(proc: subprocess.Popen, init_pid_fd: int) -> None:
    """End the helper and everything it started, and reap it. Killing the namespace's init
    takes every process of the namespace down with it, and leaves the helper (its parent)
    to reap it rather than whatever adopts orphans; the helper's whole session is killed
    only where that is not done in time."""
    if proc.poll() is None:
        init_pid = _init_pid(init_pid_fd)
        if init_pid is not None:
            os.kill(init_pid, signal.SIGKILL)  # not reaped: its parent is alive and waits for it
        try:
            proc.wait(timeout=2.0 if init_pid else 0.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet: the group is still its own
    proc.wait()


@dataclass(frozen=True)
class NamespaceSandbox:
    """Runs programs here, in namespaces (see the module docstring)."""

    limits: SandboxLimits = SandboxLimits()

    def run(self, run: Run) -> RunResult:
        """One run; `SandboxError` if the sandbox itself cannot be set up."""
        deadline = time.monotonic() + self.limits.time_limit_s
        init_pid_r, init_pid_w = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(INIT), str(init_pid_w)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=ENV, cwd="/",
                                    pass_fds=(init_pid_w,), start_new_session=True)
        finally:
            os.close(init_pid_w)
        try:
            if _wait_ready(proc, deadline):
                write_id_maps(proc.pid)
                out, err = proc.communicate(_job(run, self.limits),
                                            timeout=max(0.0, deadline - time.monotonic()))
            else:  # it failed before unsharing: collect its reason
                out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return RunResult("timeout",
                             message=f"the program ran past {self.limits.time_limit_s:g} s")
        except OSError as err:
            raise SandboxError(f"cannot give the sandbox its user ids ({err})") from None
        finally:
            _stop(proc, init_pid_r)
            os.close(init_pid_r)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        return _result(proc.returncode, out, err, run.mode)

    def check(self) -> None:
        """Raise `SandboxError` (its reason) unless a program can run here."""
        done = NamespaceSandbox(SandboxLimits(30.0, 256)).run(Run("print('ok')", "main"))
        if done.status != "ok" or done.stdout != "ok\n":
            raise SandboxError(done.message or f"a test program printed {done.stdout!r:.60}")
