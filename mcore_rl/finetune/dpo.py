"""DPO: preference pairs against a frozen reference (``finetune.dpo_loss``, ``beta``)."""
from __future__ import annotations

import torch

from mcore_rl.algos.preference import DPO_LOSSES, PairLogps, chosen_nll, implicit_rewards
from mcore_rl.data.batch import Batch
from mcore_rl.data.finetune_batch import pair_batch, sides
from mcore_rl.finetune.jobs import FINETUNE_JOBS, FinetuneJob
from mcore_rl.finetune.logps import completion_logps, summed_logps


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summed per-pair rewards, margins and accuracy (the engine divides by the pair count)."""
    return {"rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
            "rewards/margin": (chosen - rejected).sum(),
            "rewards/accuracy": (chosen > rejected).float().sum()}


@FINETUNE_JOBS.register("dpo")
class DPOJob(FinetuneJob):
    name = "dpo"
    needs_reference = True
    unit = "pair"

    def batch(self, examples, pad_id: int) -> Batch:
        return pair_batch(examples, pad_id)

    def prepare(self, run, batch: Batch) -> Batch:
        return batch.with_tensors(ref_logps=run.reference_logps(batch))

    def loss_fn(self):
        loss, beta, smoothing = DPO_LOSSES.get(self.f.dpo_loss), self.f.beta, self.f.label_smoothing
        alpha = self.f.rpo_alpha

        def fn(outputs, mb):
            logps, tokens = summed_logps(outputs, mb)
            (c, r), (rc, rr), (tc, tr) = sides(logps, mb), sides(mb["ref_logps"], mb), sides(tokens, mb)
            x = PairLogps(c, r, rc, rr, tc, tr)
            losses = loss(x, beta=beta, label_smoothing=smoothing)
            metrics = pair_metrics(*implicit_rewards(x, beta))
            if alpha:
                nll = chosen_nll(x)
                losses = losses + alpha * nll
                metrics["nll/chosen"] = nll.detach().sum()
            return losses.sum(), len(losses), metrics

        return fn

    def validate(self, run) -> dict[str, float]:
        if not run.val_examples:
            return {}
        batch = run.val_batch()
        ratio = completion_logps(run.model, batch) - run.reference_logps(batch)
        chosen, rejected = ratio[0::2], ratio[1::2]
        return {"val/preference_accuracy": (chosen > rejected).float().mean().item(),
                "val/margin": (self.f.beta * (chosen - rejected)).mean().item()}
