"""The new runtime's side of `mcore-rl bench flow`, in a fresh process: ``python -m
mcore_rl.benchmarks._flow_driver SPEC OUT``. SPEC (JSON): config, overrides, steps, mode
(``api``: `RLTrainer` driven step by step from this process; ``graph``: a rollout ->
reward -> trainer `launch`). OUT: per-step timings and the launch's stats."""
from __future__ import annotations

import json
import sys
import time
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


def run_graph(cfg, steps: int) -> dict:
    """The RL graph with ``train.schedule: one_step_off`` (the engine beside the trainer)."""
    from dataclasses import replace

    from mcore_rl.api.rl_graph import run_rl_graph

    cfg = replace(cfg, train=replace(cfg.train, schedule="one_step_off", max_staleness=1),
                  rollout=replace(cfg.rollout, placement="separate"))
    stats = run_rl_graph(cfg)
    history = [json.loads(line) for line in (Path(cfg.logging.dir) / "metrics.jsonl")
               .read_text().splitlines()]
    steps_out = [{"step": h["time/batch_interval"], "tokens": h["perf/tokens"],
                  "update": h["time/update"], "staleness": h["rollout/staleness_max"]}
                 for h in history if "time/batch_interval" in h]
    return {"steps": steps_out, "roles": {r: s.as_dict() for r, s in stats.roles.items()},
            "table": stats.table()}


def loop_rank(cfg_data: dict) -> None:
    """One rank of the SPMD loop (spawned by `run_ranks`)."""
    from mcore_rl.config import RLConfig
    from mcore_rl.config.loader import _build
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.trainer import train

    cfg = _build(RLConfig, cfg_data, "")
    ctx = initialize_parallel(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.train.seed)
    train(cfg, ctx)
    destroy_parallel(keep_process_group=False)


def run_loop(cfg, steps: int) -> dict:
    """The RL loop as one SPMD program over the trainer's ranks (the engine beside rank 0),
    as ``mcore-rl train`` ran it before the dataflow runtime and still does under torchrun
    or srun: the per-step ``time/step`` of its metrics."""
    from mcore_rl.config.loader import config_to_dict
    from mcore_rl.parallel.local_launch import run_ranks

    p = cfg.parallel
    run_ranks(loop_rank, (config_to_dict(cfg),), nproc=(p.dp or 1) * p.tp * p.pp,
              threads_per_rank=p.cpu_threads_per_rank)
    history = [json.loads(line) for line in (Path(cfg.logging.dir) / "metrics.jsonl")
               .read_text().splitlines()]
    return {"steps": [{"step": h["time/step"], "tokens": h["perf/tokens"]}
                      for h in history if "time/step" in h]}


def main() -> None:
    from mcore_rl.config import load_config

    spec = json.loads(Path(sys.argv[1]).read_text())
    cfg = load_config(spec["config"], spec["overrides"])
    run = {"api": run_api, "graph": run_graph, "loop": run_loop}[spec["mode"]]
    result = run(cfg, spec["steps"])
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
