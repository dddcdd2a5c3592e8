"""`mcore-rl bench dpo`: DPO training tokens/s of our DPO job vs TRL's ``DPOTrainer``.

In one run, both frameworks train DPO from the same weights on the same pairs, each run in
a fresh process:

- **ours**: the ``train.job: dpo`` run of ``mcore-rl train`` (``benchmarks/_dpo_driver.py``:
  its ranks running the job's graph fused in their world, the Megatron train engine and
  the frozen reference), once per
  ``finetune.reference_logps`` (``on_the_fly``: the reference's forward is part of every
  step; ``cached``: one pass over the dataset before the first step);
- **baseline**: TRL ``DPOTrainer`` (``benchmarks/_trl_dpo.py``), once per variant of its
  own speed options (``precompute_ref_log_probs``, ``padding_free``, each off and on);
  the best one is the baseline, every one is in the JSON (one that this TRL version turns
  off or refuses, with the reason, and without running its steps).

Same model (``--model``: SmolLM2-135M-Instruct, or the quick start's tiny random Llama),
same pairs (the built-in addition pairs of ``configs/dpo_quickstart.yaml``, or ``--data``, a
JSONL of ``{"prompt", "chosen", "rejected"}``) tokenized once by mcore-rl and given to both
sides as token ids, taken in the same order (step k of each side trains on the same pairs),
same pairs per step, longest sequence, precision (``--dtype``: fp32, or bf16 mixed precision:
ours bf16 parameters with fp32 main parameters, TRL ``bf16=True``), loss (sigmoid, no label
smoothing), beta, optimizer (Adam, constant learning rate, gradient clip 1.0), no gradient
checkpointing, and CPU threads.

Measured: tokens/s of an optimizer step = the non-pad tokens of its batch (prompt + chosen
and prompt + rejected, as each side counts them in the batch it trains on) / the step's wall
time (ours: ``time/step``, batch, reference and update; TRL: from the end of the step before,
batch loading included), median over the steps after ``--warmup``. The headline compares
the best variant of each side; ``like_for_like`` pairs the variants that get the reference
log-probs the same way. ``reference``: the pass that computes them for the whole dataset
before training (our cache, TRL's precompute: time and tokens/s), and the reference's part
of a step when it runs on the fly (ours: ``time/reference``, batch built and reference
forward; TRL: the reference model's forward calls).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mcore_rl.benchmarks._common import (machine_info, rounded, run_spec_module, throughput_comparison,
                                         time_comparison, write_json)
from mcore_rl.benchmarks.train import _config_path
from mcore_rl.errors import UsageError

CONFIG = "configs/dpo_quickstart.yaml"
OUR_VARIANTS = ("on_the_fly", "cached")
"""``finetune.reference_logps`` of our runs."""
TRL_VARIANTS = {
    "default": {"precompute_ref_log_probs": False, "padding_free": False},
    "precompute_ref_log_probs": {"precompute_ref_log_probs": True, "padding_free": False},
    "padding_free": {"precompute_ref_log_probs": False, "padding_free": True},
    "precompute_ref_log_probs+padding_free": {"precompute_ref_log_probs": True, "padding_free": True},
}


@dataclass
class Size:
    model: str
    """``model.path``; empty: the quick start's random tiny Llama (written once, both sides load it)."""
    batch_size: int
    max_length: int
    steps: int
    warmup: int
    overrides: list[str] = field(default_factory=list)


SIZES = {
    "tiny": Size("", batch_size=8, max_length=16, steps=8, warmup=2),
    # The quick start's learning rate would make a 135M model's loss blow up within a few steps.
    "smollm2": Size("builtin:smollm2-135m-instruct", batch_size=8, max_length=512, steps=6, warmup=2,
                    overrides=["optimizer.lr=1e-6"]),
}
QUICK = {"steps": 5, "warmup": 2}


def _log(msg: str) -> None:
    print(f"[bench dpo] {msg}", flush=True)


@dataclass
class Plan:
    """The settings of one benchmark run (the model's defaults and the options, checked)."""

    size: Size
    steps: int
    warmup: int
    batch_size: int
    max_length: int
    beta: float
    dtype: str
    threads: int
    data: str | None


def our_overrides(plan: Plan, model_dir: Path, log_dir: Path, reference: str) -> list[str]:
    """The DPO quick start turned into the benchmark's run: no warm start (the reference is
    the initial model, as TRL's), validation, TensorBoard or intermediate checkpoints."""
    data = ([] if plan.data is None
            else ["data.source=jsonl", f"data.path={Path(plan.data).resolve()}"])
    return [*plan.size.overrides, *data, f"model.path={model_dir}", "train.job=dpo",
            f"train.steps={plan.steps}", "train.warm_start_steps=0", "train.val_every=0",
            "data.num_val=0", "checkpoint.save_every=0", "checkpoint.resume=never",
            "logging.backends=[jsonl]", "logging.progress_bar=false", f"logging.dir={log_dir}",
            f"finetune.batch_size={plan.batch_size}", f"finetune.max_length={plan.max_length}",
            f"finetune.beta={plan.beta}", "finetune.dpo_loss=sigmoid", "finetune.label_smoothing=0",
            "finetune.val_score=false", f"finetune.reference_logps={reference}",
            f"model.dtype={plan.dtype}", f"parallel.cpu_threads_per_rank={plan.threads}"]


def model_dir_for(plan: Plan, work: Path) -> Path:
    """The model both sides start from: the built-in model's directory, or the tiny random
    Llama written once here (so every run loads the same weights)."""
    from mcore_rl.config import load_config

    if plan.size.model:
        from mcore_rl.models.builtin import resolve_model_path

        return resolve_model_path(plan.size.model)
    from mcore_rl.rl.setup import write_initial_model

    cfg = load_config(str(_config_path(CONFIG)), [f"logging.dir={work / 'model'}"])
    return write_initial_model(cfg)


def pairs_and_order(cfg, model_dir: Path, steps: int) -> tuple[list[dict], list[int]]:
    """The training pairs as our run tokenizes them, and the indices of the pairs our run
    takes over ``steps`` steps (its seeded epochs), which TRL reads in the same order."""
    from mcore_rl.data.prompts import PromptStream
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.finetune.setup import load_examples

    pairs, report = load_examples(cfg, load_tokenizer(model_dir), "train")
    _log(f"data {report.line()}")
    order = PromptStream(list(range(len(pairs))), cfg.data.seed).take(steps * cfg.finetune.batch_size)
    return ([{"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids}
             for p in pairs], order)


def trl_spec(cfg, plan: Plan, model_dir: Path, pairs: list[dict], order: list[int], out_dir: Path,
             options: dict) -> dict:
    """What `_trl_dpo` needs to train as ``cfg`` does, with the variant's ``options``."""
    from mcore_rl.data.tokenizer import CharTokenizer

    o, f = cfg.optimizer, cfg.finetune
    return {"model_dir": str(model_dir), "output_dir": str(out_dir), "threads": plan.threads,
            "tokenizer": "char" if (model_dir / CharTokenizer.FILE).exists() else "hf",
            "pairs": pairs, "order": order, "seed": cfg.train.seed, "steps": plan.steps,
            "batch_size": f.batch_size, "max_length": f.max_length, "beta": f.beta,
            "loss_type": f.dpo_loss, "label_smoothing": f.label_smoothing, "lr": o.lr,
            "weight_decay": o.weight_decay, "adam_beta1": o.adam_beta1, "adam_beta2": o.adam_beta2,
            "adam_eps": o.adam_eps, "clip_grad": o.clip_grad, "bf16": cfg.model.dtype == "bf16",
            "gradient_checkpointing": cfg.model.recompute == "full", **options}


def summary(out: dict, warmup: int) -> dict:
    """A variant's figures: medians over the steps after the warm-up, and every step."""
    measured = out["steps"][warmup:]
    if not measured:
        raise RuntimeError("no steps left after the warm-up steps; raise --steps")
    med = lambda key: statistics.median(s[key] for s in measured)  # noqa: E731
    return {"tokens_per_s": statistics.median(s["tokens"] / s["step"] for s in measured),
            "step_s": med("step"), "tokens_per_step": med("tokens"), "reference_s": med("reference"),
            "tokens_measured": sum(s["tokens"] for s in measured), "steps_measured": len(measured),
            "reference_pass": out["reference_pass"], "per_step": out["steps"]}


def run_ours(plan: Plan, model_dir: Path, work: Path) -> dict[str, dict]:
    config = str(_config_path(CONFIG))
    out = {}
    for reference in OUR_VARIANTS:
        _log(f"ours, finetune.reference_logps={reference}: {plan.steps} steps")
        overrides = our_overrides(plan, model_dir, work / f"ours_{reference}", reference)
        spec = {"config": config, "overrides": overrides}
        out[reference] = summary(run_spec_module("mcore_rl.benchmarks._dpo_driver", spec, work,
                                                 f"ours_{reference}", "our DPO run"), plan.warmup)
    return out


def run_trl(cfg, plan: Plan, model_dir: Path, pairs: list[dict], order: list[int],
            work: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, options in TRL_VARIANTS.items():
        if options["padding_free"] and "skipped" in out.get("padding_free", {}):
            out[name] = {"skipped": "not run: padding_free alone was skipped"}
            continue
        _log(f"TRL DPOTrainer, {name}: {plan.steps} steps")
        spec = trl_spec(cfg, plan, model_dir, pairs, order, work / f"trl_{name}", options)
        result = run_spec_module("mcore_rl.benchmarks._trl_dpo", spec, work, f"trl_{name.replace('+', '_')}",
                                 f"TRL DPOTrainer ({name})")
        if "skipped" in result:
            _log(f"TRL {name}: skipped: {result['skipped']}")
            out[name] = {"skipped": result["skipped"]}
        else:
            out[name] = {**summary(result, plan.warmup), "options_in_effect": result["effective"],
                         "trl": result["trl"]}
    return out


def best(variants: dict[str, dict], keep=lambda name: True) -> str | None:
    """The name of the measured variant with the most tokens/s (among those ``keep`` takes)."""
    ran = [n for n, v in variants.items() if "tokens_per_s" in v and keep(n)]
    return max(ran, key=lambda n: variants[n]["tokens_per_s"]) if ran else None


def compare(ours: dict[str, dict], trl: dict[str, dict]) -> dict:
    o_best, t_best = best(ours), best(trl)
    if t_best is None:
        raise RuntimeError("no TRL variant ran")
    o, t = ours[o_best], trl[t_best]
    precomputed = lambda n: TRL_VARIANTS[n]["precompute_ref_log_probs"]  # noqa: E731
    t_fly, t_pre = best(trl, lambda n: not precomputed(n)), best(trl, precomputed)
    report = {
        "best": {"ours": o_best, "baseline": t_best},
        "tokens_per_s": throughput_comparison(o["tokens_per_s"], t["tokens_per_s"], "tokens/s"),
        "step_time": time_comparison(o["step_s"], t["step_s"]),
        "tokens_per_step": {"ours": o["tokens_per_step"], "baseline": t["tokens_per_step"],
                            "unit": "tokens"},
        "like_for_like": {}, "reference": {},
    }
    if t_fly:
        report["like_for_like"]["reference_each_step"] = {
            "ours_variant": "on_the_fly", "baseline_variant": t_fly,
            **throughput_comparison(ours["on_the_fly"]["tokens_per_s"], trl[t_fly]["tokens_per_s"],
                                    "tokens/s")}
        report["reference"]["per_step_time"] = time_comparison(ours["on_the_fly"]["reference_s"],
                                                               trl[t_fly]["reference_s"])
    if t_pre:
        report["like_for_like"]["reference_before_training"] = {
            "ours_variant": "cached", "baseline_variant": t_pre,
            **throughput_comparison(ours["cached"]["tokens_per_s"], trl[t_pre]["tokens_per_s"], "tokens/s")}
        mine, theirs = ours["cached"]["reference_pass"], trl[t_pre]["reference_pass"]
        report["reference"] |= {
            "pass_time": time_comparison(mine["seconds"], theirs["seconds"]),
            "pass_tokens_per_s": throughput_comparison(mine["tokens"] / mine["seconds"],
                                                       theirs["tokens"] / theirs["seconds"], "tokens/s"),
            "pass_tokens": {"ours": mine["tokens"], "baseline": theirs["tokens"], "unit": "tokens"},
            "pass_sequences": {"ours": mine["sequences"], "baseline": theirs["sequences"],
                               "unit": "sequences"}}
    return report


def settings(plan: Plan, cfg, pairs: int, trl: dict[str, dict]) -> dict:
    return {"model": plan.size.model or "built-in random tiny Llama (configs/dpo_quickstart.yaml)",
            "data": plan.data or "built-in addition pairs", "pairs": pairs,
            "pairs_per_step": plan.batch_size, "max_length": plan.max_length, "dtype": plan.dtype,
            "loss": cfg.finetune.dpo_loss, "beta": plan.beta, "lr": cfg.optimizer.lr,
            "clip_grad": cfg.optimizer.clip_grad, "micro_batch_tokens": cfg.optimizer.micro_batch_tokens,
            "gradient_checkpointing": cfg.model.recompute == "full", "threads": plan.threads,
            "steps": plan.steps, "warmup_steps": plan.warmup,
            "trl": next((v["trl"] for v in trl.values() if "trl" in v), None)}


def plan_from(args) -> Plan:
    if args.quick and args.model == "smollm2":
        raise UsageError("--quick runs the tiny model; drop --quick or --model smollm2")
    size = SIZES["tiny" if args.quick else args.model or "smollm2"]
    defaults = QUICK if args.quick else {"steps": size.steps, "warmup": size.warmup}
    steps = args.steps if args.steps is not None else defaults["steps"]
    warmup = args.warmup if args.warmup is not None else defaults["warmup"]
    batch = args.batch_size if args.batch_size is not None else size.batch_size
    max_length = args.max_length if args.max_length is not None else size.max_length
    if warmup < 0 or steps <= warmup:
        raise UsageError(f"--steps {steps} leaves nothing after --warmup {warmup}; give at least "
                         f"{max(warmup, 0) + 1} steps")
    for flag, value, least in (("--batch-size", batch, 1), ("--max-length", max_length, 2),
                               ("--threads", args.threads, 1)):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if not args.beta > 0:
        raise UsageError(f"--beta must be > 0, got {args.beta}")
    if args.data is not None and not Path(args.data).is_file():
        raise UsageError(f"--data '{args.data}' is not a file; give a JSONL of "
                         '{"prompt", "chosen", "rejected"} records')
    return Plan(size, steps, warmup, batch, max_length, args.beta, args.dtype, args.threads, args.data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-rl bench dpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="output JSON path")
    parser.add_argument("--model", choices=tuple(SIZES), help="smollm2 (default) or tiny")
    parser.add_argument("--data", help="JSONL of {prompt, chosen, rejected} (default: the built-in "
                                       "addition pairs)")
    parser.add_argument("--batch-size", type=int, help="pairs per optimizer step (default per model)")
    parser.add_argument("--max-length", type=int, help="longest prompt + completion in tokens; "
                                                       "longer pairs are left out (default per model)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default per model)")
    parser.add_argument("--warmup", type=int, help="steps left out of the figures (default per model)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per side")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="precision of both sides: fp32, or bf16 mixed precision")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny model, {QUICK['steps']} steps, {QUICK['warmup']} warm-up (for tests)")
    args = parser.parse_args(argv)
    plan = plan_from(args)

    from mcore_rl.config import load_config
    from mcore_rl.roles.rules import check_runnable, world_size_of

    with tempfile.TemporaryDirectory(prefix="mcore-rl-bench-dpo-") as tmp:
        work = Path(tmp)
        model_dir = model_dir_for(plan, work)
        # Checked as `mcore-rl train` checks it, before either side starts.
        cfg = load_config(str(_config_path(CONFIG)),
                          our_overrides(plan, model_dir, work / "check", "on_the_fly"))
        check_runnable(cfg, world_size_of(cfg))
        pairs, order = pairs_and_order(cfg, model_dir, plan.steps)
        ours = run_ours(plan, model_dir, work)
        trl = run_trl(cfg, plan, model_dir, pairs, order, work)
    results = compare(ours, trl)
    results["variants"] = {"ours": ours, "baseline": trl}
    write_json(args.json, rounded({"benchmark": "dpo", "machine": machine_info(),
                                  "settings": settings(plan, cfg, len(pairs), trl),
                                  "baseline": "TRL DPOTrainer, best of its speed options",
                                  "results": results}))
    tps, ref = results["tokens_per_s"], results["reference"]
    _log(f"ours ({results['best']['ours']}) {tps['ours']:.1f} tokens/s, TRL ({results['best']['baseline']}) "
         f"{tps['baseline']:.1f} tokens/s, x{tps['speedup']:.2f}")
    if "pass_time" in ref:
        _log(f"reference pass: ours {ref['pass_time']['ours']:.2f} s, TRL precompute "
             f"{ref['pass_time']['baseline']:.2f} s, x{ref['pass_time']['speedup']:.2f}")
    _log(f"wrote {args.json}")
    return 0
