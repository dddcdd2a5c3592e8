"""A driver for `mcore-rl launch slurm --ray` in tests: a flow launch on the job's Ray whose
one controller runs a 4-rank worker group; every rank records where it runs (its Ray node
id, its pid) in ``$MCORE_RL_RUN_DIR/ranks.jsonl``. With ``--fail`` the driver then exits
with status 1, as a failing driver would."""
import json
import os
import sys
from pathlib import Path

from mcore_rl.flow import Controller, ControllerGroup, launch, ray_shim

RANKS = 4


class Where:
    """Appends this rank's place to the run directory's ranks.jsonl (one line per call)."""

    def __call__(self, item):
        import torch.distributed as dist

        record = {"rank": dist.get_rank(), "node": ray_shim.node_id(), "pid": os.getpid()}
        with open(Path(os.environ["MCORE_RL_RUN_DIR"]) / "ranks.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> int:
    group = ControllerGroup([Controller("where", Where, num_workers=RANKS,
                                        strategy="worker_group")])
    stats = launch(group, data=[0])
    print(f"driver: launch done, {stats.instances[0].items_in} item(s)", flush=True)
    return 1 if "--fail" in sys.argv[1:] else 0


if __name__ == "__main__":
    raise SystemExit(main())
