"""Reward-model training: a Bradley-Terry loss on the scalar head over preference pairs
(with a per-pair margin from ``finetune.margin_key``)."""
from __future__ import annotations

from mcore_rl.algos.preference import bradley_terry_loss
from mcore_rl.data.batch import Batch
from mcore_rl.data.finetune_batch import pair_batch, sides
from mcore_rl.finetune.dpo import pair_metrics
from mcore_rl.finetune.jobs import FINETUNE_JOBS, FinetuneJob


@FINETUNE_JOBS.register("rm")
class RewardModelJob(FinetuneJob):
    name = "rm"
    role = "critic"  # a scalar head: fresh on a causal LM, loaded from a reward model
    engine_kind = "reward"
    unit = "pair"

    def batch(self, examples, pad_id: int) -> Batch:
        return pair_batch(examples, pad_id)

    def loss_fn(self):
        def fn(outputs, mb):
            chosen, rejected = sides(outputs["reward"], mb)
            margin, _ = sides(mb["margin"].to(chosen.dtype), mb)
            losses = bradley_terry_loss(chosen, rejected, margin)
            return losses.sum(), len(losses), pair_metrics(chosen.detach(), rejected.detach())

        return fn

    def validate(self, run) -> dict[str, float]:
        if not run.val_examples:
            return {}
        scores = run.model.forward(run.val_batch())["reward"]
        return {"val/rm_accuracy": (scores[0::2] > scores[1::2]).float().mean().item()}
