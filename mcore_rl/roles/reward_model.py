"""``reward.name: reward_model`` in the RL graph: the reward controller is a Megatron worker
group that holds the reward model (``reward.rm_tp * rm_pp * rm_dp`` ranks) and scores each
rollout batch; the trainer reaches the same model to score its greedy validation
responses (``val/rm_score``).

    Controller("reward", factory(RewardModelScore, cfg_data), data_input=rollout,
               data_output=scored, strategy=ServedMegatron(Megatron(tp=2), SERVICE))

`ServedMegatron` starts the worker group as `Megatron` does and publishes, from the
controller's process, a `RewardModelService` under ``SERVICE``: its calls run on every rank
of the group (`WorkerGroup.invoke`), under the same lock as the controller's own calls, so
the ranks always see one call at a time, in the same order. On the trainer's side,
`trainer_rewards` gives the reward that scores validation (``reward.val_reward``, or the
reward model itself through the service) and the ``val/rm_score`` metric.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Sequence

from mcore_rl.config import RLConfig, config_from_dict
from mcore_rl.data.batch import Batch
from mcore_rl.flow import Controller, DataStream, Megatron, factory

SERVICE = "reward_model"
"""The name the reward controller publishes its model's scoring under."""


class RewardModelScore:
    """The reward role on every rank of the reward model's worker group: a rollout `Batch`
    -> the same batch with ``scores`` (the reward model's, one per response), its metrics
    (``reward/rm_truncated``) and ``time/score`` in ``info``."""

    def __init__(self, cfg_data: dict):
        from mcore_rl.flow import rank_context
        from mcore_rl.rl.reward_model import build_reward_model

        cfg = config_from_dict(cfg_data)
        self.model = build_reward_model(cfg.reward, rank_context(), dtype=cfg.model.dtype)

    def __call__(self, batch: Batch) -> Batch:
        t = time.perf_counter()
        prompts = [m["prompt"] for m in batch.meta["prompt_meta"]]
        scores, metrics = self.model.score(prompts, batch.meta["response_text"])
        batch = batch.with_tensors(scores=scores)
        batch.info.update(metrics)
        batch.info["time/score"] = time.perf_counter() - t
        return batch

    def score_texts(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """Scores of any texts (what `RewardModelService.score` runs on every rank)."""
        return self.model.score(prompts, responses)[0].tolist()


class RewardModelService:
    """Published by the reward controller: the reward model's scores of any texts."""

    def __init__(self, group: Any):
        self.group = group

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.group.invoke("score_texts", prompts, responses)


@dataclass(frozen=True)
class ServedMegatron:
    """A `Megatron` worker group whose model other controllers can use too: the group's
    `RewardModelService` is published as ``name``."""

    runs_ranks: ClassVar[bool] = True
    """Its ranks are processes of their own, one rank included (`gpu_placement.runs_ranks`)."""
    layout: Megatron
    name: str = SERVICE

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    def __call__(self, spec, placements: list[dict] | None = None) -> "_ServedGroup":
        return _ServedGroup(self.layout(spec, placements), self.name)

    def __str__(self) -> str:
        return f"{self.layout} serving '{self.name}'"


class _ServedGroup:
    """The executor: the worker group, called under the lock its published service holds."""

    def __init__(self, group: Any, name: str):
        from mcore_rl.flow import publish

        self.group = group
        self.lock = publish(name, RewardModelService(group))

    def __call__(self, item: Any) -> Any:
        with self.lock:
            return self.group(item)

    def run_loop(self, spec: Any, hub: Any, num_epochs: int | None):
        """The controller's item loop here (each call under the service's lock), the batch
        then handed to every rank."""
        from mcore_rl.flow.item_loop import ItemLoop

        return ItemLoop(spec, hub, self).run(num_epochs)

    def invoke(self, method: str, *args: Any, role: str | None = None, **kwargs: Any) -> Any:
        with self.lock:
            return self.group.invoke(method, *args, role=role, **kwargs)

    def processes(self) -> list[tuple[str, int]]:
        return self.group.processes()

    def close(self) -> None:
        self.group.close()


def reward_controller(cfg: RLConfig, cfg_data: dict, rollout: DataStream,
                      scored: DataStream, devices: Any = None) -> Controller:
    """The graph's reward controller for ``reward.name: reward_model``."""
    r, p = cfg.reward, cfg.parallel
    layout = Megatron(tp=r.rm_tp, pp=r.rm_pp, dp=r.rm_dp, seed=cfg.train.seed,
                      threads_per_rank=p.cpu_threads_per_rank, backend=p.backend)
    return Controller("reward", factory(RewardModelScore, cfg_data), data_input=rollout,
                      data_output=scored, strategy=ServedMegatron(layout), devices=devices)


class RewardModelClient:
    """The trainer's handle on the reward controller's model (the controller rank's; the
    other ranks hold one without a service and never score). It scores as a
    `mcore_rl.rewards.RewardScorer` does, and gives ``val/rm_score``."""

    def __init__(self, service: Any = None):
        self.service = service
        self._last: tuple[tuple, Any] | None = None

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              metas: Sequence[dict] | None = None):
        """[B] float32 scores (the last call's again for the same texts: validation asks
        twice when ``val/score`` is the reward model's), and no metrics."""
        import torch

        key = (tuple(prompts), tuple(responses))
        if self._last is None or self._last[0] != key:
            self._last = (key, torch.tensor(self.service.score(list(prompts), list(responses)),
                                            dtype=torch.float32))
        return self._last[1], {}

    def validation_metrics(self, batch: Batch) -> dict[str, float]:
        """``val/rm_score``: the reward model's mean score of the greedy validation batch."""
        prompts = [m["prompt"] for m in batch.meta["prompt_meta"]]
        scores, _ = self.score(prompts, batch.meta["response_text"])
        return {"val/rm_score": scores.mean().item()}

    def close(self) -> None:
        pass


def trainer_rewards(cfg: RLConfig, is_controller: bool):
    """For the trainer of a ``reward_model`` run: (the reward of its validation, the
    `RewardModelClient` that adds ``val/rm_score``). The rollouts arrive scored."""
    from mcore_rl.flow import lookup
    from mcore_rl.rewards import RewardScorer

    client = RewardModelClient(lookup(SERVICE) if is_controller else None)
    if cfg.reward.val_reward:
        return RewardScorer.from_config(replace(cfg.reward, name=cfg.reward.val_reward,
                                                weights={})), client
    return client, client
