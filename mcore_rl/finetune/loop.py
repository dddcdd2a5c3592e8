"""The fine-tuning step, shared by SFT, RM, DPO, KTO and online DPO: batch -> frozen-model
passes -> one optimizer step (`finetune_step`, `learn_from`), then logs, validation,
checkpoint and the stop check (`after_step`); the trainer role of the job's graph
(`mcore_rl.roles.finetune`) runs them step by step.

Like the RL loop it resumes from the newest complete checkpoint (model, reference when a
warm start made it, data position, losses), so a resumed run sees the same batches and logs
the same metrics as an uninterrupted one; validation runs at step 0 and every
``train.val_every`` steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from mcore_rl.config import RLConfig
from mcore_rl.errors import NonFiniteError, StopRequested
from mcore_rl.finetune.setup import LINE_KEYS, FinetuneRun, copy_weights, open_reference_cache


def finetune_step(run: FinetuneRun) -> dict[str, float]:
    """One optimizer step over ``finetune.batch_size`` records; the step's metrics."""
    t0 = time.perf_counter()
    batch = run.job.next_batch(run)
    online = {} if run.last_rollout_reward is None else {
        "reward/mean": run.last_rollout_reward, "pairs": 0.0 if batch is None else len(batch) / 2}
    if batch is None:  # an online step whose samples all tied: nothing to learn from
        return online
    return learn_from(run, batch, t0, online)


def learn_from(run: FinetuneRun, batch, t0: float, extra: dict | None = None) -> dict[str, float]:
    """The job's frozen-model passes and one optimizer step on ``batch`` (started at ``t0``,
    for the step's time); the step's metrics, with ``extra``."""
    online = dict(extra or {})
    computed = run.reference_cache.computed if run.reference_cache is not None else 0
    batch = run.job.prepare(run, batch)
    t1 = time.perf_counter()
    cache = {} if run.reference_cache is None else {
        "reference/computed": float(run.reference_cache.computed - computed)}
    result = run.model.train_batch(batch, run.job.loss_fn())
    if not result.applied and run.cfg.train.on_nonfinite == "stop":
        raise NonFiniteError(f"step {run.step}: the loss or gradient is not finite (loss "
                             f"{result.loss:.4g}); the update was not applied; lower optimizer.lr, "
                             "or set train.on_nonfinite=skip")
    run.losses.append(result.loss)
    online |= run.job.after_update(run)
    seconds = time.perf_counter() - t0
    tokens = float(batch["attention_mask"].sum())
    return {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
            **run.job.step_metrics(dict(result.metrics)), "skipped_update": float(not result.applied),
            **cache, **online, "time/reference": t1 - t0, "time/step": seconds, "perf/tokens_per_s": tokens / seconds}


def after_step(run: FinetuneRun, metrics: dict[str, float], stop=None) -> None:
    """What follows a step: validation when due, logs, the console line, a checkpoint when
    due; ``stop`` (anything with ``should_stop(ctx)``, e.g. the launcher's `StopSignal`):
    when every rank agrees to stop, save a checkpoint and raise `StopRequested`."""
    cfg, ctx = run.cfg, run.ctx
    if _validation_due(run):
        metrics |= validate(run)
    run.log.log(run.step, metrics, console=run.step % cfg.logging.log_every == 0)
    saved = None
    if (cfg.checkpoint.save_every and run.step % cfg.checkpoint.save_every == 0) \
            or run.step == cfg.train.steps:
        saved = save(run)
    if stop is not None and run.step < cfg.train.steps and stop.should_stop(ctx):
        path = saved or save(run)
        run.log.close("stopped")
        raise StopRequested(run.step, path)


def validate(run: FinetuneRun) -> dict[str, float]:
    """The job's held-out metrics, and the greedy ``val/score`` when it is on."""
    from mcore_rl.finetune.greedy_score import greedy_score

    metrics = run.job.validate(run)
    if run.scorer is not None:
        metrics |= greedy_score(run.scorer, run.step)
    return metrics


def _validation_due(run: FinetuneRun) -> bool:
    every = run.cfg.train.val_every
    return bool(every) and (run.step % every == 0 or run.step == run.cfg.train.steps)


def save(run: FinetuneRun):
    """A checkpoint of the run; its state names the model the run started from (what a
    reward model trained here is read with: ``reward.reward_model_path``)."""
    return run.checkpoints.save(run.step, run.engines(), {
        "data_position": run.examples.position, "losses": run.losses,
        "prompt_position": run.prompts.position if run.prompts is not None else 0,
        "model_dir": str(Path(run.model_dir).resolve())})


def resume_or_start(run: FinetuneRun) -> None:
    """Continue from a checkpoint (``checkpoint.resume``), or start: the warm start (the
    reference becomes its result), then the step-0 validation."""
    cfg = run.cfg
    resume = run.checkpoints.resolve_resume(cfg.checkpoint.resume, list(run.engines()), cfg.logging.dir)
    if run.ctx.is_controller:
        for problem in resume.skipped:
            print(f"mcore-rl: skipping a broken checkpoint: {problem}", flush=True)
    if resume.path is not None:
        state = run.checkpoints.load(resume.path, run.engines())
        run.step, run.examples.position = state["step"], state["data_position"]
        run.losses = list(state["losses"])
        if run.prompts is not None:
            from mcore_rl.rl import phases

            run.prompts.position = state["prompt_position"]
            phases.sync_weights(run.scorer)  # the engine gets the checkpoint's weights
        run.log.truncate_after(run.step)
        if run.ctx.is_controller:
            print(f"mcore-rl: resumed from {resume.path} at step {run.step}", flush=True)
        open_reference_cache(run)
        return
    run.log.truncate_after(-1)
    if cfg.train.warm_start_steps:
        losses = warm_start(run)
        if run.job.online:
            from mcore_rl.rl import phases

            phases.sync_weights(run.scorer)  # the engine samples from the warm-started policy
        if run.ctx.is_controller:
            print(f"mcore-rl: warm start {len(losses)} steps, loss {losses[0]:.3f} -> "
                  f"{losses[-1]:.3f}", flush=True)
    open_reference_cache(run)
    if cfg.train.val_every:
        metrics = validate(run)
        if metrics:
            run.log.log(0, metrics)


@dataclass
class _WarmStartView:
    """What `mcore_rl.rl.warm_start.warm_start` reads of a run."""

    cfg: RLConfig
    actor: object
    tokenizer: object
    prompts: object


def warm_start(run: FinetuneRun) -> list[float]:
    """The RL quick start's supervised warm start on the task's (biased) answers
    (``train.warm_start_*``), then the reference takes the warm-started weights."""
    from mcore_rl.data.prompts import PromptStream, load_prompt_records
    from mcore_rl.rl.warm_start import to_console
    from mcore_rl.rl.warm_start import warm_start as supervised_warm_start

    prompts = PromptStream(load_prompt_records(run.cfg.data, "train"), run.cfg.data.seed)
    losses = supervised_warm_start(_WarmStartView(run.cfg, run.model, run.tokenizer, prompts),
                                   report=to_console if run.ctx.is_controller else None)
    if run.reference is not None:
        copy_weights(run.model, run.reference)
    return losses




def finish(run: FinetuneRun) -> None:
    from mcore_rl.finetune.greedy_score import close

    close(run.scorer)
    if run.ctx.is_controller:
        history = run.log.history()
        run.log.close()
        vals = {k: [h[k] for h in history if k in h] for k in LINE_KEYS if k.startswith("val/")}
        shown = "; ".join(f"{k} {v[0]:.2f} -> {v[-1]:.2f}" for k, v in vals.items() if v)
        first = run.losses[0] if run.losses else float("nan")
        last = run.losses[-1] if run.losses else float("nan")
        print(f"mcore-rl: {run.cfg.train.job} {run.step} steps; loss {first:.3f} -> {last:.3f}"
              + (f"; {shown}" if shown else "") + f"; metrics {run.log.dir / 'metrics.jsonl'}",
              flush=True)
