"""`mcore-rl launch slurm CONFIG [overrides] --nodes N [--gpus-per-node G] [--cpus-per-node C]`,
or `mcore-rl launch slurm [options] DRIVER.py [-- driver arguments]`.

Every job runs on Ray: the job script starts a Ray head on the first node and a Ray worker on
every other (each with ports and a temp dir of its own, so jobs that share nodes do not
collide), runs the driver once on the first node, and stops Ray when the job ends. The
driver is ``mcore-rl train CONFIG [overrides]`` (the job's graph, its ranks and engines
placed over the nodes' GPUs or cores) or a Python script (an `RLTrainer` script, a flow
launch).

Checks the request before anything reaches the cluster: the config must be runnable
(`mcore_rl.roles.rules`) and its graph must fit N nodes of G GPUs (the same plan a launch
makes), the data and checkpoint paths it reads must be usable from here
(``--skip-path-checks`` when they exist only on the cluster), the cluster must have the
partition (or a default one); then it renders the job script (``--dry-run`` prints it and
stops), submits it and prints the job id and the log path. Command-line values override the
config's ``launch`` section. Ray must be installed in this environment.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from mcore_rl.config import load_config
from mcore_rl.errors import UsageError


def build_request(args):
    """The `SbatchRequest` for ``args`` (the config checked against the nodes); a line
    describing the job."""
    from mcore_rl.launch.sbatch import SbatchRequest

    if args.procs_per_node is not None:
        raise UsageError("--procs-per-node does not apply: the job's graph places its ranks on "
                         "Ray (tp*pp*cp*dp of the config); give --gpus-per-node G (GPU nodes) or "
                         "--cpus-per-node C (CPU nodes)")
    script = Path(args.config)
    if script.suffix not in (".py", ".yaml", ".yml"):
        raise UsageError(f"launch slurm runs an mcore-rl train config or a Python driver script, "
                         f"not {args.config!r}")
    if not script.is_file():
        raise UsageError(f"{'config' if script.suffix != '.py' else 'driver script'} "
                         f"{args.config} not found")
    ray = Path(sys.executable).parent / "ray"
    if not ray.exists():
        raise UsageError(f"launch slurm runs jobs on Ray, which this environment lacks ({ray} "
                         "not found): pip install ray")
    launch = load_config(None, []).launch
    nodes = launch.nodes if args.nodes is None else args.nodes
    cpus = launch.cpus_per_node if args.cpus_per_node is None else args.cpus_per_node
    gpus = args.gpus_per_node if args.gpus_per_node is not None else launch.gpus_per_node
    checks = [("--nodes", nodes, 1), ("--cpus-per-node", cpus, 0)]
    if gpus is not None:
        checks.append(("--gpus-per-node", gpus, 1))
    for name, value, least in checks:
        if value < least:
            raise UsageError(f"{name} must be >= {least}, got {value}")
    driver = [str(script.resolve()), *args.overrides]
    run_dir = Path(args.run_dir or f"runs/{script.stem}").resolve()
    threads = 1
    what = f"driver {script.name}"
    if script.suffix != ".py":  # mcore-rl train CONFIG as the driver: the job's graph
        if args.run_dir is not None:
            raise UsageError("--run-dir is a driver script's; an mcore-rl train job writes to "
                             "its logging.dir")
        cfg = load_config(script, args.overrides)
        launch = cfg.launch
        nodes = launch.nodes if args.nodes is None else args.nodes
        gpus = args.gpus_per_node if args.gpus_per_node is not None else launch.gpus_per_node
        what = check_on_nodes(cfg, nodes, gpus, read_paths=not args.skip_path_checks)
        driver = ["-m", "mcore_rl.cli.main", "train", *driver]
        run_dir = Path(cfg.logging.dir).resolve()
        threads = cfg.parallel.cpu_threads_per_rank
    req = SbatchRequest(
        driver=driver, run_dir=str(run_dir), workdir=str(Path.cwd()), python=sys.executable,
        nodes=nodes, gpus_per_node=gpus, cpus_per_node=cpus, threads_per_rank=threads,
        partition=args.partition if args.partition is not None else launch.partition,
        time=args.time or launch.time,
        account=args.account if args.account is not None else launch.account,
        job_name=launch.job_name, signal_lead_s=launch.signal_lead_s,
        ray_reconnect_timeout_s=launch.ray_reconnect_timeout_s)
    return req, what


def check_on_nodes(cfg, nodes: int, gpus_per_node: int | None, read_paths: bool) -> str:
    """The config checked as ``mcore-rl train`` checks it (``read_paths``: also the data and
    checkpoint paths, from here), and on GPU nodes its graph planned onto ``nodes`` nodes of
    ``gpus_per_node`` GPUs (the plan a launch makes); a line describing the job."""
    from mcore_rl.cli.train import describe
    from mcore_rl.roles.rules import check_config, check_runnable, world_size_of

    world = world_size_of(cfg)
    try:
        if read_paths:
            check_runnable(cfg, world)
        else:
            check_config(cfg, world)
            if cfg.train.job == "rl":
                from mcore_rl.rl.job_check import check_registered_names

                check_registered_names(cfg)
        if gpus_per_node:
            plan_on_nodes(cfg, nodes, gpus_per_node)
    except UsageError as err:
        where = f"{nodes} node(s)" + (f" x {gpus_per_node} GPU(s)" if gpus_per_node else "")
        raise type(err)(f"{where}: {err}") from None
    return describe(cfg)


def plan_on_nodes(cfg, nodes: int, gpus_per_node: int) -> None:
    """Refuse a job whose graph does not fit ``nodes`` x ``gpus_per_node`` GPUs."""
    from mcore_rl.flow.device_plan import Node, plan_devices
    from mcore_rl.flow.gpu_placement import demands_of
    from mcore_rl.flow.plan import build_plan
    from mcore_rl.roles.graph import job_graph

    _, job = job_graph(cfg, gpus=True, dry_run=True)
    plan = build_plan(job.group, job.data is not None, None, max_in_flight=job.max_in_flight)
    plan_devices(demands_of(plan.instances), [Node(f"node{i}", gpus_per_node) for i in range(nodes)])


def run(args) -> int:
    from mcore_rl.launch import sbatch

    req, what = build_request(args)
    if args.dry_run:
        print(sbatch.render_sbatch(req), end="")
        return 0
    sbatch.require_slurm_client()
    req = replace(req, partition=sbatch.resolve_partition(req.partition))
    script = sbatch.render_sbatch(req)
    run_dir = Path(req.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM does not create the log's directory
    job_id = sbatch.submit(script)
    (run_dir / f"slurm-{job_id}.sbatch").write_text(script)
    per_node = f" x {req.gpus_per_node} GPU(s)" if req.gpus_per_node else ""
    print(f"mcore-rl launch: submitted job {job_id}: {req.nodes} node(s){per_node}, {what}, "
          f"partition {req.partition}")
    print(f"  log:    {sbatch.log_file(req, job_id)}")
    print(f"  script: {run_dir / f'slurm-{job_id}.sbatch'}")
    print(f"  watch:  squeue -j {job_id}; checkpoint and requeue now: "
          f"scancel --batch --signal=USR1 {job_id}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="submit a job to a cluster (SLURM, Ray on the nodes)")
    p.add_argument("scheduler", choices=["slurm"], help="cluster scheduler")
    p.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml, or a Python "
                                  "driver script")
    p.add_argument("overrides", nargs="*",
                   help="section.field=value overrides (a driver script: its arguments, after "
                        "-- if they start with -)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: launch.nodes)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPU nodes: GPUs per node (default: launch.gpus_per_node)")
    p.add_argument("--cpus-per-node", type=int, default=None,
                   help="CPUs per node for SLURM and Ray (default: launch.cpus_per_node)")
    p.add_argument("--procs-per-node", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ray", action="store_true",
                   help="accepted for older scripts: every job runs on Ray")
    p.add_argument("--partition", default=None, help="partition (default: launch.partition, "
                                                     "else the cluster's default)")
    p.add_argument("--time", default=None, help="time limit, e.g. 04:00:00 (default: launch.time)")
    p.add_argument("--account", default=None, help="account (default: launch.account)")
    p.add_argument("--run-dir", default=None,
                   help="driver script: job log, stop file, MCORE_RL_RUN_DIR (default: "
                        "runs/<script name>)")
    p.add_argument("--dry-run", action="store_true", help="print the job script, submit nothing")
    p.add_argument("--skip-path-checks", action="store_true",
                   help="do not read the data and resume paths here (they exist only on the cluster)")
    p.set_defaults(func=run)

