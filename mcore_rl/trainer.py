"""The RL step, on the trainer's ranks: a scored rollout batch -> log-probs -> KL penalty ->
values -> advantages -> update -> sync (`train_step`, `learn`), then validation, logs,
checkpoints and the stop check (`after_step`).

Generation and scoring happen before, in the rollout and reward roles of the job's graph
(`mcore_rl.roles`), wherever the placement puts them. Colocated, the engine sleeps while
the trainer computes (log-probs and update), then wakes its weights for the sync and its KV
cache for the next generation, so the two never compete for the same devices. Every phase
is its own function in ``mcore_rl.rl.phases`` (``(state, batch) -> batch``).
Simplifications, on purpose: one rollout batch per step (no replay buffer); the reference
model is frozen at the initial weights; KL is estimated per token from policy samples
(k1/k3).
"""
from __future__ import annotations

import time

from mcore_rl.data.batch import Batch
from mcore_rl.errors import StopRequested
from mcore_rl.rl import phases
from mcore_rl.rl.group_batch import assemble_groups, stream_position, token_staleness
from mcore_rl.rl.setup import RunState
from mcore_rl.rl.staleness import within_staleness
from mcore_rl.rl.step_metrics import rollout_metrics, validation_metrics

DYNAMIC_POOL = "dynamic_sampling"
"""The checkpoint object holding dynamic sampling's pool (`RunCheckpoints.load_object`)."""


def train_step(state: RunState, batch: Batch) -> dict[str, float] | None:
    """One RL step from a scored rollout batch, whatever produced it (the rollout and reward
    roles of any placement, or `RLTrainer`'s driver): prompt groups that arrived one by one
    are put together, the scores become rewards, dynamic sampling pools informative groups
    until a step has enough, groups older than ``train.max_staleness`` versions are
    dropped, then `learn`. None when the batch makes no step (pooled, or none fresh)."""
    extra: dict[str, float] = {}
    arrived: set = set()
    if "group_key" in batch.meta:  # prompt groups that arrived one by one
        batch, extra = assemble_groups(batch)
        check_once(state, batch)
        arrived = {tuple(k) for k in batch.meta["group_key"]}
    else:  # a step's prompts, in stream order
        state.prompts.position += batch.info.get("prompts", 0)  # what a checkpoint records
    batch = phases.with_scores(state, phases.mark_truncated(state.cfg, batch), batch["scores"])
    if state.dynamic is not None:  # pool informative groups until a step has enough
        batch, dynamic = state.dynamic.offer(batch)
        extra |= dynamic
    if arrived:
        take_groups(state, arrived)
    if batch is None:
        return None
    fresh, staleness = within_staleness(batch, state.weight_version, state.cfg.train.max_staleness)
    extra = staleness | token_staleness(fresh if fresh is not None else batch,
                                        state.weight_version) | extra
    state.stale_dropped += staleness["rollout/stale_dropped"]
    state.stale_dropped_groups += staleness["rollout/stale_dropped_groups"]
    if fresh is None:  # nothing young enough to train on: no step
        state.stale_batches += 1
        return None
    state.step += 1
    timer = PhaseTimer()
    for phase in ("generate", "score"):  # timed where they ran
        if f"time/{phase}" in fresh.info:
            timer.seconds[phase] = fresh.info[f"time/{phase}"]
    generated_with = min(fresh.meta["weight_version"])
    metrics = learn(state, fresh, timer) | extra | {
        "rollout/stale_dropped": state.stale_dropped,
        "rollout/stale_dropped_groups": state.stale_dropped_groups,
        "rollout/weight_version": float(generated_with),
        "weight_version": float(state.weight_version)}
    state.stale_dropped = state.stale_dropped_groups = 0.0
    return metrics


def take_groups(state: RunState, arrived: set) -> None:
    """Record the streamed groups the trainer has now taken (those held in dynamic
    sampling's pool included: a checkpoint keeps the pool). A checkpoint records the first
    stream position not taken (``prompts.position``) and the positions past it that were
    (``taken_ahead``): groups finish out of stream order, and a resumed run generates exactly
    the others (`mcore_rl.roles.graph.group_items`)."""
    per_step = state.cfg.data.prompts_per_step
    state.taken_ahead.update(stream_position(k, per_step) for k in arrived)
    while state.prompts.position in state.taken_ahead:
        state.taken_ahead.remove(state.prompts.position)
        state.prompts.position += 1


def check_once(state: RunState, batch: Batch) -> None:
    """Every prompt group reaches the trainer once: a group in two batches, or twice in one
    (more rows than samples per prompt), is a bug upstream, never trained on."""
    from collections import Counter

    rows = Counter(tuple(k) for k in batch.meta["group_key"])
    n = state.cfg.rollout.n_samples_per_prompt
    for key, count in rows.items():
        if key in state.groups_seen or count > n:
            raise RuntimeError(f"prompt group {key} (step, index) reached the trainer twice; "
                               "a rollout handed it on more than once")
    state.groups_seen.update(rows)


def learn(state: RunState, batch, timer: "PhaseTimer") -> dict[str, float]:
    """The rest of a step, from a scored rollout batch: log-probs, KL, values, advantages,
    the update and the weight sync; the step's metrics."""
    with timer("engine_sleep"):  # colocated: the trainer's turn on the devices begins
        phases.engine_sleep(state)
    with timer("logprobs"):
        batch = phases.old_logprobs(state, batch)
        batch = phases.reference_logprobs(state, batch)
    with timer("kl_penalty"):
        batch = phases.kl_penalty(state, batch)
    with timer("values"):
        batch = phases.values(state, batch)
    with timer("advantages"):
        batch = phases.advantages(state, batch)
    with timer("update"):
        metrics = phases.update_actor(state, batch)
        metrics |= phases.update_critic(state, batch)
    with timer("sync"):
        metrics |= phases.sync_weights(state)
    kl = phases.measured_kl(state, batch, metrics)
    if kl is not None:
        state.kl.update(kl, len(batch))
    state.last_batch = batch
    return metrics | rollout_metrics(state, batch) | timer.metrics(batch)


def after_step(state: RunState, metrics: dict[str, float], stop) -> None:
    """What follows a step's update: validation, logs, samples, checkpoint, stop check."""
    cfg = state.cfg
    if state.validates and (state.step % cfg.train.val_every == 0 or state.step == cfg.train.steps):
        metrics |= validation_metrics(state)
    state.log.log(state.step, metrics, console=state.step % cfg.logging.log_every == 0)
    if cfg.logging.samples_every and state.step % cfg.logging.samples_every == 0:
        state.log.samples(state.step, sample_rows(state.last_batch,
                                                  cfg.logging.samples_per_step or None))
    saved = None
    if (cfg.checkpoint.save_every and state.step % cfg.checkpoint.save_every == 0) \
            or state.step == cfg.train.steps:
        saved = save_checkpoint(state)
    if stop is not None and state.step < cfg.train.steps and stop.should_stop(state.ctx):
        path = saved or save_checkpoint(state)
        finish(state, stopped=True)
        raise StopRequested(state.step, path)


def resume_or_warm_start(state: RunState) -> None:
    """``checkpoint.resume``: continue from the latest complete checkpoint (and re-sync the
    engine from it) or start fresh (warm start, then the initial validation score)."""
    cfg = state.cfg
    resume = state.checkpoints.resolve_resume(cfg.checkpoint.resume, list(state.trained_engines()),
                                              cfg.logging.dir)
    if state.is_controller:
        for problem in resume.skipped:
            print(f"mcore-rl: skipping a broken checkpoint: {problem}", flush=True)
    path = resume.path
    if path is not None:
        run = state.checkpoints.load(path, state.trained_engines())
        state.step, state.prompts.position = run["step"], run["data_position"]
        state.taken_ahead = set(run.get("data_taken_ahead", ()))
        state.kl.load_state_dict(run["kl"])
        pool = state.checkpoints.load_object(path, DYNAMIC_POOL) if state.dynamic else None
        if pool is not None:  # the informative groups it held: trained as they would have been
            state.dynamic.load_state_dict(pool)
        state.weight_version = run["weight_version"] - 1
        phases.sync_weights(state)  # the engine gets the checkpoint's weights
        state.log.truncate_after(state.step)
        if state.is_controller:
            print(f"mcore-rl: resumed from {path} at step {state.step}", flush=True)
        return
    state.log.truncate_after(-1)  # a fresh run: logs of an earlier one in the same dir go
    if cfg.train.warm_start_steps:
        from mcore_rl.rl.warm_start import to_console, warm_start

        phases.engine_sleep(state)
        losses = warm_start(state, report=to_console if state.is_controller else None)
        phases.sync_weights(state)
        if state.is_controller:
            print(f"mcore-rl: warm start {len(losses)} steps, loss {losses[0]:.3f} -> "
                  f"{losses[-1]:.3f}", flush=True)
    if state.validates:
        state.log.log(0, validation_metrics(state), console=True)


def save_checkpoint(state: RunState, checkpoints=None):
    """A checkpoint of the run's trained models and its state, in ``checkpoints`` (a
    `RunCheckpoints`; default the run's ``checkpoint.dir``). Offloaded models
    (``train.offload``) come back to the devices for it and leave again."""
    offloaded = [e for e in state.trained_engines().values() if e.offloaded]
    for engine in offloaded:
        engine.reload()
    try:
        return (checkpoints or state.checkpoints).save(state.step, state.trained_engines(), {
            "data_position": state.prompts.position,
            "data_taken_ahead": sorted(state.taken_ahead), "kl": state.kl.state_dict(),
            "weight_version": state.weight_version},
            objects={DYNAMIC_POOL: state.dynamic.state_dict()} if state.dynamic else None)
    finally:
        for engine in offloaded:
            engine.offload()


def sample_rows(batch, limit: int | None = 8) -> list[dict]:
    """Rows of ``samples.jsonl``: prompt, response, reward, and the prompt's identity (its
    epoch and index in the dataset) where the prompt came from the run's prompt stream."""
    return [{"prompt": m["prompt"], "response": r, "reward": float(s),
             **({"epoch": m["data_epoch"], "index": m["data_index"]} if "data_index" in m else {})}
            for m, r, s in zip(batch.meta["prompt_meta"][:limit], batch.meta["response_text"][:limit],
                               batch["scores"][:limit].tolist())]


def finish(state: RunState, stopped: bool = False) -> None:
    """Summary line, reward-curve PNG, the trackers' runs ended (``stopped``: to be
    resumed), the reward scorer's worker processes stopped (the engines belong to their
    rollout roles, which close them)."""
    from mcore_rl.metrics_log import plot_reward_curve

    if state.is_controller:
        history = state.log.history()
        vals = [h["val/score"] for h in history if "val/score" in h]
        rewards = [h["reward/mean"] for h in history if "reward/mean" in h]
        plot = plot_reward_curve(history, state.log.dir / "reward_curve.png")
        state.log.close("stopped" if stopped else "finished", artifacts=(plot,))
        if vals and rewards:
            print(f"mcore-rl: {state.step} steps; validation score {vals[0]:.2f} -> {vals[-1]:.2f}; "
                  f"train reward {rewards[0]:.2f} -> {rewards[-1]:.2f}; metrics "
                  f"{state.log.dir / 'metrics.jsonl'}; plot {plot}", flush=True)
    state.reward.close()
    short = None if stopped else short_of_steps(state)
    if state.is_controller and short:
        print(short, flush=True)


def short_of_steps(state: RunState) -> str | None:
    """Why a run ended before ``train.steps`` when its data ran out: batches that made no
    step because every prompt group in them was too stale (the feed holds one batch per
    step to go; with dynamic sampling it holds spare rounds, and this says nothing). None
    otherwise."""
    steps, t = state.cfg.train.steps, state.cfg.train
    if state.dynamic is not None or not state.stale_batches or \
            state.step + state.stale_batches != steps:
        return None
    return (f"mcore-rl: the run ended at step {state.step} of {steps}: {state.stale_batches} "
            f"batch(es) held only prompt groups over train.max_staleness={t.max_staleness}, "
            f"dropped (train.on_stale={t.on_stale}); a higher train.max_staleness keeps such "
            "groups" + (", and train.on_stale=regenerate (async) generates them again"
                        if t.on_stale == "drop" and t.schedule == "async" else ""))


class PhaseTimer:
    """Wall time per phase, reported as ``time/<phase>`` and tokens/s of the step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t0

        return _Span()

    def metrics(self, batch) -> dict[str, float]:
        total = sum(self.seconds.values())
        tokens = float(batch["attention_mask"].sum())
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": total,
                "perf/tokens": tokens, "perf/responses": float(len(batch)),
                "perf/tokens_per_s": tokens / total if total else 0.0}
