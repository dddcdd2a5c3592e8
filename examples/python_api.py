"""GRPO on the quick-start task, driven from a plain Python script.

    .venv/bin/python examples/python_api.py                    # TP2, 30 steps (a few minutes)
    .venv/bin/python examples/python_api.py --pp 2 --steps 10

The script is the driver: `RLTrainer` starts the trainer's ranks as Ray actors (here two,
for TP2 or PP2) with the real vLLM engine beside rank 0, and this file decides what a
step is: which prompts, which reward. The reward below is ordinary Python on the driver.
"""
from __future__ import annotations

import argparse
import random

from mcore_rl import RLTrainer


def addition_prompts(rng: random.Random, k: int) -> list[dict]:
    """``k`` single-digit sums as prompts, each with its answer for the reward."""
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(k)]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def exact_match(rollouts) -> list[float]:
    return [1.0 if response.strip() == meta["answer"] else 0.0
            for response, meta in zip(rollouts["response"], rollouts["meta"])]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--logdir", default="runs/python_api")
    p.add_argument("overrides", nargs="*", help="section.field=value, as on the command line")
    args = p.parse_args(argv)

    overrides = [f"parallel.tp={args.tp}", f"parallel.pp={args.pp}",
                 f"logging.dir={args.logdir}", f"checkpoint.dir={args.logdir}/checkpoints",
                 *(["model.num_layers=4"] if args.pp > 1 else []), *args.overrides]
    rng = random.Random(0)
    with RLTrainer.from_config("configs/quickstart.yaml", overrides) as trainer:
        scores = {0: trainer.validate()}
        print(f"step 0: greedy validation {scores[0]:.2f}", flush=True)
        for step in range(1, args.steps + 1):
            rollouts = trainer.sample(addition_prompts(rng, 16))        # 8 responses each
            rollouts["reward"] = exact_match(rollouts)
            stats = trainer.update(rollouts)
            print(f"step {step}: reward {stats['reward/mean']:.3f}  weights v"
                  f"{max(rollouts['weight_version'])}  loss {stats['actor/loss']:.4f}", flush=True)
            if step % args.val_every == 0 or step == args.steps:
                scores[step] = trainer.validate()
                print(f"step {step}: greedy validation {scores[step]:.2f}", flush=True)
        trainer.save()
    first, last = scores[0], scores[max(scores)]
    print(f"validation {first:.2f} -> {last:.2f}", flush=True)
    return {"validation": scores}


if __name__ == "__main__":
    main()
