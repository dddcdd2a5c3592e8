"""`mcore-rl bench flow`: what the dataflow runtime costs an RL step, against the SPMD loop.

In one run, on the same config, prompts, reward and threads, each in a fresh process:

- **loop** (the baseline): the RL loop as one SPMD program over the trainer's ranks, the
  engine beside rank 0 (how ``mcore-rl train`` runs under torchrun or srun), its
  per-step ``time/step``;
- **cli**: ``mcore-rl train``, the loop as a rollout -> reward -> trainer graph on Ray with
  the synchronous schedule, the wall time per step (``time/batch_interval``: hops between
  the controllers included);
- **api**: the same steps driven from a script through `RLTrainer` (ranks are Ray actors;
  each step a ``sample`` call, the reward on the driver, an ``update`` call), timed on the
  driver;
- **graph**: ``mcore-rl train`` with ``train.schedule: one_step_off`` (the rollout of step
  k+1 generated while step k trains, ``rollout.placement: separate``): its wall time per
  trained batch, and the launch's blocked times per role.

Figures are medians over the steps after ``--warmup``. ``--quick``: few steps (for tests).
Config overrides after the options (``key=value``, as ``mcore-rl train`` takes them) apply to
every run, e.g. ``rollout.engine=hf``.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from mcore_rl.benchmarks._common import (machine_info, median_of, rounded, run_spec_module,
                                         time_comparison, write_json)
from mcore_rl.benchmarks.train import _config_path, our_overrides, run_ours
from mcore_rl.errors import UsageError


def _log(msg: str) -> None:
    print(f"[bench flow] {msg}", flush=True)


def run_driver(mode: str, config: Path, overrides: list[str], steps: int, work: Path) -> dict:
    spec = {"config": str(config), "overrides": overrides, "steps": steps, "mode": mode}
    return run_spec_module("mcore_rl.benchmarks._flow_driver", spec, work, mode, f"the {mode} run")


_median = median_of
MODES = ("loop", "cli", "api", "graph")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mcore-rl bench flow", description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="output JSON path")
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads in all per run")
    p.add_argument("--quick", action="store_true", help="4 steps, 1 warm-up (for tests)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated runs to measure, of {', '.join(MODES)} (default: all); "
                        "loop is the baseline of every comparison but one_step_off_vs_sync")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides for every run (e.g. rollout.engine=hf)")
    args = p.parse_args(argv)
    steps, warmup = (4, 1) if args.quick else (args.steps, args.warmup)
    if steps <= warmup + 1:
        raise UsageError(f"--steps {steps} leaves too few steps after --warmup {warmup}; "
                         f"give at least {warmup + 2}")
    modes = [m for m in MODES if m in args.modes.split(",")]
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown or not modes:
        raise UsageError(f"--modes {args.modes}: choose among {', '.join(MODES)}")
    from mcore_rl.config import load_config

    config = _config_path(args.config)
    cfg = load_config(str(config), args.overrides)  # a bad override fails here, before any run
    report: dict = {"machine": machine_info(), "config": args.config, "overrides": args.overrides,
                    "steps": steps, "warmup": warmup}
    with tempfile.TemporaryDirectory(prefix="mcore-rl-bench-flow-") as tmp:
        work = Path(tmp)
        runs = {}
        for mode in modes:
            overrides = [*args.overrides,
                         *our_overrides(cfg, steps, work / mode, args.threads, "fp32")]
            _log(f"{mode}: {steps} steps")
            if mode == "cli":
                runs[mode] = {"steps": run_ours(config, overrides, work / mode)}
            else:
                runs[mode] = run_driver(mode, config, overrides, steps, work)
    measured = {m: runs[m]["steps"][warmup:] for m in runs}
    if "graph" in runs:  # its intervals start at step 2
        measured["graph"] = runs["graph"]["steps"][max(0, warmup - 1):]
    step = {m: _median(measured[m], "step") for m in runs}
    comparisons = {"cli_vs_loop": ("cli", "loop"), "api_vs_loop": ("api", "loop"),
                   "one_step_off_vs_loop": ("graph", "loop"), "one_step_off_vs_sync": ("graph", "cli")}
    report["step_time"] = {name: time_comparison(step[ours], step[base])
                           for name, (ours, base) in comparisons.items() if ours in runs and base in runs}
    if "api" in runs:
        api = measured["api"]
        # What an update call costs beyond its phases in the ranks: the Ray calls, the batch
        # through the object store, the driver.
        report["api_update_call_overhead_s"] = _median(api, "update") - _median(api, "update_in_ranks")
        report["api_phases_s"] = {k: _median(api, k) for k in ("sample", "score", "update")}
    report["tokens_per_step"] = {m: _median(runs[m]["steps"], "tokens") for m in runs}
    report["steps_measured"] = {m: len(measured[m]) for m in runs}
    if "graph" in runs:
        report["graph_roles"] = runs["graph"]["roles"]
        report["graph_table"] = runs["graph"]["table"]
    out = write_json(args.json, rounded(report))
    names = {"loop": "loop", "cli": "mcore-rl train", "api": "api", "graph": "one step off"}
    _log("step time: " + ", ".join(f"{names[m]} {step[m]:.3f} s" for m in runs) + f"; {out}")
    if "graph" in runs:
        print(runs["graph"]["table"], flush=True)
    return 0
