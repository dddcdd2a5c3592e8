"""A real two-node SLURM cluster on one machine, for tests and local trials (root only).

`LocalSlurmCluster` starts munged, slurmctld and two slurmd daemons ("emulated nodes"
``n1`` and ``n2``, both on this host at 127.0.0.1 with their own ports) with every config,
state, spool and log file in one directory, and stops exactly the processes it started.
Clients (sbatch, squeue, scontrol, ``mcore-rl launch slurm``) reach it through the
``SLURM_CONF`` variable in `LocalSlurmCluster.env`.

The cluster has one partition, ``debug``, which is *not* the default: jobs must name it,
so a launch without ``--partition`` shows how a cluster without a default partition answers.
Needs Debian's ``munge slurmctld slurmd slurm-client`` (`ensure_slurm_installed` installs them).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from mcore_rl.launch.ray_node import free_ports

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel")
NODES = ("n1", "n2")
PARTITION = "debug"


class ClusterError(RuntimeError):
    """The cluster could not be installed, started or queried; the message says which part."""


def ensure_slurm_installed() -> None:
    """Install the Slurm and munge packages with apt-get when a binary is missing."""
    if all(shutil.which(b) for b in BINARIES):
        return
    if os.geteuid() != 0:
        raise ClusterError("Slurm is not installed and installing it needs root: apt-get install "
                           f"-y --no-install-recommends {' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise ClusterError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-500:]}")
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        raise ClusterError(f"Slurm packages installed but {', '.join(missing)} not on PATH")


def ensure_node_names_resolve() -> None:
    """The node names and this host's name must resolve: torchrun's rendezvous and gloo use
    them. Missing ones are added to /etc/hosts as 127.0.0.1."""
    missing = []
    for name in (*NODES, socket.gethostname()):
        try:
            socket.gethostbyname(name)
        except OSError:
            missing.append(name)
    if missing:
        with open("/etc/hosts", "a") as hosts:
            hosts.write(f"127.0.0.1 {' '.join(missing)}\n")


def _slurm_conf(root: Path, munge_socket: Path, ctld_port: int, node_ports: list[int],
                cpus: int, cred_expire_s: int) -> str:
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={cpus} "
        "RealMemory=4000 State=UNKNOWN" for n, p in zip(NODES, node_ports))
    return f"""\
ClusterName=mcorerl
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire_s}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
{nodes}
PartitionName={PARTITION} Nodes={",".join(NODES)} MaxTime=INFINITE State=UP
"""


class LocalSlurmCluster:
    """Start with `start()` (or ``with LocalSlurmCluster() as cluster:``), stop with `stop()`."""

    def __init__(self, root: str | Path | None = None, cpus_per_node: int = 8,
                 cred_expire_s: int = 120):
        self.root = Path(root or tempfile.mkdtemp(prefix="mcore-rl-slurm-"))
        self.cpus_per_node = cpus_per_node
        self.cred_expire_s = cred_expire_s
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm clients talking to this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def __enter__(self) -> "LocalSlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> "LocalSlurmCluster":
        ensure_slurm_installed()
        ensure_node_names_resolve()
        try:
            self._start_munge()
            self._start_slurm()
            self.wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(parents=True)
        self.root.chmod(0o755)  # munged runs as the munge user and checks every parent dir
        shutil.chown(munge, "munge", "munge")
        munge.chmod(0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        self.munge_socket = munge / "munge.socket"
        self._spawn("munged", ["munged", "--foreground", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log",
                               f"--seed-file={munge}/munged.seed"], user="munge")
        self._wait_for(lambda: self.munge_socket.exists(), 10.0, "munged socket")

    def _start_slurm(self) -> None:
        for sub in ("state", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ports = free_ports(1 + len(NODES))
        self.conf.write_text(_slurm_conf(self.root, self.munge_socket, ports[0], ports[1:],
                                         self.cpus_per_node, self.cred_expire_s))
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])

    def _spawn(self, name: str, cmd: list[str], user: str | None = None) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, user=user,
                                            start_new_session=True)
        log.close()

    def _wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise ClusterError(f"{', '.join(dead)} exited while waiting for {what}; "
                                   f"logs in {self.root}: {self.tail_logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise ClusterError(f"no {what} after {timeout_s:.0f}s; logs in {self.root}")

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until every node reports idle."""
        def idle() -> bool:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            return all(states.get(n) == "idle" for n in NODES)

        self._wait_for(idle, timeout_s, "nodes n1, n2 idle")

    def run(self, cmd: list[str], check: bool = True, timeout: float = 30.0):
        """Run a Slurm client command against this cluster."""
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise ClusterError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
        return proc

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, RestartCnt, ExitCode, NodeList...)."""
        out = self.run(["scontrol", "-o", "show", "job", job_id]).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def tail_logs(self, chars: int = 1500) -> str:
        texts = [f"== {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                 for p in sorted(self.root.glob("**/*.log")) if p.is_file()]
        return "\n".join(texts)

    def cancel_jobs(self, timeout_s: float = 45.0) -> None:
        """Cancel every job of this cluster and wait until its processes are gone (slurmstepd
        outlives slurmd, so jobs must end before the daemons stop)."""
        if "slurmctld" not in self.procs or self.procs["slurmctld"].poll() is not None:
            return
        self.run(["scancel", "--full", "--user", str(os.geteuid())], check=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
                return
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel the cluster's jobs, stop the daemons this object started (and only those)."""
        try:
            self.cancel_jobs()
        except (OSError, subprocess.SubprocessError):
            pass  # the daemons are stopped below either way
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()


def main() -> None:
    """``python -m mcore_rl.launch.slurm_cluster``: a cluster to try jobs on, until Ctrl-C."""
    import signal

    cluster = LocalSlurmCluster(cred_expire_s=5)  # requeued jobs restart after ~6 s
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with cluster:
        print(f"SLURM cluster up (nodes {', '.join(NODES)}, partition {PARTITION}); in another "
              f"shell:\n  export SLURM_CONF={cluster.conf}\nlogs in {cluster.root}; Ctrl-C "
              "stops it.", flush=True)
        try:
            while all(p.poll() is None for p in cluster.procs.values()):
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
