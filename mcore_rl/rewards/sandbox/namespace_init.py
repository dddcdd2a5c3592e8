"""One sandboxed run of a program in Linux namespaces: the process tree that
`mcore_rl.rewards.sandbox.namespaces` starts as ``python -I -S namespace_init.py FD`` with an
allow-listed environment and no open file descriptors but pipes to its parent: 0-2 and FD.

1. **This process** sets a parent-death signal, unshares user, mount, PID, network, IPC and
   UTS namespaces, writes ``R`` on stdout and reads the job (JSON) from stdin, which its
   parent sends once it has written this process's uid and gid maps
   (`namespaces.write_id_maps`). It forks the init of the new PID namespace, writes the
   init's pid on FD (at the time limit the parent kills the init, which takes the whole
   namespace down, and this process still reaps it) and waits for it.
2. **The init** (PID 1) forbids user namespaces inside this one, builds the file system the
   program sees and pivots into it (`root_view`), makes itself non-dumpable (the program
   cannot read its memory, fds or environment) and forks the program's process.
3. **The program's process** gets stdin, stdout and stderr as memfds at fds 0-2 and the
   write end of a results pipe at fd 3 (what is written there can be added to, not
   rewritten), becomes uid/gid 65534 with no capabilities (the bounding set emptied too) and
   no_new_privs, sets its rlimits (address space, CPU time, file size, processes, no core
   dumps), installs a seccomp filter (`syscall_filter`), tells the init its setup worked,
   closes every other descriptor and runs `harness` in-process.
4. The init reads the results pipe while the program runs, reaps it, kills and reaps
   whatever it left running (so that nothing writes after it ended), writes one JSON
   report on stdout (``exit``: status or -signal, ``stdout``: its first `STDOUT_BYTES`,
   ``stdout_bytes``: its size, ``stderr``: its tail, ``results``: the code tests' 1/0, the
   values of ``values`` mode, or null) and exits.

A setup failure ends with exit status `SETUP_FAILED` and one line on stderr. Standard
library only.
"""
import json
import os
import resource
import select
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I -S: siblings by path
import harness  # noqa: E402
import root_view  # noqa: E402
import syscall_filter  # noqa: E402
import syscalls as sc  # noqa: E402

del sys.path[0]  # the program's module path is the standard library's alone

SANDBOX_ID = 65534
"""The uid and gid the program runs as inside its user namespace (nobody/nogroup)."""
SETUP_FAILED = 70
NAMESPACES = (sc.CLONE_NEWUSER | sc.CLONE_NEWNS | sc.CLONE_NEWPID | sc.CLONE_NEWNET
              | sc.CLONE_NEWIPC | sc.CLONE_NEWUTS)
STDERR_TAIL = 2000
USER_NAMESPACE_LIMIT = "/proc/sys/user/max_user_namespaces"
STDOUT_BYTES = 4 << 20
"""The most of the program's output reported (its parent reads and parses the report: a
program that prints more fails its run instead of filling the trainer's memory)."""
RESULTS_BYTES = 1 << 20
"""The most of the results file read (a larger one is not the harness's: tampered)."""
_UNSHARE_HINTS = {1: "user namespaces are not permitted to this user",
                  28: "the user.max_user_namespaces limit is reached or 0",
                  22: "this kernel lacks one of the namespaces"}


def describe(err: OSError) -> str:
    """``what: reason`` (`syscalls` puts the call in strerror), with no errno prefix."""
    return err.strerror if err.filename is None and err.strerror else str(err)


def fail(message: str) -> None:
    print(f"sandbox: {message}", file=sys.stderr, flush=True)
    os._exit(SETUP_FAILED)


def drop_privileges() -> None:
    """Become `SANDBOX_ID` with no capabilities and no way to gain any."""
    sc.drop_bounding_set()
    if os.getuid() != SANDBOX_ID:  # the ids 0 and SANDBOX_ID are mapped (a root parent)
        os.setgroups([])
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
    sc.clear_capabilities()
    sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)


def set_limits(job: dict) -> None:
    for limit, value in ((resource.RLIMIT_AS, job["memory_bytes"]),
                         (resource.RLIMIT_CPU, job["cpu_s"]),
                         (resource.RLIMIT_FSIZE, job["file_bytes"]),
                         (resource.RLIMIT_NPROC, job["processes"]),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value + 1 if limit == resource.RLIMIT_CPU else value))


def run_program(job: dict, fds: tuple[int, int, int, int], nonce: str, setup_fd: int) -> None:
    """The program's process (never returns). Whether its setup worked goes to the init on
    ``setup_fd``, closed before the program runs (so the program cannot speak for it)."""
    status = 1
    try:
        try:
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            drop_privileges()
            set_limits(job)
            syscall_filter.install()
        except (OSError, ValueError) as err:
            os.write(setup_fd, (describe(err) if isinstance(err, OSError) else str(err)).encode())
            os._exit(SETUP_FAILED)
        os.write(setup_fd, b"ok")
        os.closerange(len(fds), 1 << 20)  # setup_fd too
        status = harness.run(job["program"], job["mode"], job["tests"], 3, nonce)
    finally:
        os._exit(status)


def _tail(fd: int, limit: int) -> bytes:
    """The last ``limit`` bytes of the file ``fd``."""
    size = os.lseek(fd, 0, os.SEEK_END)
    start = max(0, size - limit)
    return os.pread(fd, size - start, start)


def _results(raw: bytes, nonce: str, count: int, mode: str) -> list | None:
    """The harness's results, if that is all the file holds (anything else: tampered):
    1/0 per test (``tests`` mode), a literal or null per expression (``values`` mode)."""
    head, _, body = raw.decode("utf-8", "replace").partition(" ")
    try:
        results = json.loads(body) if head == nonce else None
    except ValueError:
        return None
    if not isinstance(results, list) or len(results) != count:
        return None
    if mode == "values":
        ok = all(r is None or isinstance(r, str) for r in results)
    else:
        ok = all(type(r) is int and r in (0, 1) for r in results)
    return results if ok else None


def end_the_rest() -> None:
    """Kill every other process of the PID namespace (what the program started and left
    running) and reap them all."""
    try:
        os.kill(-1, signal.SIGKILL)  # from its init: every process of the namespace but it
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def no_nested_user_namespaces() -> None:
    """No user namespace can be made inside this one (its limit, which is this namespace's
    own, is 0): the program cannot gain capabilities in a namespace of its own, from which
    more of the kernel (mounts, netfilter, ...) would be reachable."""
    try:
        with open(USER_NAMESPACE_LIMIT, "w") as f:
            f.write("0")
    except OSError as err:
        raise OSError(err.errno, f"cannot set {USER_NAMESPACE_LIMIT} to 0 in the sandbox's user "
                                 f"namespace: {err.strerror}") from None


def collect(child: int, results_r: int) -> tuple[int, bytes]:
    """The program's process's wait status and what was written to the results pipe (its
    first `RESULTS_BYTES` and one more), read while it runs; once it has ended, whatever
    it left running is killed (`end_the_rest`), which closes the pipe's last write ends."""
    data = bytearray()

    def take(chunk: bytes) -> None:
        data.extend(chunk[:max(0, RESULTS_BYTES + 1 - len(data))])

    pidfd = os.pidfd_open(child)
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    poll.register(results_r, select.POLLIN)
    ended = False
    while not ended:
        for fd, _ in poll.poll():
            if fd == pidfd:
                ended = True
            else:
                chunk = os.read(results_r, 1 << 16)
                take(chunk)
                if not chunk:
                    poll.unregister(results_r)
    _, status = os.waitpid(child, 0)
    end_the_rest()
    while chunk := os.read(results_r, 1 << 16):
        take(chunk)
    return status, bytes(data)


def init(job: dict) -> None:
    """PID 1 of the sandbox (never returns)."""
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # an init ignores what it does not handle
    try:
        no_nested_user_namespaces()
        root_view.build_and_enter({"solution.py": job["program"]}, job["workdir_mb"], SANDBOX_ID)
        results_r, results_w = os.pipe()  # the program may append to it, never rewrite it
        fds = (*(os.memfd_create(name) for name in ("stdin", "stdout", "stderr")), results_w)
        os.write(fds[0], job["stdin"].encode())
        os.lseek(fds[0], 0, os.SEEK_SET)
        nonce = os.urandom(16).hex()
        sc.prctl(sc.PR_SET_DUMPABLE, 0)
        setup_r, setup_w = os.pipe()
        child = os.fork()
    except OSError as err:
        fail(describe(err))
    if child == 0:
        run_program(job, fds, nonce, setup_w)
    os.close(setup_w)
    os.close(results_w)
    with os.fdopen(setup_r, "rb") as f:
        setup = f.read().decode("utf-8", "replace")
    status, results = collect(child, results_r)
    if setup != "ok":
        fail(f"the program's process could not be set up: {setup or 'it died'}")
    report = {"exit": os.waitstatus_to_exitcode(status),
              "stdout": os.pread(fds[1], STDOUT_BYTES, 0).decode("utf-8", "replace"),
              "stdout_bytes": os.lseek(fds[1], 0, os.SEEK_END),
              "stderr": _tail(fds[2], STDERR_TAIL).decode("utf-8", "replace"),
              "results": _results(results, nonce, len(job["tests"]), job["mode"])}
    sys.stdout.write(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)  # a killed reward worker takes it along
    try:
        sc.unshare(NAMESPACES)
    except OSError as err:
        hint = _UNSHARE_HINTS.get(err.errno)
        fail(describe(err) + (f" ({hint})" if hint else ""))
    sys.stdout.write("R")
    sys.stdout.flush()
    job = json.load(sys.stdin)
    with open("/proc/self/uid_map") as f:
        if not f.read().strip():
            fail("the user namespace got no uid map")
    init_pid_fd = int(sys.argv[1])
    pid = os.fork()
    if pid == 0:
        os.close(init_pid_fd)
        init(job)
    os.write(init_pid_fd, f"{pid}\n".encode())
    os.close(init_pid_fd)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
