"""`RLTrainer`: the single-controller view of a training run. The script that creates it is
the driver; the trainer's ranks (TP x PP x DP) are the Ray actors of one Megatron worker
group, each holding the same run as a rank of ``mcore-rl train`` (`RLWorker`; for the
fine-tuning jobs sft, rm, dpo and kto, `FinetuneWorker`), and every call runs on all of
them at once and returns rank 0's answer."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

from mcore_rl.api.rollouts import Rollouts
from mcore_rl.config import RLConfig, load_config, validate_config
from mcore_rl.config.loader import config_to_dict
from mcore_rl.errors import UsageError

JOBS = ("rl", "sft", "rm", "dpo", "kto")
"""``train.job`` of the configs an `RLTrainer` runs."""
ALGO_ALIASES = {"ppo": "gae"}
"""``algo=`` of `RLTrainer`: an advantage estimator's name (``grpo``, ``rloo``, ...), or
``ppo`` for GAE with a critic."""


class RLTrainer:
    """Drive distributed trainer ranks from a Python script or a notebook.

    ``RLTrainer(model="path/to/hf_model", algo="ppo", tp=2)`` builds a run from keyword
    arguments and ``overrides`` (``section.field=value``, as on the command line);
    `from_config` from a YAML file. Building it validates the config (one-line
    `UsageError`), starts Ray (a local cluster unless ``address`` or a running one is
    given), starts the ranks and runs what the config asks for before the first step: the
    warm start, or resuming from a checkpoint. Then:

    - `sample` (prompts -> `Rollouts`),
    - `update` (rewarded rollouts -> the step's metrics: advantages, losses, the optimizer
      step and the weight sync into the engine),
    - `validate`, `save`, `close` (or use it as a context manager).

    Metrics of every update also go to ``<logging.dir>/metrics.jsonl``."""

    def __init__(self, model: str | None = None, algo: str = "grpo", tp: int = 1, pp: int = 1,
                 dp: int = 1, *, overrides: Sequence[str] = (), config: RLConfig | None = None,
                 devices: Sequence[int] | None = None, address: str | None = None):
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
        self.cfg = config
        p = config.parallel
        self.world_size = (p.dp or 1) * p.tp * p.pp
        validate_config(config, world_size=self.world_size)
        self.job = config.train.job
        if self.job not in JOBS:
            raise UsageError(f"RLTrainer runs train.job {', '.join(JOBS)}, not {self.job!r}; "
                             f"run it with mcore-rl train")
        if self.job == "rl":
            from mcore_rl.rewards.reward_model import REWARD_MODEL
            from mcore_rl.rl.setup import check_job

            if config.reward.name == REWARD_MODEL:
                raise UsageError("RLTrainer does not start the worker group that "
                                 "reward.name=reward_model scores with: give update() rollouts "
                                 "with their 'reward' (validate() scores with reward.name: set "
                                 "a rule-based one), or run the config with mcore-rl train")
            check_job(config)
        else:
            from mcore_rl.finetune.check import check_finetune_job

            check_finetune_job(config)
        self._group: Any = None
        self._stop_ray = None
        self._start(devices, address)

    @classmethod
    def from_config(cls, path: str | Path, overrides: Sequence[str] = (), *,
                    devices: Sequence[int] | None = None, address: str | None = None) -> "RLTrainer":
        """A trainer for the YAML config at ``path`` with ``section.field=value`` overrides."""
        return cls(config=load_config(path, list(overrides)), devices=devices, address=address)

    def _start(self, devices: Sequence[int] | None, address: str | None) -> None:
        from mcore_rl.api.finetune_worker import FinetuneWorker
        from mcore_rl.api.worker import RLWorker
        from mcore_rl.flow import Megatron, factory, ray_shim

        ray = ray_shim.require()
        if not ray.is_initialized():
            self._stop_ray = ray_shim.start_local(address=address, include_dashboard=False,
                                                  log_to_driver=True)
        p = self.cfg.parallel
        strategy = Megatron(tp=p.tp, pp=p.pp, dp=self.world_size // (p.tp * p.pp), vpp=p.vpp,
                            seed=self.cfg.train.seed, threads_per_rank=p.cpu_threads_per_rank,
                            backend=p.backend, ep=p.ep, etp=p.etp)
        worker = RLWorker if self.job == "rl" else FinetuneWorker
        spec = SimpleNamespace(function=factory(worker, config_to_dict(self.cfg)),
                               num_workers=self.world_size,
                               devices=tuple(devices) if devices is not None else None)
        try:
            self._group = strategy(spec)
        except BaseException:
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
        return Rollouts(self._call("sample", list(prompts), n, greedy))

    def update(self, rollouts: Rollouts | Sequence[dict]) -> dict[str, float]:
        """One step; the step's metrics.

        RL (``train.job: rl``): ``rollouts`` as `sample` returned them, with
        ``rollouts["reward"]`` set: log-probs, KL, values, advantages, the actor (and
        critic) update and the weight sync (``actor/*``, ``reward/*``, ``time/*``, ...).
        Fine-tuning (sft, rm, dpo, kto): a list of records in the job's format (``prompt``
        and ``completion`` or ``messages``; ``prompt, chosen, rejected``; ``prompt,
        completion, label``; field names as ``finetune.*_key`` say): the frozen reference's
        log-probs and one optimizer step (``loss``, ``rewards/*``, ``kto/kl``, ...)."""
        if self.job != "rl":
            if isinstance(rollouts, Rollouts) or not all(isinstance(r, dict) for r in rollouts):
                raise UsageError(f"update of a {self.job} trainer takes a list of records (dicts "
                                 "in the job's format), not rollouts")
            return self._call("update", list(rollouts))
        if not isinstance(rollouts, Rollouts):
            raise UsageError(f"update takes the Rollouts that sample returned, not "
                             f"{type(rollouts).__name__}")
        scores = rollouts.scores()
        t = time.perf_counter()
        metrics = self._call("update", rollouts.batch, scores)
        metrics["time/driver_update"] = time.perf_counter() - t
        return metrics

    def validate(self) -> float | dict[str, float]:
        """RL: the mean reward (the config's reward function) of greedy responses to the
        config's validation prompts, logged as ``val/score``. Fine-tuning: the job's held-out
        metrics (``val/preference_accuracy``, ``val/reward_accuracy``, ``val/rm_accuracy``,
        ``val/loss``; ``val/score`` with ``finetune.val_score``), logged too."""
        return self._call("validate")

    def save(self, path: str | Path | None = None) -> Path:
        """A checkpoint of the trained models and the run's state under ``path`` (default
        ``checkpoint.dir``); ``checkpoint.resume`` of a later run continues from it."""
        return Path(self._call("save", None if path is None else str(path)))

    @property
    def step(self) -> int:
        return self._call("info")["step"]

    @property
    def weight_version(self) -> int:
        """The version of the weights in the engine (1 after the initial sync, +1 per update)."""
        return self._call("info")["weight_version"]

    @property
    def rank_processes(self) -> list[tuple[str, int]]:
        """``(Ray node id, pid)`` of every rank, in rank order."""
        if self._group is None:
            raise UsageError("RLTrainer.rank_processes: the trainer is closed")
        return self._group.processes()

    def close(self) -> None:
        """Finish the run (summary, reward curve, engine closed) and stop the ranks."""
        group, self._group = self._group, None
        if group is not None:
            try:
                group.invoke("close")
                group.close()
            finally:
                group.kill()
                self._shutdown_ray()

    def _call(self, method: str, *args: Any) -> Any:
        if self._group is None:
            raise UsageError(f"RLTrainer.{method}: the trainer is closed")
        try:
            return self._group.invoke(method, *args)
        except UsageError:
            raise
        except BaseException:
            group, self._group = self._group, None  # a failed rank leaves the world broken
            group.kill()
            self._shutdown_ray()
            raise

    def _shutdown_ray(self) -> None:
        stop, self._stop_ray = self._stop_ray, None
        if stop is not None:
            stop()

    def __enter__(self) -> "RLTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_group", None) is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
