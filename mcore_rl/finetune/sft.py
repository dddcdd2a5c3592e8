"""Supervised fine-tuning: the token mean of the completion tokens' negative log-likelihood."""
from __future__ import annotations

from mcore_rl.algos.preference import sft_token_sum
from mcore_rl.data.batch import Batch
from mcore_rl.data.finetune_batch import completion_batch
from mcore_rl.finetune.jobs import FINETUNE_JOBS, FinetuneJob
from mcore_rl.finetune.logps import completion_logps


@FINETUNE_JOBS.register("sft")
class SFTJob(FinetuneJob):
    name = "sft"
    unit = "completion"

    def batch(self, examples, pad_id: int) -> Batch:
        return completion_batch(examples, pad_id)

    def loss_fn(self):
        def fn(outputs, mb):
            total, tokens = sft_token_sum(outputs["logprobs"], mb["response_mask"])
            return total, tokens, {}

        return fn

    def validate(self, run) -> dict[str, float]:
        if not run.val_examples:
            return {}
        batch = run.val_batch()
        nll = -completion_logps(run.model, batch).sum() / batch["response_mask"].sum()
        return {"val/loss": nll.item()}
