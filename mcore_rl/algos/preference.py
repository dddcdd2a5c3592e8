"""Losses of the supervised and preference jobs, pure torch: DPO variants (registry
``DPO_LOSSES``), KTO, the Bradley-Terry reward-model loss and the SFT token mean.

Legend: P pairs (DPO, RM) or N completions (KTO). Inputs are per-sequence sums of token
log-probs over the completion (``*_logps`` [P] or [N]) and, where a loss normalises by
length, the completion token counts. Every function returns per-pair (per-completion)
losses; the job sums them and divides once by the global count (see `TrainEngine`), so a
loss is an exact mean over the whole batch however it is split over ranks.

The implicit reward of a completion y is ``beta * (log pi(y|x) - log pi_ref(y|x))``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcore_rl.registry import Registry


@dataclass
class PairLogps:
    """Summed completion log-probs of P preference pairs under the policy and the reference."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    """[P] completion tokens of each chosen completion (length-normalised losses)."""
    rejected_tokens: torch.Tensor

    @property
    def chosen_logratio(self) -> torch.Tensor:
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratio(self) -> torch.Tensor:
        return self.rejected - self.ref_rejected


DPO_LOSSES: Registry = Registry("DPO loss")
"""``finetune.dpo_loss`` name -> ``fn(PairLogps, beta=, label_smoothing=) -> [P] losses``."""


@DPO_LOSSES.register("sigmoid")
def dpo_sigmoid(x: PairLogps, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al., 2023): -log sigmoid(beta * h), h the chosen minus the rejected
    log-ratio. With ``label_smoothing`` e > 0 it is conservative DPO (cDPO), which assumes a
    fraction e of the labels is flipped: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)."""
    h = x.chosen_logratio - x.rejected_logratio
    return (-(1.0 - label_smoothing) * F.logsigmoid(beta * h)
            - label_smoothing * F.logsigmoid(-beta * h))


@DPO_LOSSES.register("ipo")
def dpo_ipo(x: PairLogps, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """IPO (Azar et al., 2023, eq. 17): (h - 1 / (2 beta))^2, where each side's log-ratio is
    divided by its completion length first (the length-normalised form TRL computes, which
    the paper's results use)."""
    h = (x.chosen_logratio / x.chosen_tokens.clamp(min=1)
         - x.rejected_logratio / x.rejected_tokens.clamp(min=1))
    return (h - 1.0 / (2.0 * beta)) ** 2


@DPO_LOSSES.register("hinge")
def dpo_hinge(x: PairLogps, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """SLiC-style hinge: max(0, 1 - beta * h)."""
    h = x.chosen_logratio - x.rejected_logratio
    return torch.relu(1.0 - beta * h)


def chosen_nll(x: PairLogps) -> torch.Tensor:
    """[P] negative log-likelihood per token of each chosen completion: the term that RPO
    (Pang et al., 2024) adds, weighted by alpha, to each pair's DPO loss."""
    return -x.chosen / x.chosen_tokens.clamp(min=1)


def implicit_rewards(x: PairLogps, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) implicit rewards [P], detached."""
    return (beta * x.chosen_logratio).detach(), (beta * x.rejected_logratio).detach()


def kto_reference_point(mismatched_logps: torch.Tensor, mismatched_ref_logps: torch.Tensor) -> torch.Tensor:
    """KTO's KL estimate z0: the mean over mismatched (prompt, other completion) pairs of
    log pi - log pi_ref, clamped at 0 and detached (Ethayarajh et al., 2024)."""
    return (mismatched_logps - mismatched_ref_logps).mean().clamp(min=0).detach()


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
             reference_point: torch.Tensor | float, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-completion KTO loss [N]: desirable completions w_d (1 - sigmoid(beta (r - z0))),
    undesirable ones w_u (1 - sigmoid(beta (z0 - r))), r = log pi - log pi_ref."""
    r = logps - ref_logps
    z0 = torch.as_tensor(reference_point, dtype=r.dtype)
    good = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0)))
    bad = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r)))
    return torch.where(desirable.bool(), good, bad)


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                       margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss [P]: -log sigmoid(r_chosen - r_rejected - margin)."""
    return -F.logsigmoid(chosen_scores - rejected_scores - margin)


def sft_token_sum(logprobs: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood over completion tokens, their count): the SFT token
    mean once divided (by the engine, over the global batch)."""
    m = completion_mask.to(logprobs.dtype)
    return -(logprobs * m).sum(), m.sum()
