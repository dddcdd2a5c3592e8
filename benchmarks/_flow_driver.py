"""One run of `mcore-rl bench flow`, in a fresh process: ``python -m
mcore_rl.benchmarks._flow_driver SPEC OUT``. SPEC (JSON): config, overrides, steps, mode:

- ``fused``, ``cli``, ``graph``: the job's graph launched as ``mcore-rl train`` launches it
  (`mcore_rl.roles.graph.run_job`), with ``rollout.placement: fused``, the config's own
  placement, or ``train.schedule: one_step_off`` beside the trainer;
- ``api``: `RLTrainer` driven step by step from this process.

OUT: per-step timings, and for the launches their stats (round trips per step, per role)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path


def prompt_batches(cfg, steps: int) -> list[list[dict]]:
    """The prompts ``mcore-rl train`` would take for ``steps`` steps, as API prompts."""
    from mcore_rl.data.prompts import PromptStream, load_prompt_records

    stream = PromptStream(load_prompt_records(cfg.data, "train"), cfg.data.seed)
    return [[{"prompt": r.prompt, **r.meta} for r in stream.take(cfg.data.prompts_per_step)]
            for _ in range(steps)]


def run_api(cfg, steps: int) -> dict:
    from mcore_rl import RLTrainer
    from mcore_rl.rewards import REWARDS, score_all

    reward = REWARDS.get(cfg.reward.name)
    out = []
    with RLTrainer(config=cfg) as trainer:
        for prompts in prompt_batches(cfg, steps):
            t0 = time.perf_counter()
            rollouts = trainer.sample(prompts)
            t1 = time.perf_counter()
            rollouts["reward"] = score_all(reward, rollouts["prompt"], rollouts["response"],
                                           [{"prompt": p, **m} for p, m in
                                            zip(rollouts["prompt"], rollouts["meta"])])
            t2 = time.perf_counter()
            metrics = trainer.update(rollouts)
            t3 = time.perf_counter()
            out.append({"step": t3 - t0, "sample": t1 - t0, "score": t2 - t1, "update": t3 - t2,
                        "update_in_ranks": metrics["time/step"], "tokens": metrics["perf/tokens"]})
    return {"steps": out}


def run_launch(cfg, steps: int) -> dict:
    """The job's graph; per step its wall time as the graph runs it (``time/batch_interval``,
    hops included; the first step has none) and the launch's stats."""
    from mcore_rl.roles.graph import run_job
    from mcore_rl.roles.rules import check_runnable, world_size_of

    stats = run_job(check_runnable(cfg, world_size_of(cfg)))
    history = [json.loads(line) for line in (Path(cfg.logging.dir) / "metrics.jsonl")
               .read_text().splitlines()]
    steps_out = [{"step": h["time/batch_interval"], "tokens": h["perf/tokens"],
                  "update": h["time/update"], "staleness": h.get("rollout/staleness_max", 0.0)}
                 for h in history if "time/batch_interval" in h]
    return {"steps": steps_out, "roles": {r: s.as_dict() for r, s in stats.roles.items()},
            "round_trips_per_step": stats.round_trips_per_step, "table": stats.table()}


def main() -> None:
    from mcore_rl.config import load_config

    spec = json.loads(Path(sys.argv[1]).read_text())
    cfg = load_config(spec["config"], spec["overrides"])
    mode = spec["mode"]
    if mode == "fused":
        cfg = replace(cfg, rollout=replace(cfg.rollout, placement="fused"))
    elif mode == "graph":
        cfg = replace(cfg, train=replace(cfg.train, schedule="one_step_off", max_staleness=1),
                      rollout=replace(cfg.rollout, placement="separate"))
    result = run_api(cfg, spec["steps"]) if mode == "api" else run_launch(cfg, spec["steps"])
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
