"""What one trainer rank sends: its holdings of Megatron tensors and views of their data."""
from __future__ import annotations

import torch

from mcore_rl.reshard.plan import Holding, Piece


def unwrap(chunk):
    """The model inside a wrapper (DDP, Float16Module), or the chunk itself."""
    return getattr(chunk, "module", chunk)


def parameters(chunks: list) -> list[torch.nn.Parameter]:
    """This rank's parameters, in model order."""
    return [p for chunk in chunks for p in unwrap(chunk).parameters()]


def pointers(params) -> tuple[int, ...]:
    """Where each parameter's data lies (a parameter moved if this changed)."""
    return tuple(p.data_ptr() for p in params)


def local_holdings(chunks: list, rank: int) -> tuple[list[Holding], dict[tuple, torch.Tensor]]:
    """What this rank holds (per Megatron's sharded state dict) and views of those tensors,
    by `Holding.view_key`."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from mcore_rl.models.hf_weights import iter_sharded_tensors

    holdings, views = [], {}
    for chunk in chunks:
        for sh in iter_sharded_tensors(unwrap(chunk)):
            n = sh.prepend_axis_num  # 1: stacked over layers; 2: over layers, then experts
            layer = int(sh.global_offset[0]) if n else None
            expert = int(sh.global_offset[1]) if n == 2 else None
            offsets = tuple(int(o) for o in sh.global_offset[n:])
            h = Holding(rank, sh.key, layer, offsets, tuple(int(s) for s in sh.local_shape),
                        is_main_replica(sh.replica_id), expert)
            holdings.append(h)
            views[h.view_key] = sh.data.reshape(h.shape)
    return holdings, views


def piece_source(piece: Piece, views: dict) -> torch.Tensor:
    """The part of a holding's tensor (``views``: `local_holdings`) that ``piece`` is made of."""
    h = piece.holding
    return piece.cut(views[h.view_key])
