"""`mcore-rl bench plan`: the planner's simulator (`mcore_rl.plan`) against real runs on this
machine, calibrated from microbenchmarks only.

1. **Calibration** (`mcore_rl.plan.calibrate`), each part in a fresh process:
   - the engine (`_engine_batching`): decode tokens/s at several batch occupancies, prefill
     tokens/s, and the natural response lengths of the task's prompts under the initial
     weights, up to the longest cap (a shorter cap truncates them);
   - the trainer: ``sync`` runs with fixed-length responses of ``--cal-lengths`` tokens, whose
     per-phase timers give the trainer's turn as a fixed part plus tokens over a rate, the
     weight sync, the reward and the rest of a step.
2. **Held-out runs**: ``mcore-rl train`` with natural response lengths (stop at
   end-of-sequence) up to each cap of ``--caps``, under each schedule (``sync``,
   ``one_step_off``, ``async`` at each K of ``--k``), with the config's placement. Measured
   as `mcore-rl bench train --schedule` measures: the median over the steady-state steps
   (after ``--warmup``, before the last) of tokens over the step's wall time.
3. **Prediction**: the simulator with the calibrated costs, for the same schedule, K,
   placement, steps and workload. Each record reads ``{"predicted", "measured", "unit",
   "error"}`` (error: predicted / measured - 1); the target is |error| <= 20% for every run.
   ``ratios``: each schedule's tokens/s against ``sync`` at the same cap, predicted and
   measured.

``--replay FILE``: recompute the costs and predictions of a recorded output (nothing runs;
the simulator as it is now against the measurements of then).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from mcore_rl.errors import UsageError
from mcore_rl.plan.scaling import FIXED_K
from mcore_rl.plan.simulator import SCHEDULES

TARGET_ERROR = 0.2
ENGINE = {"quickstart": {"prompts": 16, "occupancies": [1, 4, 16, 32], "decode_tokens": 8},
          "smollm2": {"prompts": 32, "occupancies": [1, 8, 16, 32, 64, 128], "decode_tokens": 32}}
DEFAULTS = {"quickstart": {"caps": "16", "cal_lengths": "8,16", "steps": 5, "warmup": 1},
            "smollm2": {"caps": "64,192", "cal_lengths": "32,128", "steps": 10, "warmup": 4}}
"""Per size: the engine microbenchmark, and the default caps, calibration lengths, steps and
warm-up steps (SmolLM2's trainer pays for fresh memory over its first steps: its turn
settles by the fifth)."""


def _log(msg: str) -> None:
    print(f"[bench plan] {msg}", flush=True)


def run_settings(schedules: list[str], ks: list[int]) -> list[tuple[str, int]]:
    """(schedule, K) of every held-out run: sync at 0, one_step_off at 1, async at each K."""
    out = []
    for schedule in schedules:
        if schedule == "async":
            out += [("async", k) for k in ks]
        else:
            out.append((schedule, FIXED_K[schedule]))
    return out


def predictions(report: dict) -> dict:
    """The costs and predictions of a report's calibration and runs (fills them in)."""
    from mcore_rl.plan.calibrate import calibrated_costs, predicted_tokens_per_s, trainer_costs

    s = report["settings"]
    if not report["runs"]:
        raise ValueError("it holds no held-out runs")
    steps = [step for run in report["calibration"]["trainer"] for step in run["steps"]]
    trainer = trainer_costs(steps, s["prompts_per_step"])
    by_cap = {cap: calibrated_costs(report["calibration"]["engine"], trainer, cap,
                                    s["prompts_per_step"], s["group_size"],
                                    micro_batch_tokens=s.get("micro_batch_tokens", 0))
              for cap in sorted({run["cap"] for run in report["runs"]})}
    report["costs"], records = {str(cap): c.to_dict() for cap, c in by_cap.items()}, {}
    for run in report["runs"]:
        cap, costs = run["cap"], by_cap[run["cap"]]
        predicted = predicted_tokens_per_s(costs, run["schedule"], run["k"], s["steps"],
                                           s["warmup"], placement=s["placement"])
        measured = run["measured_tokens_per_s"]
        records[f"{run['schedule']}_k{run['k']}_cap{cap}"] = {
            "predicted": predicted, "measured": measured, "unit": "tokens/s",
            "error": predicted / measured - 1.0}
    report["predictions"] = records
    ratios = {}
    for name, record in records.items():  # each schedule against sync at the same cap
        schedule_k, cap = name.rsplit("_cap", 1)
        sync = records.get(f"sync_k0_cap{cap}")
        if sync is not None and schedule_k != "sync_k0":
            predicted = record["predicted"] / sync["predicted"]
            measured = record["measured"] / sync["measured"]
            ratios[f"{schedule_k}_vs_sync_cap{cap}"] = {
                "predicted": predicted, "measured": measured, "unit": "x sync tokens/s",
                "error": predicted / measured - 1.0}
    report["ratios"] = ratios
    worst = max(records.values(), key=lambda r: abs(r["error"]))
    report["target"] = {"max_abs_error": TARGET_ERROR,
                        "worst_error": worst["error"],
                        "met": all(abs(r["error"]) <= TARGET_ERROR for r in records.values())}
    return report


def calibrate_and_run(size_name: str, caps: list[int], cal_lengths: list[int],
                      settings: list[tuple[str, int]], steps: int, warmup: int, threads: int,
                      dtype: str) -> dict:
    from mcore_rl.benchmarks._common import machine_info, run_spec_module
    from mcore_rl.benchmarks.train import SIZES, _config_path, our_overrides, run_ours, tokens_per_s
    from mcore_rl.config import load_config
    from mcore_rl.plan.calibrate import trainer_costs

    size = SIZES[size_name]
    config = _config_path(size.config)
    base = load_config(str(config), size.overrides)
    calibration: dict = {"trainer": []}
    runs = []
    with tempfile.TemporaryDirectory(prefix=f"mcore-rl-bench-plan-{size_name}-") as tmp:
        work = Path(tmp)

        def overrides_for(tag: str, cap: int, fixed: bool, n_steps: int, extra: list[str]) -> list[str]:
            at_cap = size.overrides + [f"rollout.max_new_tokens={cap}"]
            return at_cap + our_overrides(load_config(str(config), at_cap), n_steps, work / tag,
                                          threads, dtype, fixed_lengths=fixed) + extra

        for length in cal_lengths:  # the trainer's microbenchmark: fixed lengths, sync
            tag = f"cal{length}"
            _log(f"{size_name}: calibration, sync with {length}-token responses, 3 steps")
            recorded = run_ours(config, overrides_for(tag, length, True, 3, [
                "train.schedule=sync", "train.max_staleness=0"]), work / tag)
            calibration["trainer"].append({"length": length, "steps": recorded[1:]})
        trainer_costs([step for run in calibration["trainer"] for step in run["steps"]],
                      base.data.prompts_per_step)  # refuse a calibration that gives no rate now
        first = f"cal{cal_lengths[0]}"
        if base.model.path:
            from mcore_rl.models.builtin import resolve_model_path

            model_dir = resolve_model_path(base.model.path)
        else:  # the random tiny model the first calibration run started from
            model_dir = work / first / "initial_model"
        _log(f"{size_name}: calibration, the engine (decode curve, prefill, natural lengths)")
        engine_overrides = overrides_for("engine", max(caps), False, 1, [])
        calibration["engine"] = run_spec_module(
            "mcore_rl.benchmarks._engine_batching",
            {"config": str(config), "overrides": engine_overrides, "model_dir": str(model_dir),
             "static_prompts": base.data.prompts_per_step, "capacity": 0,
             "modes": ["static", "decode"], **ENGINE[size_name]}, work, "engine",
            "the engine calibration")
        for cap in caps:
            for schedule, k in settings:
                tag = f"{schedule}_k{k}_cap{cap}"
                _log(f"{size_name}: held-out run {tag}, {steps} steps")
                recorded = run_ours(config, overrides_for(tag, cap, False, steps, [
                    f"train.schedule={schedule}", f"train.max_staleness={k}"]), work / tag)
                measured = recorded[warmup:-1]
                runs.append({"cap": cap, "schedule": schedule, "k": k, "steps": recorded,
                             "measured_tokens_per_s": tokens_per_s(measured)})
    return {"benchmark": "plan", "machine": machine_info(), "size": size_name,
            "settings": {"prompts_per_step": base.data.prompts_per_step,
                         "group_size": base.rollout.n_samples_per_prompt,
                         "micro_batch_tokens": base.optimizer.micro_batch_tokens,
                         "placement": base.rollout.placement, "steps": steps, "warmup": warmup,
                         "threads": threads, "dtype": dtype, "caps": caps,
                         "calibration_lengths": cal_lengths},
            "calibration": calibration, "runs": runs}


def _ints(option: str, text: str, low: int = 1) -> list[int]:
    """Distinct integers >= ``low``, in the order given."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise UsageError(f"{option} {text!r}: give comma-separated integers >= {low}")
    return list(dict.fromkeys(values))


def main(argv: list[str] | None = None) -> int:
    from mcore_rl.benchmarks._common import rounded, write_json

    parser = argparse.ArgumentParser(prog="mcore-rl bench plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="output JSON path")
    parser.add_argument("--size", default="smollm2", choices=sorted(ENGINE))
    parser.add_argument("--caps", help="response-length caps of the held-out runs (natural "
                                       "lengths up to each), comma-separated")
    parser.add_argument("--cal-lengths", help="fixed response lengths of the trainer's "
                                              "calibration runs (at least two), comma-separated")
    parser.add_argument("--schedule", default="sync,one_step_off,async",
                        help="schedules of the held-out runs, comma-separated")
    parser.add_argument("--k", default="1,2", help="max staleness K of the async runs")
    parser.add_argument("--steps", type=int, help="steps of each held-out run")
    parser.add_argument("--warmup", type=int, help="steps left out at the start "
                                                   "(default per size)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--replay", help="recompute the predictions of a recorded output "
                                         "(runs nothing)")
    args = parser.parse_args(argv)
    if args.replay:
        path = Path(args.replay)
        if not path.is_file():
            raise UsageError(f"--replay {args.replay}: no such file; give a `bench plan` output")
        try:
            report = json.loads(path.read_text())
            report = predictions(report)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:  # JSON errors too
            raise UsageError(f"--replay {args.replay} is not a `bench plan` output "
                             f"({type(err).__name__}: {err})") from None
    else:
        defaults = DEFAULTS[args.size]
        caps = _ints("--caps", args.caps or defaults["caps"])
        cal_lengths = _ints("--cal-lengths", args.cal_lengths or defaults["cal_lengths"])
        if len(set(cal_lengths)) < 2:
            raise UsageError(f"--cal-lengths {args.cal_lengths}: give at least two different "
                             "lengths (the trainer's fixed part and rate need two)")
        schedules = [s.strip() for s in args.schedule.split(",") if s.strip()]
        unknown = [s for s in schedules if s not in SCHEDULES]
        if unknown or not schedules:
            raise UsageError(f"--schedule {args.schedule!r}: choose among {', '.join(SCHEDULES)}")
        ks = _ints("--k", args.k, low=0)
        steps = args.steps or defaults["steps"]
        warmup = defaults["warmup"] if args.warmup is None else args.warmup
        if warmup < 1 or steps - warmup < 2:
            raise UsageError(f"--steps {steps} --warmup {warmup}: keep --warmup >= 1 (the "
                             "first step has no interval) and two steps after it")
        report = predictions(calibrate_and_run(args.size, caps, cal_lengths,
                                               run_settings(schedules, ks), steps, warmup,
                                               args.threads, args.dtype))
    write_json(args.json, rounded(report, 6))
    for name, r in report["predictions"].items():
        _log(f"{name}: predicted {r['predicted']:.1f} tokens/s, measured {r['measured']:.1f}, "
             f"error {r['error']:+.0%}")
    _log(f"worst error {report['target']['worst_error']:+.0%} (target within "
         f"{TARGET_ERROR:.0%}: {'met' if report['target']['met'] else 'not met'}); "
         f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
