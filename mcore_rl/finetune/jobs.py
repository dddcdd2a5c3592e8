"""What a fine-tuning job is (`FinetuneJob`) and the registry of them (``FINETUNE_JOBS``).

A job turns tokenized records into a batch, adds what its loss needs from frozen models
(reference log-probs, KTO's reference point: forward-only passes before the update), gives
the train engine its loss function, and measures held-out data. The loop that runs it is
``mcore_rl.finetune.loop``.
"""
from __future__ import annotations

from typing import Callable

from mcore_rl.data.batch import Batch
from mcore_rl.registry import Registry

FINETUNE_JOBS: Registry = Registry("fine-tuning job")
"""``train.job`` name -> `FinetuneJob` subclass."""


class FinetuneJob:
    """Base of the jobs; the defaults are those of a causal-LM job without a reference."""

    name = ""
    role = "actor"
    """`mcore_rl.models.build_model` role of the trained model."""
    engine_kind = "lm"
    """`TrainEngine` kind of the trained model."""
    needs_reference = False
    """Whether the loss needs a frozen reference model."""
    unit = "record"
    """What ``finetune.batch_size`` counts."""
    online = False
    """Whether batches come from the rollout engine (`next_batch`) instead of the dataset."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.f = cfg.finetune

    def batch(self, examples: list, pad_id: int) -> Batch:
        raise NotImplementedError

    def next_batch(self, run) -> Batch | None:
        """This step's batch: ``finetune.batch_size`` records of the dataset (None: no
        update this step)."""
        return self.batch(run.examples.take(self.f.batch_size), run.tokenizer.pad_id)

    def after_update(self, run) -> dict[str, float]:
        """Work after the optimizer step (online jobs: the weight sync); its metrics."""
        return {}

    def prepare(self, run, batch: Batch) -> Batch:
        """Fields the loss needs from frozen models (collective). Default: none."""
        return batch

    def loss_fn(self) -> Callable:
        raise NotImplementedError

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The engine's metrics (sums over the batch divided by its unit count) -> logged ones."""
        return metrics

    def validate(self, run) -> dict[str, float]:
        """Held-out metrics (collective); empty without validation records."""
        return {}
