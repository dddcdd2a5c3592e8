"""`mcore-rl bench flow`: what the hops between controllers cost an RL step, against the
same graph with every role fused into the trainer's ranks.

In one run, on the same config, prompts, reward and threads, each in a fresh process, each
the job's graph as ``mcore-rl train`` launches it:

- **fused** (the baseline): ``rollout.placement: fused``, rollout and reward in line in the
  trainer's first rank, the engine in its process: no Ray round trip per step;
- **cli**: the config's placement (colocated by default): the rollout a controller of its
  own, the synchronous schedule (whose reward scores in the trainer's first rank);
- **api**: the same steps driven from a script through `RLTrainer` (each step a ``sample``
  call, the reward on the driver, an ``update`` call), timed on the driver;
- **graph**: ``train.schedule: one_step_off`` (the rollout of step k+1 generated while step
  k trains, ``rollout.placement: separate``).

Per step: the wall time as the graph runs it (``time/batch_interval``, hops included) and
the Ray round trips the runtime counted (`FlowStats.round_trips_per_step`).

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
from mcore_rl.benchmarks.train import _config_path, our_overrides
from mcore_rl.errors import UsageError


def _log(msg: str) -> None:
    print(f"[bench flow] {msg}", flush=True)


def run_driver(mode: str, config: Path, overrides: list[str], steps: int, work: Path) -> dict:
    spec = {"config": str(config), "overrides": overrides, "steps": steps, "mode": mode}
    return run_spec_module("mcore_rl.benchmarks._flow_driver", spec, work, mode, f"the {mode} run")


_median = median_of
MODES = ("fused", "cli", "api", "graph")


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
                        "fused is the baseline of every comparison but one_step_off_vs_sync")
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
            runs[mode] = run_driver(mode, config, overrides, steps, work)
    measured = {m: runs[m]["steps"][warmup:] for m in runs}
    for m in ("fused", "cli", "graph"):  # launches' intervals start at step 2
        if m in runs:
            measured[m] = runs[m]["steps"][max(0, warmup - 1):]
    step = {m: _median(measured[m], "step") for m in runs}
    comparisons = {"cli_vs_fused": ("cli", "fused"), "api_vs_fused": ("api", "fused"),
                   "one_step_off_vs_fused": ("graph", "fused"), "one_step_off_vs_sync": ("graph", "cli")}
    report["step_time"] = {name: time_comparison(step[ours], step[base])
                           for name, (ours, base) in comparisons.items() if ours in runs and base in runs}
    if "api" in runs:
        api = measured["api"]
        # What an update call costs beyond its phases in the ranks: the Ray calls, the batch
        # through the object store, the driver.
        report["api_update_call_overhead_s"] = _median(api, "update") - _median(api, "update_in_ranks")
        report["api_phases_s"] = {k: _median(api, k) for k in ("sample", "score", "update")}
    report["tokens_per_step"] = {m: _median(runs[m]["steps"], "tokens") for m in runs}
    report["round_trips_per_step"] = {m: runs[m]["round_trips_per_step"] for m in runs
                                      if "round_trips_per_step" in runs[m]}
    report["steps_measured"] = {m: len(measured[m]) for m in runs}
    for m in ("cli", "graph"):
        if m in runs:
            report[f"{m}_roles"] = runs[m]["roles"]
    out = write_json(args.json, rounded(report))
    names = {"fused": "fused", "cli": "mcore-rl train", "api": "api", "graph": "one step off"}
    _log("step time: " + ", ".join(f"{names[m]} {step[m]:.3f} s" for m in runs) + f"; {out}")
    for m in ("cli", "graph"):
        if m in runs:
            print(f"{names[m]}:\n{runs[m]['table']}", flush=True)
    return 0
