"""One Ray node per SLURM node, started and stopped by the Ray job script (``sbatch_ray.sh``).

    python -m mcore_rl.launch.ray_node start --head --port P --job J --num-cpus C
    python -m mcore_rl.launch.ray_node start --address HEAD:P --job J --num-cpus C
    python -m mcore_rl.launch.ray_node stop --job J

Nodes of one allocation may share a host (or a host may run several jobs), so each Ray node
gets a temp dir of its own (`temp_dir`: job and SLURM node name) and ports of its own, every
one chosen free on its host and passed to ``ray start`` explicitly. ``start`` becomes
``ray start --block`` for the life of its srun step. ``stop`` ends exactly the processes of
one node's Ray: every process whose command line names its temp dir, and all their
descendants (the ``ray::`` workers, which rename themselves); ``ray stop`` would end every
Ray on the host. Ray itself is not imported here: the ``ray`` command of this environment
is run.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

TMP_BASE_ENV = "MCORE_RL_RAY_TMP"
"""Directory the nodes' Ray temp dirs go in (default /tmp; must be local to the node and
short: Ray's socket paths live under it)."""
WORKER_PORTS = 200
"""Ports reserved for each node's Ray workers (one per worker process)."""
WORKER_PORT_RANGE = (20000, 30000)
"""Where worker ports are looked for: outside the ephemeral range and Ray's default one."""
NODE_SERVICES = ("node-manager", "object-manager", "dashboard-agent-listen",
                 "dashboard-agent-grpc", "metrics-export", "runtime-env-agent")
"""Ray's services on every node, each given a port of its own (``--<service>-port``)."""
HEAD_SERVICES = ("ray-client-server",)
"""Ray's services on the head node only, besides the GCS (``--port``)."""


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def temp_dir(job: str, node: str | None = None) -> Path:
    """This node's Ray temp dir for job ``job``."""
    base = Path(os.environ.get(TMP_BASE_ENV) or "/tmp")
    return base / f"mcore-rl-ray-{job}-{node or node_name()}"


def node_ip() -> str:
    """The address other nodes reach this one at (its SLURM node name, resolved)."""
    return socket.gethostbyname(node_name())


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_ports(n: int, avoid: range = range(0)) -> list[int]:
    """``n`` different ports free on every interface of this host (Ray binds its ports on all
    of them), none in ``avoid``. Every socket stays bound until all are picked: a port asked
    for one at a time can be handed out twice once its socket is closed."""
    held: list[socket.socket] = []
    picked: list[int] = []
    try:
        while len(picked) < n:
            held.append(socket.socket())
            held[-1].bind(("", 0))
            port = held[-1].getsockname()[1]
            if port not in avoid:
                picked.append(port)
        return picked
    finally:
        for s in held:
            s.close()


def free_port_window(size: int = WORKER_PORTS, rng: random.Random | None = None) -> int:
    """The first port of ``size`` consecutive ports that are all free on this host."""
    rng = rng or random.Random()
    low, high = WORKER_PORT_RANGE
    for _ in range(50):
        start = rng.randrange(low, high - size)
        if all(_bindable(p) for p in range(start, start + size)):
            return start
    raise RuntimeError(f"no {size} consecutive free ports in {low}-{high} on {node_name()}")


def ray_command() -> str:
    """The ``ray`` script next to this environment's Python."""
    ray = Path(sys.executable).parent / "ray"
    if not ray.exists():
        raise RuntimeError(f"{ray} not found: install Ray into this environment (pip install ray)")
    return str(ray)


def start_args(job: str, head: bool, port: int | None, address: str | None, num_cpus: int | None,
               num_gpus: int | None) -> list[str]:
    """``ray start`` arguments for this node: its temp dir, its address, its own ports."""
    first_worker_port = free_port_window()
    workers = range(first_worker_port, first_worker_port + WORKER_PORTS)
    services = NODE_SERVICES + (HEAD_SERVICES if head else ())
    args = [ray_command(), "start", "--block", "--disable-usage-stats",
            f"--temp-dir={temp_dir(job)}", f"--node-ip-address={node_ip()}",
            f"--min-worker-port={workers.start}", f"--max-worker-port={workers.stop - 1}",
            *(f"--{service}-port={p}"
              for service, p in zip(services, free_ports(len(services), avoid=workers)))]
    if head:
        args += ["--head", f"--port={port}", "--include-dashboard=false"]
    else:
        args.append(f"--address={address}")
    if num_cpus is not None:
        args.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        args.append(f"--num-gpus={num_gpus}")
    return args


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process on this host."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out[int(entry)] = (ppid, cmdline)
    return out


def node_processes(tmp: Path) -> set[int]:
    """The processes of the Ray node with temp dir ``tmp``: those naming it on their command
    line and all their descendants (this process and its ancestors excluded)."""
    procs = _processes()
    names_tmp = re.compile(re.escape(str(tmp)) + r"(?=[/\s]|$)")  # not .../ray-1-n10 for n1
    found = {pid for pid, (_, cmd) in procs.items() if names_tmp.search(cmd)}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    mine, pid = set(), os.getpid()
    while pid in procs and pid not in mine:  # this process and its ancestors
        mine.add(pid)
        pid = procs[pid][0]
    return found - mine


def stop(job: str, grace_s: float = 3.0) -> int:
    """End this node's Ray of job ``job`` (SIGTERM, SIGKILL after ``grace_s``), remove its
    temp dir; returns how many processes were ended."""
    tmp = temp_dir(job)
    pids = node_processes(tmp)
    found = len(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = {p for p in pids if _alive(p)}
            if not pids:
                break
            time.sleep(0.1)
    left = node_processes(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    if left:
        raise RuntimeError(f"Ray of job {job} on {node_name()}: processes {sorted(left)} survived")
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mcore_rl.launch.ray_node", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="run this node's Ray (blocks until it is stopped)")
    s.add_argument("--job", required=True)
    role = s.add_mutually_exclusive_group(required=True)
    role.add_argument("--head", action="store_true")
    role.add_argument("--address", help="the head's HOST:PORT")
    s.add_argument("--port", type=int, help="the head's port (with --head)")
    s.add_argument("--num-cpus", type=int)
    s.add_argument("--num-gpus", type=int)
    t = sub.add_parser("stop", help="end this node's Ray of a job and remove its temp dir")
    t.add_argument("--job", required=True)
    args = p.parse_args(argv)
    if args.command == "stop":
        n = stop(args.job)
        print(f"ray_node: {node_name()}: stopped Ray of job {args.job} ({n} processes)", flush=True)
        return 0
    if args.head and not args.port:
        p.error("--head needs --port")
    cmd = start_args(args.job, args.head, args.port, args.address, args.num_cpus, args.num_gpus)
    stale = stop(args.job)  # anything left from an earlier start of this job on this node
    print(f"ray_node: {node_name()}: {stale} processes left from an earlier start of job "
          f"{args.job}", flush=True)
    print(f"ray_node: {node_name()}: {' '.join(cmd[1:])}", flush=True)
    os.execv(cmd[0], cmd)
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
