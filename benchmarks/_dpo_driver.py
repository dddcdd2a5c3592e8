"""Our side of `mcore-rl bench dpo`, in a fresh process:

    python -m mcore_rl.benchmarks._dpo_driver SPEC.json OUT.json

``SPEC.json`` (written by ``benchmarks/dpo.py``) holds a config file and its overrides
(``train.job: dpo``, already checked as ``mcore-rl train`` checks a config). The job's graph
runs on the ranks of a local world (`SharedWorld`; `mcore_rl.roles.graph.run_in_this_world`:
the trainer role, the Megatron train engine, the frozen reference, the metrics log, as
``mcore-rl train`` runs them). The one addition is a timer around the reference-cache pass
(``finetune.reference_logps: cached``), which happens before the first step and is in no
metric.

``OUT.json``: one record per optimizer step from ``metrics.jsonl`` (``time/step``, the
non-pad tokens of its batch, ``time/reference``), and the reference pass (seconds,
sequences and non-pad tokens computed) or null when the run computed none.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def pair_tokens(pair) -> int:
    """Non-pad tokens of a pair's two rows: the prompt once per side, both completions."""
    return 2 * len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids)


def rank(rank: int, world_size: int, cfg, reference_out: str) -> None:
    """One rank: the job's graph, with the reference-cache pass timed."""
    from mcore_rl.finetune import loop
    from mcore_rl.parallel import destroy_parallel
    from mcore_rl.roles.graph import run_in_this_world

    fill = loop.open_reference_cache
    measured: dict = {}

    def timed_fill(run) -> None:
        t0 = time.perf_counter()
        fill(run)
        seconds = time.perf_counter() - t0
        cache = run.reference_cache
        if cache is not None and cache.computed:
            measured.update(seconds=seconds, sequences=cache.computed,
                            tokens=sum(pair_tokens(x) for x in run.examples.records + run.val_examples))

    # The loop calls the pass by this module-level name; swapping it adds the timer and
    # leaves every other part of the run as `mcore-rl train` has it.
    loop.open_reference_cache = timed_fill
    try:
        run_in_this_world(cfg)
    finally:
        loop.open_reference_cache = fill
    if rank == 0:
        Path(reference_out).write_text(json.dumps(measured or None))
    destroy_parallel()


def step_records(log_dir: Path) -> list[dict]:
    """Per-step records of the run's metrics log. The loop logs ``perf/tokens_per_s`` =
    non-pad tokens / ``time/step``, so the step's tokens are their product (an integer)."""
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["time/step"], "tokens": round(r["perf/tokens_per_s"] * r["time/step"]),
             "reference": r["time/reference"], "reference_computed": r.get("reference/computed")}
            for r in records if "time/step" in r]


def main(argv: list[str]) -> int:
    from mcore_rl.config import load_config
    from mcore_rl.parallel.local_world import SharedWorld
    from mcore_rl.roles.rules import world_size_of

    spec = json.loads(Path(argv[0]).read_text())
    cfg = load_config(spec["config"], spec["overrides"])
    reference_out = Path(cfg.logging.dir) / "reference_pass.json"
    world = SharedWorld(world_size_of(cfg), timeout_s=3600,
                        threads_per_rank=cfg.parallel.cpu_threads_per_rank)
    try:
        world.run(rank, cfg, str(reference_out))
    finally:
        world.close()
    out = {"steps": step_records(Path(cfg.logging.dir)),
           "reference_pass": json.loads(reference_out.read_text())}
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
