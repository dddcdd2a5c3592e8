"""Reward-model training: a Bradley-Terry loss on the scalar head over preference pairs
(with a per-pair margin from ``finetune.margin_key``)."""
from __future__ import annotations

from dataclasses import replace

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
        """Pairs, each side ending at the token HF's ``*ForSequenceClassification`` pools (the
        rightmost one that is not the pad token), where the train engine reads the score:
        where pad equals EOS (SmolLM2) a trailing EOS is dropped, so the model is trained at
        the token that HF, and ``reward.name: reward_model``, score it at."""
        return pair_batch([replace(p, chosen_ids=_before_trailing(p.chosen_ids, pad_id),
                                   rejected_ids=_before_trailing(p.rejected_ids, pad_id))
                           for p in examples], pad_id)

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


def _before_trailing(ids: list[int], pad_id: int) -> list[int]:
    """``ids`` without the pad tokens at their end."""
    end = len(ids)
    while end and ids[end - 1] == pad_id:
        end -= 1
    return list(ids[:end])
