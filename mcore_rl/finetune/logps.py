"""Per-sequence completion log-probs from the engine's per-token outputs."""
from __future__ import annotations

import torch

from mcore_rl.data.batch import Batch


def summed_logps(outputs: dict, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """([b] summed log-probs of the completion tokens, [b] completion token counts)."""
    mask = mb["response_mask"].to(outputs["logprobs"].dtype)
    return (outputs["logprobs"] * mask).sum(-1), mask.sum(-1)


@torch.no_grad()
def completion_logps(engine, batch: Batch) -> torch.Tensor:
    """[B] summed completion log-probs of every sequence under ``engine`` (a forward-only
    pass; the same on every rank)."""
    return engine.forward(batch, lambda outputs, mb: {"logps": summed_logps(outputs, mb)[0]})["logps"]
