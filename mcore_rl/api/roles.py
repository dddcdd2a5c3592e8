"""Controller functions of an RL dataflow: rollout, reward and trainer roles built from the
same parts as ``mcore-rl train``.

    cfg = config_to_dict(load_config("configs/quickstart.yaml", ["rollout.placement=separate"]))
    rollout, scored = DataStream("rollout", 2), DataStream("scored", 2)
    group = ControllerGroup()
    for i in range(2):
        group.add(Controller("actor", factory(Generate, cfg, model_dir, f"engine/{i}"),
                             data_output=rollout, devices=[i]))
    group.add(Controller("critic", factory(Score, cfg), data_input=rollout, data_output=scored))
    group.add(Controller("trainer", factory(Train, cfg, model_dir, ["engine/0", "engine/1"]),
                         data_input=scored, strategy=Megatron(tp=2)))
    launch(group, data=prompt_batches, num_epochs=2)

`Generate` owns an engine in its controller's process (pinned to the controller's
devices) and publishes it; `Train` streams its weights into every engine it names after
each update, so later rollouts carry the new weight version."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

from mcore_rl.api.worker import prompt_records
from mcore_rl.config import RLConfig
from mcore_rl.data.batch import Batch
from mcore_rl.rewards.reward_model import REWARD_MODEL


def _config(cfg_data: dict) -> RLConfig:
    from mcore_rl.config.loader import _build

    return _build(RLConfig, cfg_data, "")


ASLEEP_CHECK_S = 1.0
"""How long a rollout role waits at most for its (colocated) engine to wake before it looks
again (the wake itself ends the wait at once)."""


class Generate:
    """A rollout role: a list of prompts (texts, token ids or dicts with ``prompt`` and the
    reward's fields) -> a rollout `Batch`, sampled by an engine of this process, published
    as ``name`` for the trainer's weight sync."""

    def __init__(self, cfg_data: dict, model_dir: str | Path, name: str):
        from mcore_rl.data.tokenizer import load_tokenizer
        from mcore_rl.engines import build_rollout_engine
        from mcore_rl.flow import publish
        from mcore_rl.rl import phases

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.cfg = _config(cfg_data)
        self.tokenizer = load_tokenizer(model_dir)
        log_dir = Path(self.cfg.logging.dir)
        self.engine = build_rollout_engine(
            self.cfg.rollout, model_dir, dtype=self.cfg.model.dtype, seed=self.cfg.train.seed,
            log_file=log_dir / f"{name.replace('/', '_')}.log",
            max_model_len=phases.context_length(self.cfg))
        self.lock = publish(name, self.engine)
        self.calls = 0

    def __call__(self, item: Sequence[Any] | dict) -> Batch:
        """``item``: the prompts, or ``{"step": k, "prompts": [...]}`` (``k`` seeds the
        sampling as step ``k`` of ``mcore-rl train`` does; default: this call's number)."""
        from mcore_rl.rl import phases

        self.calls += 1
        step, prompts = (item["step"], item["prompts"]) if isinstance(item, dict) else \
            (self.calls, item)
        records = prompt_records(prompts)
        encoded = phases.encode_prompts(self.tokenizer, self.cfg, records)
        t = time.perf_counter()
        while True:
            with self.lock:  # a weight update waits for this generation, and the other way round
                if not self.engine.asleep:
                    batch = phases.sample_batch(self.engine, self.tokenizer, self.cfg, encoded,
                                                step=step)
                    break
            # colocated: the trainer has the devices until its weight sync wakes the engine
            self.engine.wait_awake(ASLEEP_CHECK_S)
        batch.meta["producer"] = [os.getpid()] * len(batch)
        batch.info["prompts"] = len(records)
        batch.info["time/generate"] = time.perf_counter() - t
        return batch

    def close(self) -> None:
        self.engine.close()


class Score:
    """A reward role: a rollout `Batch` -> the same batch with ``scores`` (the config's
    rewards, one per response, by a `RewardScorer` that lives as long as the role) and
    the scorer's metrics (``reward/*``) in ``info``, beside ``time/score``."""

    def __init__(self, cfg_data: dict):
        from mcore_rl.rewards import RewardScorer

        self.cfg = _config(cfg_data)
        self.scorer = RewardScorer.from_config(self.cfg.reward)

    def __call__(self, batch: Batch) -> Batch:
        from mcore_rl.rl.phases import score_rollouts

        t = time.perf_counter()
        scores, metrics = score_rollouts(self.scorer, batch)
        batch = batch.with_tensors(scores=scores)
        batch.info.update(metrics)
        batch.info["time/score"] = time.perf_counter() - t
        return batch

    def close(self) -> None:
        self.scorer.close()


def report_placement(ctx) -> None:
    """One line from the controller rank: how many ranks run on how many Ray nodes."""
    import torch.distributed as dist

    from mcore_rl.flow import ray_shim

    nodes = [None] * ctx.world_size
    dist.all_gather_object(nodes, ray_shim.node_id(), group=ctx.world_group)
    if ctx.is_controller:
        print(f"mcore-rl: {ctx.world_size} trainer rank(s), layout {ctx.layout}, on "
              f"{len(set(nodes))} Ray node(s)", flush=True)


class Train:
    """A trainer role for the Megatron strategy: a scored rollout `Batch` -> one RL step
    (log-probs, KL, values, advantages, the update), a weight sync into the engines
    published as ``engines``, and what follows a step of ``mcore-rl train``: validation
    every ``train.val_every`` steps (greedy, on the first engine), logs, samples and
    checkpoints. Before the first step it resumes or warm-starts as ``mcore-rl train``
    does (`resume_or_warm_start`), then, with ``initial_sync``, syncs the weights if
    nothing did yet (engines built elsewhere may hold other weights).

    A batch is first held to ``train.max_staleness`` (`within_staleness`): prompt groups
    generated with weights more versions old are dropped and counted
    (``rollout/stale_dropped``); a batch with nothing left is no step.

    Each step's metrics (returned and logged) carry the weight version the batch was
    generated with (``rollout/weight_version``), the one synced after it
    (``weight_version``) and, from the second step on, ``time/batch_interval``: the wall
    time from the end of the previous step (its validation, logs and checkpoint included)
    to the end of this one's update and sync: the step's wall time as the graph runs it,
    hops between controllers included (with overlap, the time per trained batch)."""

    def __init__(self, cfg_data: dict, model_dir: str | Path, engines: Sequence[str],
                 initial_sync: bool = True, stop: Any = None, colocated: bool = False):
        from dataclasses import replace

        from mcore_rl.flow import lookup, rank_context
        from mcore_rl.rl import phases
        from mcore_rl.rl.setup import build_run
        from mcore_rl.trainer import resume_or_warm_start

        cfg = _config(cfg_data)
        cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
        if not colocated:
            # The engines run beside the trainer: no hand-over (sleep, wake) around the update.
            cfg = replace(cfg, rollout=replace(cfg.rollout, placement="separate"))
        self.stop = stop
        ctx = rank_context()
        report_placement(ctx)
        remote = [lookup(name) for name in engines] if ctx.is_controller else []
        reward = val_metrics = None
        if cfg.reward.name == REWARD_MODEL:  # the reward controller's model scores rollouts
            from mcore_rl.api.reward_model_role import trainer_rewards

            reward, client = trainer_rewards(cfg, ctx.is_controller)
            val_metrics = client.validation_metrics
        self.state = build_run(cfg, ctx, engines=remote, reward=reward)
        self.state.val_metrics = val_metrics
        resume_or_warm_start(self.state)
        if initial_sync and self.state.weight_version == 0:
            phases.sync_weights(self.state)
        self.last_end: float | None = None
        self.dropped = 0.0
        """Samples dropped as too stale since the last step (reported with the next one)."""
        self.groups_seen: set[tuple] = set()
        """(step, index) of every prompt group taken (async: `_check_once`)."""

    def __call__(self, batch: Batch) -> dict[str, float]:
        from mcore_rl.rl import phases
        from mcore_rl.trainer import PhaseTimer, after_step, learn

        from mcore_rl.errors import StopRequested

        from mcore_rl.rl.staleness import within_staleness

        from mcore_rl.rl.group_batch import assemble_groups, token_staleness

        state = self.state
        arrived = time.perf_counter()
        rollout_metrics = {}
        if "group_key" in batch.meta:  # prompt groups that arrived one by one (async)
            batch, rollout_metrics = assemble_groups(batch)
            self._check_once(batch)
        state.prompts.position += batch.info.get("prompts", 0)  # what a checkpoint records
        batch = phases.with_scores(state, phases.mark_truncated(state.cfg, batch), batch["scores"])
        dynamic = {}
        if state.dynamic is not None:  # pool informative groups until a step has enough
            batch, dynamic = state.dynamic.offer(batch)
            if batch is None:
                return {}
        fresh, staleness = within_staleness(batch, state.weight_version,
                                            state.cfg.train.max_staleness)
        staleness |= token_staleness(fresh if fresh is not None else batch,
                                     state.weight_version) | rollout_metrics
        self.dropped += staleness["rollout/stale_dropped"]
        if fresh is None:  # nothing young enough to train on: no step
            return {}
        state.step += 1
        batch = fresh
        generated_with = min(batch.meta["weight_version"])
        timer = PhaseTimer()
        for phase in ("generate", "score"):  # timed where they ran
            if f"time/{phase}" in batch.info:
                timer.seconds[phase] = batch.info[f"time/{phase}"]
        metrics = learn(state, batch, timer)
        metrics |= dynamic | staleness | {"rollout/stale_dropped": self.dropped,
                                "rollout/weight_version": float(generated_with),
                                "weight_version": float(state.weight_version)}
        self.dropped = 0.0
        if self.last_end is not None:
            metrics["time/batch_interval"] = time.perf_counter() - self.last_end
            metrics["time/trainer_idle_s"] = arrived - self.last_end  # waiting for the batch
        try:
            after_step(state, metrics, stop=self.stop)
        except StopRequested as req:
            self.stop.acknowledge(state.ctx, req.step)
            raise
        self.last_end = time.perf_counter()
        if state.dynamic is not None and state.step >= state.cfg.train.steps and state.is_controller:
            from mcore_rl.flow import finish_launch

            finish_launch()  # the feed holds spare rounds for dynamic sampling: stop it here
        return metrics

    def _check_once(self, batch: Batch) -> None:
        """Every prompt group reaches the trainer once: a group in two batches, or twice in
        one (more rows than samples per prompt), is a bug upstream, never trained on."""
        from collections import Counter

        rows = Counter(tuple(k) for k in batch.meta["group_key"])
        n = self.state.cfg.rollout.n_samples_per_prompt
        for key, count in rows.items():
            if key in self.groups_seen or count > n:
                raise RuntimeError(f"prompt group {key} (step, index) reached the trainer twice; "
                                   "a rollout handed it on more than once")
        self.groups_seen.update(rows)

    def close(self) -> None:
        from mcore_rl.trainer import finish

        finish(self.state)
