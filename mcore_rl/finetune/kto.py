"""KTO: unpaired desirable/undesirable completions against a frozen reference, with the KL
reference point z0 measured on mismatched pairs of the global batch before the update."""
from __future__ import annotations

import torch

from mcore_rl.algos.preference import kto_loss, kto_reference_point
from mcore_rl.data.batch import Batch
from mcore_rl.data.finetune_batch import completion_batch, mismatched_batch
from mcore_rl.data.finetune_records import Completion
from mcore_rl.finetune.jobs import FINETUNE_JOBS, FinetuneJob
from mcore_rl.finetune.logps import completion_logps, summed_logps


@FINETUNE_JOBS.register("kto")
class KTOJob(FinetuneJob):
    name = "kto"
    needs_reference = True
    unit = "completion"

    def batch(self, examples: list[Completion], pad_id: int) -> Batch:
        batch = completion_batch(examples, pad_id)
        batch.info["mismatched"] = mismatched_batch(examples, pad_id)
        return batch

    def prepare(self, run, batch: Batch) -> Batch:
        """Reference log-probs of the batch, and z0: policy and reference log-probs of the
        mismatched pairs, in forward-only (no-grad) passes over the whole batch."""
        mismatched = batch.info.pop("mismatched")
        z0 = kto_reference_point(completion_logps(run.model, mismatched), run.reference_logps(mismatched))
        batch.info["kto_reference_point"] = float(z0)
        return batch.with_tensors(ref_logps=run.reference_logps(batch))

    def loss_fn(self):
        f = self.f

        def fn(outputs, mb):
            logps, _ = summed_logps(outputs, mb)
            real = mb["response_mask"].sum(-1) > 0  # filler rows of a uniform micro-batch shape
            z0 = mb.info["kto_reference_point"]
            losses = kto_loss(logps[real], mb["ref_logps"][real], mb["desirable"][real], z0,
                              beta=f.beta, desirable_weight=f.desirable_weight,
                              undesirable_weight=f.undesirable_weight)
            rewards = f.beta * (logps[real] - mb["ref_logps"][real]).detach()
            good = mb["desirable"][real].bool()
            metrics = {"kl": torch.tensor(z0) * len(losses), "desirable": good.float().sum(),
                       "rewards/desirable_sum": rewards[good].sum(),
                       "rewards/undesirable_sum": rewards[~good].sum()}
            return losses.sum(), len(losses), metrics

        return fn

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Means over the desirable and the undesirable completions of the batch."""
        share = metrics.pop("desirable")
        good, bad = metrics.pop("rewards/desirable_sum"), metrics.pop("rewards/undesirable_sum")
        out = {"kto/kl": metrics.pop("kl"), **metrics}
        if share > 0:
            out["rewards/desirable"] = good / share
        if share < 1:
            out["rewards/undesirable"] = bad / (1 - share)
        return out

    def validate(self, run) -> dict[str, float]:
        if not run.val_examples:
            return {}
        batch = run.val_batch()
        ratio = completion_logps(run.model, batch) - run.reference_logps(batch)
        right = torch.where(batch["desirable"].bool(), ratio > 0, ratio < 0)
        return {"val/reward_accuracy": right.float().mean().item()}
