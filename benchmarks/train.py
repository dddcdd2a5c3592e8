"""`mcore-rl bench train`: RL steps per second of `mcore-rl train` vs TRL's ``GRPOTrainer``.

In one run, per size, both frameworks train GRPO from the same initial weights on the same
prompts, reward, group size, response length, KL coefficient, loss aggregation, clip range,
optimizer settings and threads, each in a fresh process:

- **ours**: ``mcore-rl train CONFIG`` (the real loop: vLLM generation, reward, Megatron
  log-probs and update, weight sync into the engine), its per-step ``time/*`` metrics;
- **baseline**: TRL ``GRPOTrainer`` (``benchmarks/_trl_grpo.py``; HF ``generate`` on the
  trained model, HF forward/backward), timed per phase the same way.

Precision (``--dtype``) is the same on both sides: fp32, or bf16 mixed precision (ours: bf16
parameters with fp32 main parameters in the optimizer and vLLM in bf16; TRL: ``bf16=True``,
autocast over fp32 weights). Responses have a fixed length on both sides (stop tokens masked until ``max_new_tokens``), so
both process the same number of tokens per step. Figures are medians over the steps after
``--warmup`` steps (the first steps pay for compilation and allocation). Tokens are prompt +
response tokens of the step. Per-phase comparisons: generate, score, logprobs (reference /
old log-probs and advantages), update; the weight sync exists only on our side (TRL
generates with the trained model itself) and is reported on its own.

Sizes: ``quickstart`` (the quick start's tiny model and task: compute is negligible, so the
step time shows our fixed per-step overhead) and ``smollm2`` (SmolLM2-135M-Instruct on
reasoning-gym arithmetic with 128-token responses; target: >= 1.5x TRL's tokens/s).
``--quick``: the quickstart size with few steps (for tests).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from mcore_rl.benchmarks._common import (machine_info, median_of, rounded, run_spec_module,
                                         throughput_comparison, time_comparison, write_json)
from mcore_rl.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "logprobs", "update")
OUR_PHASES = {"logprobs": ("logprobs", "kl_penalty", "advantages")}
"""Our ``time/*`` metrics summed into a compared phase: TRL's log-prob phase also computes
the KL penalty and the advantages (every other phase has one metric of its name)."""
TARGET_SPEEDUP = {"smollm2": 1.5}
SCHEDULE_METRICS = {"trainer_idle_s": "time/trainer_idle_s", "engine_idle_s": "time/engine_idle_s",
                    "engine_occupancy": "engine/occupancy", "length_p50": "response/length_p50",
                    "length_p90": "response/length_p90", "length_max": "response/length_max",
                    "staleness_max": "rollout/token_staleness_max"}
"""Per-step metrics kept where a run logs them (`mcore-rl bench train --schedule`)."""


@dataclass
class Size:
    config: str
    """Config file (relative to the repository root, or a path)."""
    overrides: list[str] = field(default_factory=list)
    steps: int = 4
    warmup: int = 1
    extra: list[str] = field(default_factory=list)
    """Overrides given with ``--set``: applied after the benchmark's own settings."""


SIZES = {
    "quickstart": Size("configs/quickstart.yaml", steps=8, warmup=2),
    "smollm2": Size("configs/smollm2_grpo.yaml", ["data.prompts_per_step=4", "rollout.max_new_tokens=128"],
                    steps=4, warmup=1),
}


def _log(msg: str) -> None:
    print(f"[bench train] {msg}", flush=True)


def _config_path(config: str) -> Path:
    for path in (Path(config), REPO / config):
        if path.is_file():
            return path
    raise UsageError(f"config '{config}' not found (run from the repository root or pass --config)")


def our_overrides(cfg, steps: int, log_dir: Path, threads: int, dtype: str,
                  fixed_lengths: bool = True) -> list[str]:
    """The benchmark's changes to a training config: fixed-length responses (unless
    ``fixed_lengths`` is off: then they end at end-of-sequence), no warm start, validation,
    samples, TensorBoard or intermediate checkpoints, all cores for the ranks."""
    world = cfg.parallel.tp * cfg.parallel.pp * (cfg.parallel.dp or 1)
    fixed = [f"rollout.min_new_tokens={cfg.rollout.max_new_tokens}"] if fixed_lengths else []
    return [f"train.steps={steps}", "train.warm_start_steps=0", "train.val_every=0",
            "checkpoint.save_every=0", "checkpoint.resume=never", "logging.samples_every=0",
            "logging.backends=[jsonl]", "logging.progress_bar=false", f"logging.dir={log_dir}",
            *fixed, f"parallel.cpu_threads_per_rank={max(1, threads // world)}",
            f"model.dtype={dtype}"]


def run_ours(config: Path, overrides: list[str], log_dir: Path) -> list[dict]:
    """``mcore-rl train`` in a fresh process; the per-step records of its metrics log."""
    cmd = [sys.executable, "-m", "mcore_rl.cli.main", "train", str(config), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"mcore-rl train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    steps = []
    for r in records:
        if "time/step" not in r:
            continue
        # The wall time of the step where the run measured it (the dataflow runtime: hops
        # between its controllers included); else the sum of its phases.
        steps.append({"step": r.get("time/batch_interval", r["time/step"]),
                      **{p: sum(r.get(f"time/{m}", 0.0) for m in OUR_PHASES.get(p, (p,)))
                         for p in PHASES},
                      "values": r.get("time/values", 0.0), "sync": r.get("time/sync", 0.0),
                      "engine_sleep": r.get("time/engine_sleep", 0.0),
                      "tokens": r["perf/tokens"], "responses": r["perf/responses"],
                      **{key: r[metric] for key, metric in SCHEDULE_METRICS.items() if metric in r}})
    return steps


def trl_spec(cfg, model_dir: Path, out_dir: Path, steps: int, threads: int) -> dict:
    """What `_trl_grpo` needs to train the same way as ``cfg``."""
    from mcore_rl.data.prompts import load_prompt_records
    from mcore_rl.data.tokenizer import CharTokenizer, load_tokenizer

    a, o, r = cfg.algorithm, cfg.optimizer, cfg.rollout
    if a.advantage_estimator != "grpo" or a.ppo_epochs != 1 or a.mini_batches != 1:
        raise UsageError("bench train compares GRPO with one epoch over one mini-batch "
                         f"(got {a.advantage_estimator}, ppo_epochs={a.ppo_epochs}, "
                         f"mini_batches={a.mini_batches})")
    tokenizer = load_tokenizer(model_dir)
    records = load_prompt_records(cfg.data, "train")
    longest = max(len(tokenizer.encode_prompt(x.prompt, cfg.data.apply_chat_template)) for x in records)
    batch = cfg.data.prompts_per_step * r.n_samples_per_prompt
    per_micro = max(1, o.micro_batch_tokens // (longest + r.max_new_tokens))
    micro = max(d for d in range(1, batch + 1) if batch % d == 0 and d <= per_micro)
    return {
        "model_dir": str(model_dir), "output_dir": str(out_dir), "threads": threads,
        "tokenizer": "char" if (model_dir / CharTokenizer.FILE).exists() else "hf",
        "records": [{"prompt": x.prompt, "meta": x.meta} for x in records],
        "chat": cfg.data.apply_chat_template and bool(getattr(getattr(tokenizer, "tok", None),
                                                              "chat_template", None)),
        "reward": cfg.reward.name,
        "seed": cfg.train.seed, "steps": steps, "prompts_per_step": cfg.data.prompts_per_step,
        "num_generations": r.n_samples_per_prompt, "micro_batch": micro,
        "max_new_tokens": r.max_new_tokens, "min_new_tokens": r.min_new_tokens,
        "temperature": r.temperature, "lr": o.lr, "weight_decay": o.weight_decay,
        "adam_beta1": o.adam_beta1, "adam_beta2": o.adam_beta2, "adam_eps": o.adam_eps,
        "clip_grad": o.clip_grad, "kl_coef": a.kl_coef,
        "loss_type": {"token_mean": "dapo", "seq_mean": "grpo"}[a.loss_aggregation],
        "clip_low": a.clip_ratio_low, "clip_high": a.clip_ratio_high,
        "bf16": cfg.model.dtype == "bf16",
    }


def run_trl(spec: dict, work: Path) -> list[dict]:
    return run_spec_module("mcore_rl.benchmarks._trl_grpo", spec, work, "trl", "TRL GRPOTrainer")


_median = median_of


def tokens_per_s(steps: list[dict]) -> float:
    """The median over per-step records of tokens over the step's wall time."""
    return statistics.median(s["tokens"] / s["step"] for s in steps)


def compare(ours: list[dict], trl: list[dict], warmup: int) -> dict:
    ours, trl = ours[warmup:], trl[warmup:]
    if not ours or not trl:
        raise RuntimeError("no steps left after the warm-up steps; raise --steps")
    return {
        "steps_measured": {"ours": len(ours), "baseline": len(trl)},
        "tokens_per_step": {"ours": _median(ours, "tokens"), "baseline": _median(trl, "tokens"),
                            "unit": "tokens"},
        "responses_per_step": {"ours": _median(ours, "responses"), "baseline": _median(trl, "responses"),
                               "unit": "responses"},
        "tokens_per_s": throughput_comparison(tokens_per_s(ours), tokens_per_s(trl), "tokens/s"),
        "step_time": time_comparison(_median(ours, "step"), _median(trl, "step")),
        "phases": {p: time_comparison(_median(ours, p), _median(trl, p)) for p in PHASES},
        "ours_only": {"sync_s": _median(ours, "sync"), "values_s": _median(ours, "values")},
    }


def bench_size(name: str, size: Size, steps: int | None, warmup: int | None, threads: int,
               dtype: str) -> dict:
    from mcore_rl.config import load_config
    from mcore_rl.rl.job_check import check_registered_names

    steps = steps or size.steps
    warmup = size.warmup if warmup is None else warmup
    config = _config_path(size.config)
    with tempfile.TemporaryDirectory(prefix=f"mcore-rl-bench-train-{name}-") as tmp:
        work = Path(tmp)
        base = load_config(str(config), size.overrides + size.extra)
        check_registered_names(base)
        overrides = size.overrides + our_overrides(base, steps, work / "ours", threads, dtype) + size.extra
        cfg = load_config(str(config), overrides)
        _log(f"{name}: mcore-rl train, {steps} steps")
        ours = run_ours(config, overrides, work / "ours")
        if cfg.model.path:
            from mcore_rl.models.builtin import resolve_model_path

            model_dir = resolve_model_path(cfg.model.path)
        else:
            model_dir = work / "ours" / "initial_model"  # the random tiny model our run started from
        _log(f"{name}: TRL GRPOTrainer, {steps} steps")
        trl = run_trl(trl_spec(cfg, model_dir, work / "trl", steps, threads), work)
    report = {"config": size.config, "overrides": overrides,
              "model": cfg.model.path or "built-in random tiny Llama",
              "settings": {"prompts_per_step": cfg.data.prompts_per_step,
                           "group_size": cfg.rollout.n_samples_per_prompt,
                           "response_tokens": cfg.rollout.max_new_tokens,
                           "kl_coef": cfg.algorithm.kl_coef,
                           "loss_aggregation": cfg.algorithm.loss_aggregation,
                           "micro_batch_tokens": cfg.optimizer.micro_batch_tokens,
                           "threads": threads, "warmup_steps": warmup, "dtype": cfg.model.dtype},
              **compare(ours, trl, warmup),
              "per_step": {"ours": ours, "baseline": trl}}
    if name in TARGET_SPEEDUP:
        report["target"] = {"tokens_per_s_speedup": TARGET_SPEEDUP[name],
                            "met": report["tokens_per_s"]["speedup"] >= TARGET_SPEEDUP[name]}
    if name == "quickstart":
        report["note"] = ("compute is negligible at this size: our step time is the fixed "
                          "per-step overhead of the loop (engine round trips, weight sync, "
                          "Megatron schedule)")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-rl bench train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="output JSON path")
    parser.add_argument("--sizes", default="quickstart,smollm2",
                        help=f"comma-separated sizes (of {', '.join(SIZES)})")
    parser.add_argument("--steps", type=int, help="RL steps per run (default per size)")
    parser.add_argument("--warmup", type=int, help="steps left out of the figures (default per size)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per side")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="precision of both sides: fp32, or bf16 mixed precision (ours: bf16 "
                             "parameters with fp32 main parameters, vLLM in bf16; TRL: bf16=True)")
    parser.add_argument("--quick", action="store_true", help="quickstart size, 4 steps (for tests)")
    parser.add_argument("--schedule", default=None,
                        help="compare training schedules against sync instead of TRL, with "
                             "natural response lengths (e.g. sync,one_step_off,async; see "
                             "benchmarks/train_schedules.py)")
    parser.add_argument("--k", type=int, default=2, help="max staleness K of async (--schedule)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for our side, repeatable, applied after the "
                             "benchmark's own (e.g. --set rollout.engine=hf_batched); TRL follows "
                             "the settings it shares (prompts, group size, lengths, optimizer)")
    args = parser.parse_args(argv)
    sizes = ["quickstart"] if args.quick else [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise UsageError(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    bad = [o for o in args.set if "=" not in o]
    if bad:
        raise UsageError(f"--set {bad[0]!r}: write it as KEY=VALUE, e.g. --set rollout.engine=hf_batched")
    chosen = {name: replace(SIZES[name], extra=args.set) for name in sizes}
    steps, warmup = (4, 2) if args.quick else (args.steps, args.warmup)
    if steps is not None and steps <= (warmup or 0):
        raise UsageError(f"--steps {steps} leaves nothing after --warmup {warmup}")
    if args.schedule is not None:
        if args.quick:
            steps, warmup = 4, 1
        return _main_schedules(args, chosen, steps, warmup)
    results = {name: bench_size(name, size, steps, warmup, args.threads, args.dtype)
               for name, size in chosen.items()}
    write_json(args.json, rounded({"benchmark": "train", "machine": machine_info(),
                                   "baseline": "TRL GRPOTrainer (HF generate + HF training)",
                                   "results": results}))
    for name, r in results.items():
        tps = r["tokens_per_s"]
        _log(f"{name}: ours {tps['ours']:.1f} tokens/s, TRL {tps['baseline']:.1f} tokens/s, "
             f"x{tps['speedup']:.2f}; step {r['step_time']['ours']:.2f} s vs "
             f"{r['step_time']['baseline']:.2f} s; phases " + ", ".join(
                 f"{p} x{c['speedup']:.2f}" for p, c in r["phases"].items() if c["speedup"]))
    _log(f"wrote {args.json}")
    return 0


def _main_schedules(args, sizes: dict[str, Size], steps: int | None, warmup: int | None) -> int:
    from mcore_rl.benchmarks.train_schedules import bench_schedules, parse_schedules

    schedules = parse_schedules(args.schedule)
    if steps is not None and steps <= (warmup if warmup is not None else 1) + 1:
        raise UsageError(f"--steps {steps} leaves no steady-state step after the warm-up and "
                         "before the last step; raise --steps")
    if args.k < 1:
        raise UsageError(f"--k {args.k}: async needs a max staleness of at least 1")
    results = {name: bench_schedules(name, size, schedules, args.k, steps, warmup,
                                     args.threads, args.dtype, _log) for name, size in sizes.items()}
    write_json(args.json, rounded({"benchmark": "train_schedules", "machine": machine_info(),
                                   "baseline": "the sync schedule (and static batching) in the same run",
                                   "results": results}))
    for name, r in results.items():
        lengths = r["schedules"]["sync"]["response_lengths"]
        _log(f"{name}: response lengths p50 {lengths['p50']:g}, p90 {lengths['p90']:g}, "
             f"max {lengths['max']:g}; " + ", ".join(
                 f"{c} x{v['speedup']:.2f}" for c, v in r["comparisons"].items()))
    _log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
