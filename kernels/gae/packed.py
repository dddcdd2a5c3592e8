"""Packed sequences <-> padded [sequences, max_len] rows, for the torch GAE path."""
from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Validate ``cu_seqlens`` ([S + 1], 0 first, ``total`` last, non-decreasing); return int64."""
    cu = cu_seqlens.long()
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu.shape)}")
    host = cu.cpu()
    if int(host[0]) != 0 or int(host[-1]) != total or bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {total}, got {host.tolist()}")
    return cu


def pack_index(cu: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Flat index of every packed token into a [S, max_len] row-major buffer; returns (index, S, max_len)."""
    lengths = cu[1:] - cu[:-1]
    n_seq = lengths.numel()
    max_len = int(lengths.max()) if n_seq else 0
    seq = torch.repeat_interleave(torch.arange(n_seq, device=cu.device), lengths)
    pos = torch.arange(seq.numel(), device=cu.device) - cu[:-1][seq]
    return seq * max_len + pos, n_seq, max_len


def to_padded(x: torch.Tensor, index: torch.Tensor, n_seq: int, max_len: int, dtype=None) -> torch.Tensor:
    """[total] -> [S, max_len], zeros after each sequence's end."""
    out = torch.zeros(n_seq * max_len, dtype=dtype or x.dtype, device=x.device)
    out[index] = x.to(out.dtype)
    return out.view(n_seq, max_len)
