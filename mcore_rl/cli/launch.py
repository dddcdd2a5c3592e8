"""`mcore-rl launch`: start training on a cluster (SLURM)."""
from __future__ import annotations

from mcore_rl.errors import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="submit training to a cluster (SLURM)")
    p.add_argument("scheduler", choices=["slurm"], help="cluster scheduler")

    def run(args) -> int:
        raise UsageError("`mcore-rl launch slurm` is not available yet; run `mcore-rl train "
                         "CONFIG --nproc N` on one machine, or torchrun mcore-rl train CONFIG")

    p.set_defaults(func=run)
