"""`RLTrainer`: the single-controller view of a training run. The script that creates it is
the driver; it starts the job's graph (`mcore_rl.roles.graph`) without streams between its
controllers and calls them itself: `sample` the rollout role (`Generate.sample`), `update`
the trainer role, the same `Train.__call__` (or, for the fine-tuning jobs sft, rm, dpo and
kto, `FinetuneTrain.update`) that ``mcore-rl train`` runs, on every rank at once; each call
returns rank 0's answer. ``rollout.placement`` places the engine as it does for ``mcore-rl
train``: in a rollout controller of its own, or fused into the trainer's first rank."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from mcore_rl.api.rollouts import Rollouts
from mcore_rl.config import RLConfig, load_config
from mcore_rl.errors import UsageError

ALGO_ALIASES = {"ppo": "gae"}
"""``algo=`` of `RLTrainer`: an advantage estimator's name (``grpo``, ``rloo``, ...), or
``ppo`` for GAE with a critic."""


class RLTrainer:
    """Drive distributed trainer ranks from a Python script or a notebook.

    ``RLTrainer(model="path/to/hf_model", algo="ppo", tp=2)`` builds a run from keyword
    arguments and ``overrides`` (``section.field=value``, as on the command line);
    `from_config` from a YAML file. Building it checks the config (one-line `UsageError`),
    starts Ray (a local cluster unless ``address`` or a running one is given), starts the
    graph's controllers and runs what the config asks for before the first step: the warm
    start, or resuming from a checkpoint. Then:

    - `sample` (prompts -> `Rollouts`),
    - `update` (rewarded rollouts -> the step's metrics: advantages, losses, the optimizer
      step and the weight sync into the engine; then, as in ``mcore-rl train``, validation
      and checkpoints when due),
    - `validate`, `save`, `close` (or use it as a context manager).

    Metrics of every update also go to ``<logging.dir>/metrics.jsonl``."""

    def __init__(self, model: str | None = None, algo: str = "grpo", tp: int = 1, pp: int = 1,
                 dp: int = 1, *, overrides: Sequence[str] = (), config: RLConfig | None = None,
                 address: str | None = None):
        from mcore_rl.roles.rules import check_runnable, world_size_of

        if config is None:
            from mcore_rl.algos import ADVANTAGE_ESTIMATORS

            estimator = ALGO_ALIASES.get(algo, algo)
            if estimator not in ADVANTAGE_ESTIMATORS.names():
                raise UsageError(f"algo={algo!r} is not known; choose one of "
                                 f"{', '.join(sorted([*ALGO_ALIASES, *ADVANTAGE_ESTIMATORS.names()]))}")
            base = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
                    f"algorithm.advantage_estimator={estimator}"]
            if model is not None:
                base.append(f"model.path={model}")
            config = load_config(None, base + list(overrides))
        # The script owns the console: no progress bar sized for train.steps from the ranks.
        config = replace(config, logging=replace(config.logging, progress_bar=False))
        self.world_size = world_size_of(config)
        self.cfg = check_runnable(config, self.world_size, driver="api")
        self.job = config.train.job
        self._graph: Any = None
        self._stop_ray = None
        self._step = 0
        self._start(address)

    @classmethod
    def from_config(cls, path: str | Path, overrides: Sequence[str] = (), *,
                    address: str | None = None) -> "RLTrainer":
        """A trainer for the YAML config at ``path`` with ``section.field=value`` overrides."""
        return cls(config=load_config(path, list(overrides)), address=address)

    def _start(self, address: str | None) -> None:
        from mcore_rl.flow import gpu_placement, ray_shim, start
        from mcore_rl.rl.setup import initial_model_removed_on_failure
        from mcore_rl.roles.graph import job_graph

        ray = ray_shim.require()
        if not ray.is_initialized():
            self._stop_ray = ray_shim.start_local(self.cfg.launch.ray_reconnect_timeout_s,
                                                  address=address, include_dashboard=False,
                                                  log_to_driver=True)
        try:
            with initial_model_removed_on_failure(self.cfg, _DRIVER):
                self.cfg, job = job_graph(self.cfg, gpus=gpu_placement.has_gpus(), driven=True)
                self._graph = start(job.group)
                self._step = self._graph.call("trainer", "info")["step"]
        except BaseException:
            if getattr(self, "_graph", None) is not None:  # started, then failed: end it
                self._graph.kill()
                self._graph = None
            self._shutdown_ray()
            raise

    def sample(self, prompts: Sequence[Any], n: int | None = None, *,
               greedy: bool = False) -> Rollouts:
        """Generate ``n`` responses per prompt (default ``rollout.n_samples_per_prompt``;
        ``greedy``: one, at temperature 0) with the current weights. Prompts are texts
        (the chat template applied as ``data.apply_chat_template`` says), token-id lists,
        or dicts with ``prompt`` (or ``prompt_ids``) and fields for the reward (e.g.
        ``answer``)."""
        if self.job != "rl":
            raise UsageError(f"sample: a {self.job} trainer has no rollout engine; sample with "
                             "an rl trainer (train.job=rl)")
        if n is not None and n < 1:
            raise UsageError(f"sample: n must be >= 1, got {n}")
        return Rollouts(self._call("rollout", "sample", list(prompts), n, greedy, self._step + 1))

    def update(self, rollouts: Rollouts | Sequence[dict]) -> dict[str, float]:
        """One step; the step's metrics.

        RL (``train.job: rl``): ``rollouts`` as `sample` returned them, with
        ``rollouts["reward"]`` set: log-probs, KL, values, advantages, the actor (and
        critic) update and the weight sync (``actor/*``, ``reward/*``, ``time/*``, ...).
        Rollouts generated more than ``train.max_staleness`` weight versions ago are
        refused. Fine-tuning (sft, rm, dpo, kto): a list of records in the job's format
        (``prompt`` and ``completion`` or ``messages``; ``prompt, chosen, rejected``;
        ``prompt, completion, label``; field names as ``finetune.*_key`` say): the frozen
        reference's log-probs and one optimizer step (``loss``, ``rewards/*``, ``kto/kl``, ...)."""
        if self.job != "rl":
            if isinstance(rollouts, Rollouts) or not all(isinstance(r, dict) for r in rollouts):
                raise UsageError(f"update of a {self.job} trainer takes a list of records (dicts "
                                 "in the job's format), not rollouts")
            metrics = self._call("trainer", "update", list(rollouts))
            self._step += 1
            return metrics
        if not isinstance(rollouts, Rollouts):
            raise UsageError(f"update takes the Rollouts that sample returned, not "
                             f"{type(rollouts).__name__}")
        scores = rollouts.scores()
        self._check_fresh(rollouts)
        t = time.perf_counter()
        metrics = self._call("trainer", "__call__", rollouts.batch.with_tensors(scores=scores))
        if metrics:  # none: pooled for dynamic sampling, no step taken
            self._step += 1
            metrics["time/driver_update"] = time.perf_counter() - t
        return metrics

    def _check_fresh(self, rollouts: Rollouts) -> None:
        """Refuse rollouts the staleness contract would drop whole (the update would be none)."""
        info = self._call("trainer", "info")
        oldest = min(rollouts.batch.meta["weight_version"])
        if info["weight_version"] - oldest > info["max_staleness"]:
            raise UsageError(f"update: these rollouts were generated with weight version {oldest}, "
                             f"the trainer is at {info['weight_version']}, more than "
                             f"train.max_staleness={info['max_staleness']} apart; sample again, or "
                             "raise train.max_staleness")

    def validate(self) -> float | dict[str, float]:
        """RL: the mean reward (the config's reward function) of greedy responses to the
        config's validation prompts, logged as ``val/score``. Fine-tuning: the job's held-out
        metrics (``val/preference_accuracy``, ``val/reward_accuracy``, ``val/rm_accuracy``,
        ``val/loss``; ``val/score`` with ``finetune.val_score``), logged too."""
        return self._call("trainer", "validate")

    def save(self, path: str | Path | None = None) -> Path:
        """A checkpoint of the trained models and the run's state under ``path`` (default
        ``checkpoint.dir``); ``checkpoint.resume`` of a later run continues from it."""
        return Path(self._call("trainer", "save", None if path is None else str(path)))

    @property
    def step(self) -> int:
        return self._call("trainer", "info")["step"]

    @property
    def weight_version(self) -> int:
        """The version of the weights in the engine (1 after the initial sync, +1 per update)."""
        return self._call("trainer", "info")["weight_version"]

    @property
    def rank_processes(self) -> list[tuple[str, int]]:
        """``(Ray node id, pid)`` of every rank, in rank order (and the trainer's controller)."""
        if self._graph is None:
            raise UsageError("RLTrainer.rank_processes: the trainer is closed")
        return self._graph.processes("trainer")[1:]

    def close(self) -> None:
        """Finish the run (summary, reward curve, engine closed) and stop its processes."""
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.close()
            finally:
                self._shutdown_ray()

    def _call(self, role: str, method: str, *args: Any) -> Any:
        from mcore_rl.flow import FlowError

        if self._graph is None:
            raise UsageError(f"RLTrainer.{method}: the trainer is closed")
        try:
            return self._graph.call(role, method, *args)
        except FlowError as err:
            if isinstance(err.cause, UsageError):  # bad input found by a rank: the run goes on
                raise err.cause from None
            self._kill()
            raise
        except BaseException:
            self._kill()
            raise

    def _kill(self) -> None:
        """A failed rank leaves the world broken: end every process."""
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.kill()
        self._shutdown_ray()

    def _shutdown_ray(self) -> None:
        stop, self._stop_ray = self._stop_ray, None
        if stop is not None:
            stop()

    def __enter__(self) -> "RLTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_graph", None) is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class _Driver:
    is_controller = True


_DRIVER = _Driver()
