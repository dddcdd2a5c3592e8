"""Megatron's auxiliary losses of mixture-of-experts layers over one training step, as
metrics.

Megatron's routers add each micro-batch's load-balancing loss (and z-loss, if on) to a
process-wide tracker, per layer and without their coefficient; the train engine clears the
tracker before a step and reads it after (collective: the pipeline stages' layers are
summed, the data-parallel ranks averaged), so actor and critic steps do not mix.
"""
from __future__ import annotations


def clear_aux_losses() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def aux_loss_metrics(num_micro_batches: int, num_moe_layers: int) -> dict[str, float]:
    """``moe/<loss>``: the step's mean over MoE layers and this rank's micro-batches that
    hold real tokens (no coefficient), averaged over data-parallel ranks; empty when no
    auxiliary loss is on. Every rank of the model must call it."""
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker,
                                                         reduce_aux_losses_tracker_across_ranks)

    tracker = get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    names = sorted(tracker)
    reduce_aux_losses_tracker_across_ranks(names)
    out = {f"moe/{name}": float(tracker[name]["values"].sum()) / (num_moe_layers * max(1, num_micro_batches))
           for name in names}
    clear_aux_losses_tracker()
    return out
