"""`mcore-rl train CONFIG [overrides] [--nproc N]`: run training.

On one machine ``--nproc N`` starts N ranks itself; under torchrun or SLURM the launcher's
environment decides. The config is validated against the world size before any rank starts.
"""
from __future__ import annotations

from mcore_rl.config import load_config, validate_config
from mcore_rl.config.loader import config_to_dict
from mcore_rl.errors import UsageError
from mcore_rl.rewards.reward_model import ON_RANK_LOOP, REWARD_MODEL


def run(args) -> int:
    from mcore_rl.parallel.local_launch import adopt_slurm_environment, launcher_world_size, run_ranks

    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}; give the number of local ranks "
                         "to start, or leave it out for tp*pp*dp of the config")
    cfg = load_config(args.config, args.overrides)
    launched = launcher_world_size()
    rank_loop = launched is not None or cfg.rollout.in_trainer  # not the dataflow graph
    if rank_loop and cfg.train.job == "rl" and cfg.reward.name == REWARD_MODEL:
        raise UsageError(ON_RANK_LOOP)
    if launched is not None and args.nproc not in (None, launched):
        raise UsageError(f"--nproc {args.nproc} conflicts with the launcher's world size {launched}; "
                         "drop --nproc under torchrun/SLURM")
    world = launched or args.nproc or (cfg.parallel.dp or 1) * cfg.parallel.tp * cfg.parallel.pp
    validate_config(cfg, world_size=world)
    if cfg.train.job == "rl":
        from mcore_rl.rl.setup import check_job

        check_job(cfg)
    elif cfg.train.job != "smoke":
        from mcore_rl.finetune.check import check_finetune_job

        check_finetune_job(cfg)
    else:
        from mcore_rl.train.run_checkpoints import RunCheckpoints

        RunCheckpoints.for_config(cfg).resolve_resume(cfg.checkpoint.resume, ["model"],
                                                      cfg.logging.dir)
    from mcore_rl.cli.rank_main import rank_main, rank_main_from_dict

    if launched is not None and cfg.train.job == "rl" and cfg.train.schedule != "sync":
        raise UsageError(f"train.schedule={cfg.train.schedule} runs on the dataflow runtime, not on "
                         "torchrun/srun ranks: run mcore-rl train without a launcher, or "
                         "mcore-rl launch slurm CONFIG --ray")
    if not rank_loop and cfg.train.job == "rl":
        from mcore_rl.cli.train_graph import run_graph

        return run_graph(cfg)
    if launched is not None:
        adopt_slurm_environment()
        rank_main(cfg)
    else:
        run_ranks(rank_main_from_dict, (config_to_dict(cfg),), nproc=world,
                  threads_per_rank=cfg.parallel.cpu_threads_per_rank)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="run training from a YAML config")
    p.add_argument("config", help="YAML file, e.g. configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to start (default: tp*pp*dp of the config)")
    p.set_defaults(func=run)
