"""Render the sbatch template for a job, check the cluster, submit.

`SbatchRequest` holds what varies between jobs (nodes, GPUs or CPUs per node, partition,
time, and the driver: ``mcore-rl train CONFIG [overrides]`` or a Python script with its
arguments); `render_sbatch` fills ``templates/sbatch_ray.sh`` with it (a Ray head on the
first node, a Ray worker on every other, the driver once on the first, Ray stopped when the
job ends); `submit` hands the script to ``sbatch --parsable``.
`resolve_partition` asks the cluster (``sinfo``) before submitting, so a missing or wrong
partition fails with one line instead of a pending job.
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template

from mcore_rl.errors import UsageError

TEMPLATE = "sbatch_ray.sh"


class _AtTemplate(Template):
    delimiter = "@"  # bash owns `$`


@dataclass
class SbatchRequest:
    """One job: where it runs and what its driver runs."""

    driver: list[str]
    """The driver's arguments to the environment's Python: ``-m mcore_rl.cli.main train
    CONFIG [overrides]``, or a script (absolute path) and its arguments."""
    run_dir: str = ""
    """Absolute run directory (``logging.dir``, or the script's): job log, stop file."""
    workdir: str = ""
    """Directory the job starts in (relative paths of the config resolve from here)."""
    python: str = "python"
    """Python interpreter of the environment that has mcore-rl installed (absolute path)."""
    nodes: int = 1
    """Nodes to allocate; one Ray node on each."""
    gpus_per_node: int | None = None
    """GPUs per node (Ray's GPUs); None for CPU nodes."""
    cpus_per_node: int = 0
    """CPU cores per node; 0: the cluster's default."""
    threads_per_rank: int = 1
    """OMP_NUM_THREADS of the job's processes (unless set in the submitting environment)."""
    partition: str = ""
    """SLURM partition; empty: the cluster's default."""
    time: str = "01:00:00"
    """Time limit."""
    account: str = ""
    """SLURM account; empty: the user's default."""
    job_name: str = "mcore-rl"
    """Job name shown by squeue."""
    signal_lead_s: int = 300
    """USR1 to the batch shell this many seconds before the time limit."""
    ray_reconnect_timeout_s: int = 5
    """How long every Ray process of the job retries a GCS that is gone
    (``launch.ray_reconnect_timeout_s``)."""

    @property
    def log_path(self) -> str:
        """The job's log; ``%j`` is the job id (one log per job, appended across requeues)."""
        return f"{self.run_dir}/slurm-%j.log"

    def cpus(self) -> int:
        return self.cpus_per_node


def sbatch_directives(req: SbatchRequest) -> list[str]:
    """The ``#SBATCH`` lines of ``req`` (options that are unset are left to the cluster)."""
    opts = [f"--job-name={req.job_name}", f"--nodes={req.nodes}", "--ntasks-per-node=1"]
    if req.gpus_per_node:
        opts.append(f"--gpus-per-node={req.gpus_per_node}")
    if req.cpus():
        opts.append(f"--cpus-per-task={req.cpus()}")
    if req.partition:
        opts.append(f"--partition={req.partition}")
    if req.account:
        opts.append(f"--account={req.account}")
    opts += [f"--time={req.time}", f"--chdir={req.workdir}", f"--output={req.log_path}",
             "--open-mode=append", "--requeue", f"--signal=B:USR1@{req.signal_lead_s}"]
    return [f"#SBATCH {shlex.quote(o)}" for o in opts]


def _backend_env(req: SbatchRequest) -> str:
    if req.gpus_per_node:
        return "\n".join([
            'export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"',
            'export NCCL_ASYNC_ERROR_HANDLING="${NCCL_ASYNC_ERROR_HANDLING:-1}"',
            'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"'])
    # CPU nodes: gloo. Set GLOO_SOCKET_IFNAME in the submitting environment if the host
    # name does not resolve to the interface the nodes talk over.
    return 'export CUDA_VISIBLE_DEVICES=""'


def render_sbatch(req: SbatchRequest) -> str:
    """The job script for ``req``."""
    text = resources.files("mcore_rl.launch").joinpath("templates", TEMPLATE).read_text()
    srun_extra = f"--cpus-per-task={req.cpus()} " if req.cpus() else ""
    ray_resources = " ".join(
        [*([f"--num-cpus {req.cpus()}"] if req.cpus() else []),
         *([f"--num-gpus {req.gpus_per_node}"] if req.gpus_per_node else [])])
    return _AtTemplate(text).substitute(
        directives="\n".join(sbatch_directives(req)), python=shlex.quote(req.python),
        run_dir=shlex.quote(req.run_dir), threads_per_rank=req.threads_per_rank,
        backend_env=_backend_env(req), srun_extra=srun_extra, ray_resources=ray_resources,
        ray_reconnect_timeout_s=req.ray_reconnect_timeout_s,
        driver_args=shlex.join(req.driver))


def require_slurm_client(names: tuple[str, ...] = ("sbatch", "sinfo")) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        raise UsageError(f"{' and '.join(missing)} not found on PATH: run this on a SLURM login "
                         "node (or add --dry-run to print the job script)")


def _slurm(cmd: list[str], env: dict | None = None, stdin: str | None = None) -> str:
    try:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=60)
    except subprocess.TimeoutExpired:
        raise UsageError(f"`{cmd[0]}` got no answer within 60 s; is slurmctld reachable?") from None
    if proc.returncode:
        first = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[0]
        raise UsageError(f"`{' '.join(cmd[:2])}` failed: {first}")
    return proc.stdout


def resolve_partition(requested: str, env: dict | None = None) -> str:
    """The partition the job will run in: ``requested`` if the cluster has it, else the
    cluster's default; raises `UsageError` naming the choices when neither exists."""
    names = _slurm(["sinfo", "-h", "-o", "%P"], env).split()
    default = next((n[:-1] for n in names if n.endswith("*")), "")
    known = sorted({n.rstrip("*") for n in names})
    choices = ", ".join(known) or "none"
    if requested:
        if requested not in known:
            raise UsageError(f"partition '{requested}' does not exist on this cluster; choose one "
                             f"of: {choices}")
        return requested
    if not default:
        raise UsageError(f"no partition given and the cluster has no default partition; add "
                         f"--partition NAME (one of: {choices}) or set launch.partition")
    return default


def submit(script: str, env: dict | None = None) -> str:
    """Submit ``script`` (its text) with ``sbatch --parsable``; returns the job id."""
    out = _slurm(["sbatch", "--parsable"], env, stdin=script)
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise UsageError(f"sbatch answered {out.strip()!r}, not a job id")
    return job_id


def log_file(req: SbatchRequest, job_id: str) -> Path:
    return Path(req.log_path.replace("%j", job_id))
