"""The ``code`` reward's namespace sandbox against hostile programs: each scores 0 and
leaves no trace on the host, where the same attempt without the sandbox (`Unsandboxed`,
run first where it is safe) succeeds; a correct program still scores 1."""
import errno
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcore_rl.rewards import RewardFailure
from mcore_rl.rewards.code_execution import code_reward
from mcore_rl.rewards.sandbox import NamespaceSandbox, Run, SandboxLimits, build_sandbox
from mcore_rl.rewards.sandbox.namespaces import ENV, INIT, MAX_PROCESSES, SANDBOX_ID, WORKDIR_MB
from tests.rewards.unsandboxed import Unsandboxed

WRONG_ADD = "def add(a, b):\n    return a - b\n"
RIGHT_ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]


def program(text: str, **values) -> str:
    """``text`` dedented, after one ``NAME = repr(value)`` line per value."""
    return "".join(f"{k} = {v!r}\n" for k, v in values.items()) + textwrap.dedent(text)


def score(sandbox, source: str, tests: list) -> float:
    """The reward of ``source``; a run that fails or times out scores 0."""
    try:
        return code_reward("", source, {"tests": tests}, sandbox=sandbox)
    except RewardFailure:
        return 0.0


def sandbox_sources() -> dict[Path, str]:
    """The sandbox's own files (harness, init) and their hashes."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in INIT.parent.glob("*.py")}


def sandbox_processes() -> list[str]:
    """Host pids of sandbox processes still alive (not zombies), after a short grace."""
    for _ in range(20):
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(INIT).encode() in cmdline and state != "Z":
                alive.append(pid)
        if not alive:
            return []
        time.sleep(0.05)
    return alive


@pytest.fixture(scope="module")
def sandbox():
    return build_sandbox("namespaces", limits=SandboxLimits(5.0, 256))


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """What a trainer's machine holds: secrets, a checkpoint, listening sockets, a process."""
    root = tmp_path_factory.mktemp("trainer")
    h = SimpleNamespace(root=root, netrc=root / ".netrc", ckpt=root / "checkpoints" / "model.pt",
                        netrc_secret=secrets.token_hex(8), ckpt_secret=secrets.token_hex(8))
    h.netrc.write_text(f"machine hub login me password {h.netrc_secret}\n")
    h.ckpt.parent.mkdir()
    h.ckpt.write_text(h.ckpt_secret)
    h.tcp = socket.create_server(("127.0.0.1", 0))
    h.unix_path = str(root / "ray.sock")
    h.unix = socket.socket(socket.AF_UNIX)
    h.unix.bind(h.unix_path)
    h.abstract_name = f"\0mcore-rl-test-{secrets.token_hex(4)}"
    h.abstract = socket.socket(socket.AF_UNIX)
    h.abstract.bind(h.abstract_name)
    for s in (h.tcp, h.unix, h.abstract):
        s.listen()
        s.setblocking(False)
    h.sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield h
    h.sleeper.kill()
    h.sleeper.wait()
    for s in (h.tcp, h.unix, h.abstract):
        s.close()


def pending_connections(listener: socket.socket) -> int:
    count = 0
    while True:
        try:
            listener.accept()[0].close()
            count += 1
        except BlockingIOError:
            return count


def test_a_correct_program_scores_one(sandbox):
    io = [{"input": "2 3\n", "output": "5"}, {"input": "7 -7\n", "output": "0"}]
    assert score(sandbox, RIGHT_ADD, ADD_TESTS) == 1.0
    assert score(sandbox, "a, b = map(int, input().split())\nprint(a + b)", io) == 1.0


READ = """
import os
def loot():
    found = [repr(dict(os.environ))]
    for path in PATHS + ["/proc/1/environ", f"/proc/{os.getppid()}/environ", "/proc/self/environ"]:
        try:
            found.append(open(path, "rb").read().decode("latin-1"))
        except OSError:
            pass
    return "\\n".join(found)
"""


def test_the_program_reads_no_secret_file_or_environment_of_the_host(sandbox, host, monkeypatch):
    env_secret = secrets.token_hex(8)
    monkeypatch.setenv("HF_TOKEN", env_secret)  # the trainer's environment
    paths = [str(host.netrc), str(host.ckpt), f"/proc/{os.getpid()}/environ"]
    source = program(READ, PATHS=paths)
    tests = [f"assert {s!r} in loot()" for s in (host.netrc_secret, host.ckpt_secret, env_secret)]
    assert score(Unsandboxed(), source, tests) == 1.0
    assert score(sandbox, source, tests) == 0.0


WRITE = """
import os, shutil
def attempt(action, path):
    try:
        if action == "write":
            with open(path, "w") as f:
                f.write("pwned")
        elif action == "delete":
            os.remove(path)
        else:
            shutil.rmtree(path)
        return True
    except OSError:
        return False
"""


def _write_targets(root: Path) -> tuple[list[tuple[str, str]], dict[Path, str]]:
    """(action, path) attempts on a fresh trainer directory, and its files' contents."""
    (root / "checkpoints").mkdir(parents=True)
    files = {root / ".netrc": "secret", root / "checkpoints" / "model.pt": "weights",
             root / "keep.txt": "data"}
    for path, text in files.items():
        path.write_text(text)
    attempts = [("write", str(root / "pwned")), ("write", str(root / ".netrc")),
                ("delete", str(root / "keep.txt")), ("rmtree", str(root / "checkpoints"))]
    return attempts, files


def test_the_program_writes_and_deletes_nothing_outside(sandbox, tmp_path):
    attempts, _ = _write_targets(tmp_path / "control")
    tests = [f"assert attempt({a!r}, {p!r})" for a, p in attempts]
    assert score(Unsandboxed(), program(WRITE), tests) == 1.0
    assert (tmp_path / "control" / "pwned").exists()  # the attempts do work unsandboxed

    attempts, files = _write_targets(tmp_path / "trainer")
    stdlib_file = Path(os.__file__).with_name(f"pwned_{secrets.token_hex(4)}.py")
    host_tmp_file = Path("/tmp") / f"pwned_{secrets.token_hex(4)}"
    attempts += [("write", str(stdlib_file)), ("write", str(INIT)),
                 ("delete", str(INIT.with_name("harness.py")))]
    before = sandbox_sources()
    tests = [f"assert attempt({a!r}, {p!r})" for a, p in attempts]
    # its own /tmp is writable: what it writes there must not reach the host's /tmp
    source = program(WRITE) + f"attempt('write', {str(host_tmp_file)!r})\n"
    assert score(sandbox, source, tests) == 0.0
    assert {p: p.read_text() for p in files if p.exists()} == files
    assert not (tmp_path / "trainer" / "pwned").exists()
    assert not stdlib_file.exists() and not host_tmp_file.exists()
    assert sandbox_sources() == before


REMOUNT = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def writable(directory, new_namespaces):
    if new_namespaces:  # CLONE_NEWUSER | CLONE_NEWNS: capabilities over a namespace of its own
        libc.unshare(0x10000000 | 0x00020000)
    top = directory
    while not os.path.ismount(top):
        top = os.path.dirname(top)
    libc.mount(None, top.encode(), None, 32 | 4096, None)  # MS_REMOUNT | MS_BIND: rw again
    try:
        open(os.path.join(directory, "pwned.py"), "w").close()
        return True
    except OSError:
        return False
"""


def test_the_program_cannot_make_its_read_only_view_writable(sandbox):
    directory = os.path.dirname(os.__file__)
    tests = [f"assert writable({directory!r}, False)", f"assert writable({directory!r}, True)",
             "import os; os.setuid(0)"]
    assert score(sandbox, program(REMOUNT), tests) == 0.0
    assert not Path(directory, "pwned.py").exists()


SIGNAL = """
import os, signal
pids = {int(p) for p in os.listdir("/proc") if p.isdigit()}
def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except OSError:
        return False
if KILL_ALL:
    for pid in pids | {os.getppid()}:
        if pid != os.getpid():
            kill(pid)
"""


def test_the_program_sees_and_signals_no_process_of_the_host(sandbox, host):
    control = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tests = [f"assert {control.pid} in pids", f"assert kill({control.pid})"]
    assert score(Unsandboxed(), program(SIGNAL, KILL_ALL=False), tests) == 1.0
    assert control.wait(timeout=5) == -signal.SIGKILL

    pid = host.sleeper.pid
    tests = [f"assert {pid} in pids", f"assert kill({pid})", f"assert kill({os.getpid()})",
             "assert any(open(f'/proc/{p}/cmdline').read().startswith('/') for p in pids if p > 2)"]
    assert score(sandbox, program(SIGNAL, KILL_ALL=True), tests) == 0.0
    assert host.sleeper.poll() is None


CONNECT = """
import socket
def reach(family, address):
    try:
        with socket.socket(family) as s:
            s.settimeout(1)
            s.connect(address)
        return True
    except OSError:
        return False
"""


def test_the_program_reaches_no_port_or_unix_socket_of_the_host(sandbox, host):
    tests = [f"assert reach(socket.AF_INET, ('127.0.0.1', {host.tcp.getsockname()[1]}))",
             f"assert reach(socket.AF_UNIX, {host.unix_path!r})",
             f"assert reach(socket.AF_UNIX, {host.abstract_name!r})"]
    assert score(sandbox, program(CONNECT), tests) == 0.0
    assert [pending_connections(s) for s in (host.tcp, host.unix, host.abstract)] == [0, 0, 0]
    assert score(Unsandboxed(), program(CONNECT), tests) == 1.0
    assert [pending_connections(s) for s in (host.tcp, host.unix, host.abstract)] == [1, 1, 1]


FORKS = """
import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError:
    pass
print(n)
"""
BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


def test_a_fork_bomb_is_bounded_and_nothing_it_started_outlives_the_run(sandbox):
    result = sandbox.run(Run(FORKS, "main"))
    assert result.status == "ok" and 10 < int(result.stdout) < MAX_PROCESSES
    assert sandbox_processes() == []  # its sleeping children went with the namespace

    short = NamespaceSandbox(SandboxLimits(1.0, 256))
    start = time.perf_counter()
    assert short.run(Run(BOMB, "main")).status == "timeout"
    assert time.perf_counter() - start < 4.0  # the 1 s limit, and slack for a loaded machine
    assert sandbox_processes() == []


FILL = """
import os
written = 0
for i in range(256):  # 1 GiB in files of 4 MiB
    try:
        with open(f"fill_{i}", "wb") as f:
            f.write(bytes(4 << 20))
        written += 4
    except OSError:
        break
for path in ("/fill", "/usr/lib/fill"):
    try:
        open(path, "wb").close()
        written += 1000
    except OSError:
        pass
print(written)
"""


def test_filling_the_disk_stops_at_the_private_tmp_and_the_host_disk_is_untouched(sandbox):
    free_before = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
    result = sandbox.run(Run(FILL, "main"))
    free_after = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
    assert result.status == "ok" and 0 < int(result.stdout) <= WORKDIR_MB
    assert free_before - free_after < 512 << 20  # the program tried to write 1 GiB


FAKES = {
    "atexit rewrites the results": """
        import atexit, os
        def forge():
            open("results.json", "w").write("[1, 1, 1]")
            os.write(3, b"[1, 1, 1]")
        atexit.register(forge)
    """,
    "replaced AssertionError, compile and exec": """
        import builtins
        builtins.AssertionError = type("AssertionError", (Exception,), {})
        real_compile = builtins.compile
        builtins.compile = lambda *args, **kwargs: real_compile("pass", "forged", "exec")
        builtins.exec = lambda *args, **kwargs: None
    """,
    "replaced json.dumps, which writes the results": """
        import json
        json.dumps = lambda *args, **kwargs: "[1, 1, 1]"
    """,
    "os._exit(0) before the tests": "import os\nos._exit(0)\n",
    "forged results, then exit": """
        import os
        open("results.json", "w").write("[1, 1, 1]")
        os.write(3, b"[1, 1, 1]")
        os._exit(0)
    """,
    "reads the nonce and the tests from the harness's frame": """
        import os, sys
        seen = sys._getframe(1).f_locals
        forged = [1] * len(seen["tests"]) if seen["mode"] == "tests" else \
            [repr(True)] * len(seen["tests"])  # the expected values never enter the sandbox
        os.write(seen["results_fd"], f"{seen['nonce']} {forged}".replace("'", '"').encode())
        os._exit(0)
    """,
    "returns a value equal to everything": """
        class Anything:
            def __eq__(self, other):
                return True
            def __repr__(self):
                return "3"
        def add(a, b):
            return Anything()
    """,
    "rewrites the harness": """
        import sys
        for name in ("harness", "namespace_init", "__main__"):
            path = getattr(sys.modules.get(name), "__file__", None) or "harness.py"
            try:
                open(path, "w").write("results = [1, 1, 1]")
            except OSError:
                pass
        sys.modules["harness"].run = lambda *args: 0
    """,
}


@pytest.mark.parametrize("fake", FAKES)
def test_a_program_that_fakes_its_tests_scores_zero(sandbox, fake):
    before = sandbox_sources()
    assert score(sandbox, WRONG_ADD + textwrap.dedent(FAKES[fake]), ADD_TESTS) == 0.0
    assert sandbox_sources() == before


ORPHAN_REWRITES = """
import os, time
if os.fork() == 0:  # left running: once the harness has reported, turn every 0 into a 1
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        report = os.pread(3, 4096, 0)
        if report:
            nonce, _, body = report.partition(b" ")
            os.pwrite(3, nonce + b" " + body.replace(b"0", b"1"), 0)
            break
    os._exit(0)
"""


def test_a_process_the_program_leaves_running_cannot_rewrite_its_results(sandbox):
    """Code tests that are not ``EXPR == LITERAL`` report 1/0 from inside, through a pipe
    the program can add to but not read or rewrite (a file it could: this scored 1)."""
    tests = ["assert add(1, 2) in (3,)", "assert add(2, 2) in (4,)", "assert add(0, 5) in (5,)"]
    result = sandbox.run(Run(WRONG_ADD + ORPHAN_REWRITES, "tests", tuple(tests)))
    assert result.status == "ok" and result.results == (0, 0, 0), result
    assert score(sandbox, RIGHT_ADD + ORPHAN_REWRITES, tests) == 1.0


NESTED_NAMESPACES = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, flag in (("user", 0x10000000), ("user+net", 0x10000000 | 0x40000000),
                   ("net", 0x40000000), ("mount", 0x00020000)):
    print(name, libc.unshare(flag), os.strerror(ctypes.get_errno()))
"""


def test_the_program_can_make_no_namespace_of_its_own(sandbox):
    """A user namespace of its own would give it every capability there (and with them
    netfilter, mounts, ...); without one it has none to make the others."""
    result = sandbox.run(Run(NESTED_NAMESPACES, "main"))
    assert result.status == "ok", result
    made = [line for line in result.stdout.splitlines() if line.split()[1] != "-1"]
    assert not made, result.stdout


def test_output_past_the_reported_size_fails_the_run_instead_of_reaching_the_trainer(sandbox):
    result = sandbox.run(Run("import sys\nsys.stdout.write('x' * (5 << 20))", "main"))
    assert result.status == "failure" and "printed 5242880 bytes" in result.message, result
    assert result.stdout == ""


@pytest.mark.parametrize("fake", ["atexit rewrites the results",
                                  "replaced AssertionError, compile and exec"])
def test_the_same_fakes_with_a_correct_program_still_score_one(sandbox, fake):
    assert score(sandbox, RIGHT_ADD + textwrap.dedent(FAKES[fake]), ADD_TESTS) == 1.0


STATUS = """
import json, os
status = dict(line.split(":\\t") for line in open("/proc/self/status").read().splitlines()
              if ":\\t" in line)
print(json.dumps({"ids": [status["Uid"].split()[0], status["Gid"].split()[0]],
                  "no_new_privs": status["NoNewPrivs"],
                  "caps": [status[k] for k in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb")],
                  "fds": os.listdir("/proc/self/fd"), "env": sorted(os.environ),
                  "seen": [p for p in HOST_PATHS if os.path.lexists(p)],
                  "init_environ_readable": os.access("/proc/1/environ", os.R_OK),
                  "processes": sorted(p for p in os.listdir("/proc") if p.isdigit())}))
"""


def test_the_program_runs_as_nobody_without_capabilities_fds_or_the_trainers_environment(sandbox):
    host_paths = [p for p in (str(Path(__file__).parent), str(Path.home() / ".bash_history"),
                              "/dev/shm", "/run", "/var", "/etc/passwd", "/home", "/usr/bin/sh")
                  if os.path.lexists(p)]
    inherited = os.open("/dev/null", os.O_RDONLY)
    os.set_inheritable(inherited, True)
    try:
        result = sandbox.run(Run(program(STATUS, HOST_PATHS=host_paths), "main"))
    finally:
        os.close(inherited)
    seen = json.loads(result.stdout)
    assert seen["ids"] == [str(SANDBOX_ID)] * 2 and seen["no_new_privs"] == "1"
    assert seen["caps"] == ["0000000000000000"] * 5
    assert set(seen["fds"]) - {"0", "1", "2", "3"} <= {"4"}  # 4: the listing's own
    assert seen["env"] == sorted(ENV)
    assert host_paths and seen["seen"] == []
    assert not seen["init_environ_readable"] and seen["processes"] == ["1", "2"]


KERNEL_CALLS = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
for name, args in CALLS:
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(NUMBERS[name]), *map(ctypes.c_long, args))
    out[name] = ctypes.get_errno() if result < 0 else 0
print(json.dumps(out))
"""
# harmless arguments: a query, or a null pointer the kernel refuses with EFAULT
SAFE_CALLS = [("keyctl", (0, -3, 0)), ("add_key", (0, 0, 0, 0, 0)), ("bpf", (5, 0, 0)),
              ("io_uring_setup", (1, 0)), ("perf_event_open", (0, 0, -1, -1, 0)),
              ("userfaultfd", (0,)), ("personality", (0xFFFFFFFF,))]


def test_kernel_calls_a_scoring_program_has_no_use_for_fail_with_eperm(sandbox):
    """io_uring, perf events, BPF, userfaultfd, the keyrings and personality reach the kernel
    from an unprivileged process (namespaces and dropped capabilities leave them open); the
    sandbox's seccomp filter refuses them."""
    import platform

    from mcore_rl.rewards.sandbox import syscall_filter

    numbers = syscall_filter._NUMBERS.get(platform.machine())
    if numbers is None:
        pytest.skip(f"no system call table for {platform.machine()}: no filter is installed")
    source = program(KERNEL_CALLS, CALLS=SAFE_CALLS, NUMBERS=numbers)
    outside = json.loads(Unsandboxed().run(Run(source, "main")).stdout)
    assert any(err != errno.EPERM for err in outside.values()), outside
    inside = sandbox.run(Run(source, "main"))
    assert inside.status == "ok", inside
    assert json.loads(inside.stdout) == {name: errno.EPERM for name, _ in SAFE_CALLS}


SOCKETS = """
import json, socket
out = {}
for name, family, kind, protocol in FAMILIES:
    try:
        socket.socket(family, kind, protocol).close()
        out[name] = 0
    except OSError as err:
        out[name] = err.errno
print(json.dumps(out))
"""
FAMILIES = [("unix", 1, 1, 0), ("inet", 2, 1, 0), ("inet6", 10, 2, 0), ("netlink_route", 16, 3, 0),
            ("netlink_xfrm", 16, 3, 6), ("vsock", 40, 1, 0), ("packet", 17, 3, 0)]


def test_sockets_of_families_a_program_has_no_use_for_cannot_be_opened(sandbox):
    """Families whose kernel code a distribution loads on demand (vsock, xfrm, packet, ...)
    stay out of reach; Unix, IP (no network to reach) and netlink routing open as before."""
    source = program(SOCKETS, FAMILIES=FAMILIES)
    outside = json.loads(Unsandboxed().run(Run(source, "main")).stdout)
    refused = {"netlink_xfrm", "vsock", "packet"}
    assert any(outside[name] == 0 for name in refused), outside  # some open on this host
    inside = sandbox.run(Run(source, "main"))
    assert inside.status == "ok", inside
    assert json.loads(inside.stdout) == {name: errno.EAFNOSUPPORT if name in refused else 0
                                         for name, *_ in FAMILIES}
