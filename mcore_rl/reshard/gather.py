"""`gather_hf_tensors`: the whole model as HF tensors in one process (the naive export).

What streaming avoids: every piece of every tensor travels to one rank (point-to-point over
the trainer's process group), which then holds the full model at once. Used as the
benchmark's baseline (followed by ``save_file`` and an engine reload from disk) and for
debugging a plan: the result must equal the HF checkpoint the model was loaded from.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.reshard.plan import ReshardPlan
from mcore_rl.reshard.sources import piece_source


@torch.no_grad()
def gather_hf_tensors(plan: ReshardPlan, views: dict, rank: int, dst: int = 0,
                      group=None) -> dict[str, torch.Tensor] | None:
    """Collective over the trainer ranks: HF name -> full tensor on ``dst``, None elsewhere.
    ``views`` are this rank's holdings' tensors (`mcore_rl.reshard.sources.local_holdings`)."""
    out: dict[str, torch.Tensor] = {}
    dst_global = dist.get_global_rank(group, dst) if group is not None else dst
    for bucket in plan.buckets:
        for t in bucket.tensors:
            full = torch.empty(t.shape, dtype=plan.wire_dtype) if rank == dst_global else None
            for p in t.pieces:
                if p.rank == rank == dst_global:
                    part = piece_source(p, views).to(plan.wire_dtype).reshape(p.shape)
                elif p.rank == rank:
                    dist.send(piece_source(p, views).to(plan.wire_dtype).contiguous().reshape(p.shape),
                              dst=dst_global, group=group)
                    continue
                elif rank == dst_global:
                    part = torch.empty(p.shape, dtype=plan.wire_dtype)
                    dist.recv(part, src=p.rank, group=group)
                else:
                    continue
                full.narrow(t.axis, p.start, p.shape[t.axis]).copy_(part)
            if full is not None:
                out[t.hf_name] = full
    return out if rank == dst_global else None
