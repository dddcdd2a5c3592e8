"""GRPO from a driver script on a SLURM allocation, through Ray, and able to be preempted.

    mcore-rl launch slurm --nodes 2 --cpus-per-node 4 --partition debug \\
        --run-dir runs/slurm_grpo examples/slurm_grpo.py -- --steps 30

The job starts a Ray head on the first node and a Ray worker on every other one, then runs
this script once, on the first node, with ``RAY_ADDRESS`` set: `RLTrainer` joins that Ray,
and its ranks are spread over the nodes. The script also runs on one machine without SLURM
(``.venv/bin/python examples/slurm_grpo.py --steps 4``), on a local Ray.

Preemption: SLURM's signal reaches this process (SIGTERM), or the batch shell turns it into
the stop file (SIGUSR1). Between two steps the script checks for either, saves a checkpoint,
acknowledges it and exits with the requeue status; the requeued job runs the script again,
the trainer resumes from the latest checkpoint (``checkpoint.resume=auto``) and the loop
continues after the step it resumed at. Prompts are drawn from a generator seeded by the
step, so a resumed run sees the prompts the uninterrupted one would have.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from mcore_rl import RLTrainer
from mcore_rl.launch.stop_signal import StopSignal, stop_exit_code

sys.path.insert(0, str(Path(__file__).resolve().parent))
from python_api import addition_prompts, exact_match  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--logdir", default=os.environ.get("MCORE_RL_RUN_DIR", "runs/slurm_grpo"),
                   help="run directory (default: the job's --run-dir under SLURM)")
    p.add_argument("overrides", nargs="*", help="section.field=value, as on the command line")
    args = p.parse_args(argv)

    logdir = Path(args.logdir).resolve()
    overrides = [f"parallel.tp={args.tp}", f"logging.dir={logdir}",
                 f"checkpoint.dir={logdir}/checkpoints", "checkpoint.resume=auto",
                 *args.overrides]
    with RLTrainer.from_config(REPO / "configs" / "quickstart.yaml", overrides) as trainer:
        stop = StopSignal().install()  # after Ray's start, which sets its own SIGTERM handler
        first = trainer.step + 1
        ranks = [{"node": node, "pid": pid} for node, pid in trainer.rank_processes]
        print(f"driver: ranks {ranks}; steps {first}..{args.steps}", flush=True)
        (logdir / f"driver-{first}.json").write_text(json.dumps({"first_step": first,
                                                                 "ranks": ranks}))
        for step in range(first, args.steps + 1):
            if stop.requested_here():
                path = trainer.save()
                stop.write_ack(trainer.step)
                print(f"driver: stopped on request after step {trainer.step}; checkpoint {path}",
                      flush=True)
                return stop_exit_code()
            rollouts = trainer.sample(addition_prompts(random.Random(step), args.prompts_per_step))
            rollouts["reward"] = exact_match(rollouts)
            stats = trainer.update(rollouts)
            print(f"step {step}: reward {stats['reward/mean']:.3f}  loss "
                  f"{stats['actor/loss']:.4f}", flush=True)
        print(f"driver: finished step {trainer.step}; greedy validation {trainer.validate():.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
