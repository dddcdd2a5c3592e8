"""Whole HF tensors gathered to one rank: `gather_tensor` one at a time, and
`gather_hf_tensors`, the whole model at once (the naive export).

Every piece of a tensor travels to one rank point to point over the trainer's process group,
on the device the parameters live on (NCCL on GPUs, gloo on CPU). `gather_tensor` is what
the device-side weight source of vLLM's GPU backends streams
(`mcore_rl.reshard.native.GatheredSource`): one full tensor at a time on the sending rank.
`gather_hf_tensors` is what streaming avoids, one rank holding the full model at once. It
serves as the benchmark's baseline (followed by ``save_file`` and an engine reload from
disk) and for debugging a plan: the result must equal the HF checkpoint the model was
loaded from.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.reshard.plan import ReshardPlan, TensorEntry
from mcore_rl.reshard.sources import piece_source


@torch.no_grad()
def gather_tensor(t: TensorEntry, views: dict, rank: int, dst_global: int, wire_dtype: torch.dtype,
                  group=None, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Collective over the ranks that hold a piece of ``t`` and ``dst_global``: the full HF
    tensor in ``wire_dtype`` on ``device`` at ``dst_global`` (a global rank), None elsewhere."""
    full = torch.empty(t.shape, dtype=wire_dtype, device=device) if rank == dst_global else None
    for p in t.pieces:
        if p.rank == rank == dst_global:
            part = piece_source(p, views).to(device=device, dtype=wire_dtype).reshape(p.shape)
        elif p.rank == rank:
            dist.send(piece_source(p, views).to(device=device, dtype=wire_dtype)
                      .contiguous().reshape(p.shape), dst=dst_global, group=group)
            continue
        elif rank == dst_global:
            part = torch.empty(p.shape, dtype=wire_dtype, device=device)
            dist.recv(part, src=p.rank, group=group)
        else:
            continue
        full.narrow(t.axis, p.start, p.shape[t.axis]).copy_(part)
    return full


@torch.no_grad()
def gather_hf_tensors(plan: ReshardPlan, views: dict, rank: int, dst: int = 0,
                      group=None) -> dict[str, torch.Tensor] | None:
    """Collective over the trainer ranks: HF name -> full tensor on ``dst``, None elsewhere.
    ``views`` are this rank's holdings' tensors (`mcore_rl.reshard.sources.local_holdings`)."""
    dst_global = dist.get_global_rank(group, dst) if group is not None else dst
    out = {t.hf_name: gather_tensor(t, views, rank, dst_global, plan.wire_dtype, group)
           for bucket in plan.buckets for t in bucket.tensors}
    return out if rank == dst_global else None
