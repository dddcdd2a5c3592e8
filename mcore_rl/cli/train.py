"""`mcore-rl train CONFIG [overrides] [--nproc N]`: run a job as its graph of controllers on
Ray (`mcore_rl.roles.graph`): joined when ``RAY_ADDRESS`` names one (a SLURM job of
``mcore-rl launch slurm``), else a local one started here and stopped at the end.

Under torchrun or srun, each process is one rank of the launcher's world and the graph runs
there without Ray, every role fused into the ranks (``rollout.placement: fused``,
`mcore_rl.roles.graph.run_in_this_world`); what needs controllers of its own (an
overlapping schedule, replicas, a reward model) is refused with the command to use.

Everything is checked before any process starts (`mcore_rl.roles.rules`). A stop request
(SIGTERM or SIGUSR1 to this process, or the stop file of ``$MCORE_RL_STOP_FILE``) reaches
the trainer ranks through the stop file, so they agree on a step boundary, checkpoint and
end the run; this process then exits with `stop_exit_code()`. Failures end with one line
naming the role and the cause: bad input found while running (a reward function that
raises) exits 2, anything else (an engine that died, a rank that failed) exits 1."""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from mcore_rl.config import RLConfig, load_config
from mcore_rl.errors import UsageError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopForwarding:
    """This process's stop signals turned into the stop file the trainer ranks watch; a
    second signal of the same kind gets its default action."""

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        self.received: set[int] = set()
        self.previous: dict = {}

    def install(self) -> "StopForwarding":
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if signum in self.received:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received.add(signum)
        self.stop_file.touch()

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def launched_by_torchrun_or_srun() -> bool:
    """Whether this process is one of several ranks a launcher started (torchrun, srun)."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"]) > 1 or "TORCHELASTIC_RUN_ID" in os.environ
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in os.environ


def quiet_progress_bars() -> None:
    """No progress-bar frames from the libraries (loading and writing checkpoints) between
    the status lines, here and in the processes started from here."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def run(args) -> int:
    from mcore_rl.roles.rules import check_config, check_runnable, world_size_of

    if launched_by_torchrun_or_srun():
        return run_on_launcher_ranks(args)
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}; give the number of ranks "
                         "to start, or leave it out for tp*pp*cp*dp of the config")
    cfg = load_config(args.config, args.overrides)
    if args.nproc is not None:  # the layout against that many ranks, then its dp
        check_config(cfg, args.nproc)
        p = cfg.parallel
        cfg = replace(cfg, parallel=replace(p, dp=args.nproc // (p.tp * p.pp * p.cp)))
    check_runnable(cfg, world_size_of(cfg))
    return run_checked(cfg)


def run_checked(cfg: RLConfig) -> int:
    """Launch a checked config's job; the process's exit status."""
    from mcore_rl.cli.failures import end_on_head_death, error_line
    from mcore_rl.engines.liveness import EngineDiedError, watch_owner
    from mcore_rl.flow import FlowError, ray_head, ray_shim
    from mcore_rl.launch.stop_signal import STOP_FILE_ENV, StopRequested, StopSignal, stop_exit_code
    from mcore_rl.roles.graph import ModelDirAhead, run_job

    # vLLM logs every request at INFO; keep the console for the run's own progress.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    quiet_progress_bars()
    given = os.environ.get(STOP_FILE_ENV)
    private = None
    if given:
        stop_file = Path(given)
    else:
        Path(cfg.logging.dir).mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".stop-request.", dir=cfg.logging.dir)
        os.close(fd)
        os.unlink(name)
        stop_file = private = Path(name)
    watch_owner()  # the run's processes, Ray's included, end with this one however it ends
    stop_ray = None
    ahead = ModelDirAhead(cfg)  # written while Ray starts
    if not ray_shim.require().is_initialized():
        try:
            stop_ray = ray_shim.start_local(cfg.launch.ray_reconnect_timeout_s,
                                            include_dashboard=False, logging_level=logging.WARNING)
        except BaseException:
            ahead.discard()
            raise
    ray_head.quiet_death_notices()
    head_watch = ray_head.watch_head(end_on_head_death(cfg.logging.dir))
    forwarding = StopForwarding(stop_file).install()  # after ray.init, which sets its own
    print(f"mcore-rl: {describe(cfg)} on Ray", flush=True)
    # Ranks print their step lines through Ray's log forwarding, which has no use for a
    # progress bar's carriage returns.
    cfg = replace(cfg, logging=replace(cfg.logging, progress_bar=False))
    code, last, to = 0, None, sys.stderr
    try:
        run_job(cfg, stop=StopSignal(stop_file=stop_file, signals=()), ahead=ahead)
    except FlowError as err:
        cause = err.cause
        if isinstance(cause, StopRequested):
            code, to = stop_exit_code(), sys.stdout
            last = (f"mcore-rl: stopped on request after step {cause.step}; checkpoint "
                    f"{cause.checkpoint}; resume by running the same command again")
        elif isinstance(cause, UsageError):
            code, last = 2, f"mcore-rl train: error: {cause}"
        elif isinstance(cause, EngineDiedError):
            code, last = 1, f"mcore-rl train: error: {cause}"
        else:
            code = 1
            last = error_line(str(err).splitlines()[0], cfg.logging.dir, str(err))
    finally:
        head_watch.stop()  # Ray is shut down on purpose from here on
        forwarding.uninstall()
        try:
            if stop_ray is not None:
                stop_ray()
        finally:
            if private is not None:
                private.unlink(missing_ok=True)
                private.with_name(private.name + ".saved").unlink(missing_ok=True)
            if last is not None:  # after Ray is down: nothing of its shutdown prints below it
                print(last, file=to, flush=True)
    return code


ON_RAY = ("mcore-rl launch slurm CONFIG --nodes N --gpus-per-node G (Ray on the allocation), "
          "or mcore-rl train CONFIG --nproc N on one machine")


def run_on_launcher_ranks(args) -> int:
    """This process is one rank of a torchrun or srun world: the job's graph with every role
    fused into the ranks, without Ray; the process's exit status."""
    from mcore_rl.engines.liveness import EngineDiedError
    from mcore_rl.flow.worker_group import LeaderFailed
    from mcore_rl.launch.preflight import describe as describe_peers
    from mcore_rl.launch.preflight import run_preflight
    from mcore_rl.launch.stop_signal import StopRequested, StopSignal, stop_exit_code
    from mcore_rl.parallel import destroy_parallel, init_process_group
    from mcore_rl.roles.graph import run_in_this_world
    from mcore_rl.roles.rules import check_runnable

    if args.nproc is not None:
        raise UsageError("--nproc starts ranks on Ray; under torchrun or srun the launcher's "
                         "ranks run the job: drop --nproc")
    launcher = {name: os.environ.get(name, os.environ.get(slurm)) for name, slurm in
                (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"),
                 ("LOCAL_RANK", "SLURM_LOCALID"))}  # srun's variables, as torchrun's
    world = int(launcher["WORLD_SIZE"])
    cfg = load_config(args.config, args.overrides)
    if cfg.train.job == "rl" and cfg.rollout.placement != "fused":
        cfg = replace(cfg, rollout=replace(cfg.rollout, placement="fused"))
    try:
        check_runnable(cfg, world)
    except UsageError as err:
        raise type(err)(f"under torchrun or srun every role runs fused into the ranks, without "
                        f"Ray: {err}; or run it on Ray: {ON_RAY}") from None
    os.environ.update({k: v for k, v in launcher.items() if v is not None})
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    stop = StopSignal().install()
    init_process_group(cfg.parallel.backend)
    peers = run_preflight(timeout_s=cfg.launch.preflight_timeout_s)
    rank = int(os.environ["RANK"])
    if rank == 0:
        print(f"mcore-rl: {describe(cfg)} in the launcher's world of {world} rank(s), without "
              f"Ray; preflight ok: {describe_peers(peers)}", flush=True)
    quiet_progress_bars()
    try:
        run_in_this_world(cfg, stop)
    except UsageError as err:
        print(f"mcore-rl train: error{f' (rank {rank})' if rank else ''}: {err}", file=sys.stderr,
              flush=True)
        return 2
    except EngineDiedError as err:
        print(f"mcore-rl train: error: {err}", file=sys.stderr, flush=True)
        return 1
    except LeaderFailed as err:  # rank 0 reports the cause
        print(f"mcore-rl train: error (rank {rank}): {err}", file=sys.stderr, flush=True)
        return 1
    except StopRequested as req:
        if rank == 0:
            print(f"mcore-rl: stopped on request after step {req.step}; checkpoint "
                  f"{req.checkpoint}; resume by running the same command again", flush=True)
        return stop_exit_code()
    finally:
        stop.uninstall()
        destroy_parallel(keep_process_group=False)
    return 0


def describe(cfg: RLConfig) -> str:
    """One line: the job, the trainer's layout and, for RL, its roles and placement."""
    p = cfg.parallel
    world = (p.dp or 1) * p.tp * p.pp * p.cp
    cp = f"xCP{p.cp}" if p.cp > 1 else ""
    layout = f"{world} trainer rank(s), TP{p.tp}{cp}xPP{p.pp}xDP{p.dp or 1}"
    if cfg.train.job != "rl":
        return f"{cfg.train.job}: {layout}"
    r = cfg.rollout
    replicas = f"{r.replicas} x " if r.replicas > 1 else ""
    return (f"{layout}; rollout ({replicas}{r.engine}) -> reward -> trainer, "
            f"{r.placement}, {cfg.train.schedule}")


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="run training from a YAML config")
    p.add_argument("config", help="YAML file, e.g. configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--nproc", type=int, default=None,
                   help="trainer ranks (default: tp*pp*cp*dp of the config; sets parallel.dp)")
    p.set_defaults(func=run)
