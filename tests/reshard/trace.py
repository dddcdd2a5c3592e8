"""Trace an engine parameter back to the trainer ranks and Megatron tensors that feed it."""
from __future__ import annotations

from mcore_rl.engines.param_plan import EngineParam
from mcore_rl.reshard.plan import ReshardPlan


def engine_param_sources(plan: ReshardPlan, param: EngineParam) -> set[tuple[int, str, int | None]]:
    """(trainer rank, Megatron key, layer) of every piece that one engine rank's parameter
    reads: e.g. at trainer TP2 and engine TP2 with equal head splits, ``qkv_proj`` of engine
    rank 1 is fed by trainer tp_rank 1 alone."""
    entries = {t.hf_name: t for b in plan.buckets for t in b.tensors}
    found = set()
    for source in param.sources:
        entry = entries[source.hf_name]
        for p in entry.pieces:
            if entry.axis == param.axis:
                end = p.start + p.shape[entry.axis]
                if not (p.start < source.start + source.length and source.start < end):
                    continue
            found.add((p.rank, p.holding.key, p.holding.layer))
    return found
