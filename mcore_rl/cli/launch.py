"""`mcore-rl launch slurm CONFIG [overrides] --nodes N (--gpus-per-node G | --procs-per-node P)`,
or `mcore-rl launch slurm [options] --ray DRIVER.py [-- driver arguments]`.

Checks the request before anything reaches the cluster: the config must fit the world size
(nodes x ranks per node), the data and checkpoint paths it reads must be usable from here
(``--skip-path-checks`` when they exist only on the cluster), the cluster must have the
partition (or a default one); then it
renders the job script (``--dry-run`` prints it and stops), submits it and prints the job id
and the log path. Command-line values override the config's ``launch`` section.

With ``--ray`` the job runs a driver on Ray instead: a Ray head on the first node, a Ray
worker on every other, the driver once on the first node. The driver is a Python script
(an `RLTrainer` script, a flow launch; the positional arguments are the script and its
arguments) or an RL config, run as ``mcore-rl train CONFIG [overrides]``: the RL graph,
its trainer ranks placed over the nodes. Ray must be installed in this environment, and
``--procs-per-node`` does not apply (the driver places its ranks itself).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from mcore_rl.config import load_config, validate_config
from mcore_rl.errors import UsageError
from mcore_rl.rewards.reward_model import ON_RANK_LOOP, REWARD_MODEL


def build_request(args):
    """The `SbatchRequest` for ``args`` (config validated against the world size)."""
    from mcore_rl.config.validate import validate_layout
    from mcore_rl.launch.sbatch import SbatchRequest

    if args.ray:
        return build_ray_request(args)
    if args.run_dir is not None or args.cpus_per_node is not None:
        raise UsageError("--run-dir and --cpus-per-node are for --ray jobs; mcore-rl train jobs "
                         "take logging.dir and launch.cpus_per_node from the config")
    if (args.gpus_per_node is None) == (args.procs_per_node is None):
        raise UsageError("give exactly one of --gpus-per-node G (GPU nodes, one rank per GPU) or "
                         "--procs-per-node P (CPU nodes)")
    cfg = load_config(args.config, args.overrides)
    if cfg.train.job == "rl" and cfg.reward.name == REWARD_MODEL:
        raise UsageError(ON_RANK_LOOP)
    launch = cfg.launch
    nodes = launch.nodes if args.nodes is None else args.nodes
    per_node = args.gpus_per_node if args.gpus_per_node is not None else args.procs_per_node
    if nodes < 1 or per_node < 1:
        raise UsageError(f"--nodes and ranks per node must be >= 1, got {nodes} and {per_node}")
    world = nodes * per_node
    try:
        validate_config(cfg, world_size=world)
        check_local_inputs(cfg, read_paths=not args.skip_path_checks)
    except UsageError as err:
        raise type(err)(f"{nodes} node(s) x {per_node} rank(s) = {world} ranks: {err}") from None
    p = cfg.parallel
    layout = f"TP{p.tp}xPP{p.pp}xDP{validate_layout(cfg, world)}"
    req = SbatchRequest(
        config=str(Path(args.config).resolve()), overrides=list(args.overrides),
        run_dir=str(Path(cfg.logging.dir).resolve()), workdir=str(Path.cwd()),
        python=sys.executable, nodes=nodes, procs_per_node=per_node,
        gpus_per_node=args.gpus_per_node, cpus_per_node=launch.cpus_per_node,
        threads_per_rank=p.cpu_threads_per_rank,
        partition=args.partition if args.partition is not None else launch.partition,
        time=args.time or launch.time,
        account=args.account if args.account is not None else launch.account,
        job_name=launch.job_name, signal_lead_s=launch.signal_lead_s)
    return req, layout


def build_ray_request(args):
    """The `SbatchRequest` of a ``--ray`` job (the driver script checked here)."""
    from mcore_rl.launch.sbatch import SbatchRequest

    script = Path(args.config)
    if script.suffix not in (".py", ".yaml", ".yml"):
        raise UsageError(f"--ray runs a Python driver script or an mcore-rl train config, not "
                         f"{args.config!r}")
    if not script.is_file():
        raise UsageError(f"{'config' if script.suffix != '.py' else 'driver script'} "
                         f"{args.config} not found")
    if args.procs_per_node is not None:
        raise UsageError("--procs-per-node does not apply to --ray jobs: the driver places its "
                         "ranks on the Ray nodes itself; give --cpus-per-node or --gpus-per-node")
    ray = Path(sys.executable).parent / "ray"
    if not ray.exists():
        raise UsageError(f"--ray needs Ray in this environment ({ray} not found): pip install ray")
    launch = load_config(None, []).launch
    nodes = launch.nodes if args.nodes is None else args.nodes
    cpus = launch.cpus_per_node if args.cpus_per_node is None else args.cpus_per_node
    checks = [("--nodes", nodes, 1), ("--cpus-per-node", cpus, 0)]
    if args.gpus_per_node is not None:
        checks.append(("--gpus-per-node", args.gpus_per_node, 1))
    for name, value, least in checks:
        if value < least:
            raise UsageError(f"{name} must be >= {least}, got {value}")
    driver = [str(script.resolve()), *args.overrides]
    run_dir = Path(args.run_dir or f"runs/{script.stem}").resolve()
    if script.suffix != ".py":  # mcore-rl train CONFIG as the driver: the RL graph on Ray
        cfg = load_config(script, args.overrides)
        if cfg.train.job != "rl":
            raise UsageError(f"--ray runs RL jobs; train.job={cfg.train.job} runs with "
                             "--procs-per-node or --gpus-per-node (no --ray)")
        p = cfg.parallel
        validate_config(cfg, world_size=(p.dp or 1) * p.tp * p.pp)
        check_local_inputs(cfg, read_paths=not args.skip_path_checks)
        if args.run_dir is not None:
            raise UsageError("--run-dir is the driver script's; an mcore-rl train job writes to "
                             "its logging.dir")
        driver = ["-m", "mcore_rl.cli.main", "train", *driver]
        run_dir = Path(cfg.logging.dir).resolve()
    req = SbatchRequest(
        config="", run_dir=str(run_dir), workdir=str(Path.cwd()), python=sys.executable,
        nodes=nodes, gpus_per_node=args.gpus_per_node, cpus_per_node=cpus,
        partition=args.partition if args.partition is not None else launch.partition,
        time=args.time or launch.time,
        account=args.account if args.account is not None else launch.account,
        job_name=launch.job_name, signal_lead_s=launch.signal_lead_s,
        ray_driver=driver)
    return req, f"Ray driver {script.name}"


def check_local_inputs(cfg, read_paths: bool) -> None:
    """What the job will read, checked here first: registered names, and (``read_paths``)
    the data files and the checkpoint to resume from (the model is read by the layout check)."""
    from mcore_rl.rl.job_check import check_registered_names
    from mcore_rl.rl.setup import check_job

    if cfg.train.job != "rl":
        return
    if read_paths:
        check_job(cfg)
    else:
        check_registered_names(cfg)


def run(args) -> int:
    from mcore_rl.launch import sbatch

    req, layout = build_request(args)
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
    if req.ray_driver:
        print(f"mcore-rl launch: submitted job {job_id}: {req.nodes} node(s), {layout}, "
              f"partition {req.partition}")
    else:
        ranks = f"{req.nodes} node(s) x {req.procs_per_node} rank(s)"
        print(f"mcore-rl launch: submitted job {job_id}: {ranks}, layout {layout}, "
              f"partition {req.partition}")
    print(f"  log:    {sbatch.log_file(req, job_id)}")
    print(f"  script: {run_dir / f'slurm-{job_id}.sbatch'}")
    print(f"  watch:  squeue -j {job_id}; checkpoint and requeue now: "
          f"scancel --batch --signal=USR1 {job_id}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="submit training to a cluster (SLURM)")
    p.add_argument("scheduler", choices=["slurm"], help="cluster scheduler")
    p.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml (with --ray: the "
                                  "driver script)")
    p.add_argument("overrides", nargs="*",
                   help="section.field=value overrides (with --ray: the driver's arguments; "
                        "after -- if they start with -)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: launch.nodes)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPU nodes: GPUs per node, one rank each")
    p.add_argument("--procs-per-node", type=int, default=None, help="CPU nodes: ranks per node")
    p.add_argument("--partition", default=None, help="partition (default: launch.partition, "
                                                     "else the cluster's default)")
    p.add_argument("--time", default=None, help="time limit, e.g. 04:00:00 (default: launch.time)")
    p.add_argument("--account", default=None, help="account (default: launch.account)")
    p.add_argument("--ray", action="store_true",
                   help="run a driver script on a Ray cluster of the job's nodes (put the options "
                        "before the script)")
    p.add_argument("--cpus-per-node", type=int, default=None,
                   help="--ray: CPUs per node for SLURM and Ray (default: launch.cpus_per_node)")
    p.add_argument("--run-dir", default=None,
                   help="--ray: job log, stop file, MCORE_RL_RUN_DIR (default: runs/<script name>)")
    p.add_argument("--dry-run", action="store_true", help="print the job script, submit nothing")
    p.add_argument("--skip-path-checks", action="store_true",
                   help="do not read the data and resume paths here (they exist only on the cluster)")
    p.set_defaults(func=run)
