"""Context parallelism: each sequence split over the CP ranks, attention over all of it.

A micro-batch of T positions (padded to a multiple of 2 x CP) is cut into 2 x CP chunks of
c = T / (2 CP); CP rank r runs chunks r and 2 CP - 1 - r (Megatron's load-balanced order:
under causal attention an early chunk is cheap and a late one dear, so every rank gets one
of each and the same work). Each rank's layers see only its 2c tokens; attention gathers
keys and values from every CP rank (`gather_sequence`, whose backward sums each rank's
gradient back to the rank that owns the tokens) and masks causally by global position.

The outputs a loss reads (log-probs, entropy, values: [b, T], small) are computed per rank
at its own positions and summed over the CP group into the whole [b, T] (`cp_sum`), so every
CP rank computes the same loss over every token; the backward of that sum is the identity,
so each rank's parameters get the gradient through its own positions, and DDP's all-reduce
over data x context parallel ranks adds them up. The token count the gradient is divided by
is reported by CP rank 0 alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_positions(T: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions CP rank ``rank`` runs: chunks ``rank`` and ``2 cp - 1 - rank`` of
    a sequence of ``T`` (a multiple of 2 x cp) positions. [T / cp] long."""
    if T % (2 * cp):
        raise ValueError(f"a sequence of {T} positions cannot split into {2 * cp} chunks")
    c = T // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device),
                      torch.arange(second, second + c, device=device)])


def rank_order(T: int, cp: int, device=None) -> torch.Tensor:
    """The global positions of the CP ranks' tokens laid end to end in rank order (what an
    all-gather gives). [T] long."""
    return torch.cat([chunk_positions(T, cp, r, device) for r in range(cp)])


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _GatherSequence(torch.autograd.Function):
    """[2c, ...] per rank -> [T, ...] in global order; backward: each rank's share of the
    summed gradient."""

    @staticmethod
    def forward(ctx, x, group, order):
        ctx.group = group
        cp = dist.get_world_size(group)
        T = x.shape[0] * cp
        order = rank_order(T, cp, x.device) if order is None else order.to(x.device)
        ctx.order = order
        out = torch.empty((T, *x.shape[1:]), dtype=x.dtype, device=x.device)
        out[order] = _gather(x, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        in_rank_order = grad[ctx.order].contiguous()
        n = in_rank_order.shape[0] // dist.get_world_size(group)
        rank = dist.get_rank(group)
        if dist.get_backend(group) == "nccl":
            out = torch.empty((n, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, in_rank_order, group=group)
            return out, None, None
        dist.all_reduce(in_rank_order, group=group)  # gloo has no reduce-scatter
        return in_rank_order[rank * n:(rank + 1) * n], None, None


def gather_sequence(x: torch.Tensor, group, order: torch.Tensor | None = None) -> torch.Tensor:
    """Every CP rank's tokens of ``x`` ([2c, ...], sequence first) as the whole sequence.
    ``order``: the global position of each token of the ranks' tokens laid end to end in
    rank order (default: one sequence, `rank_order`; packed segments: each segment's)."""
    return _GatherSequence.apply(x, group, order)


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def cp_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the CP group of per-rank tensors that are 0 outside each rank's positions:
    the whole tensor on every rank. Backward: the identity (each rank's loss copy reaches its
    own positions only)."""
    return _SumOverRanks.apply(x, group)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float, enable_gqa: bool) -> torch.Tensor:
    """Attention of local queries ``q`` [b, heads, 2c, d] at global ``positions`` over the
    whole sequence's ``k``/``v`` [b, kv_heads, T, d], causal by global position: each of the
    two chunks attends the keys up to its own end."""
    import torch.nn.functional as F

    c = q.shape[2] // 2
    outs = []
    for part in range(2):
        chunk = q[:, :, part * c:(part + 1) * c]
        start = int(positions[part * c])
        end = start + c
        rows = torch.arange(start, end, device=q.device)[:, None]
        allowed = torch.arange(end, device=q.device)[None, :] <= rows
        outs.append(F.scaled_dot_product_attention(chunk, k[:, :, :end], v[:, :, :end],
                                                   attn_mask=allowed, scale=scale,
                                                   enable_gqa=enable_gqa))
    return torch.cat(outs, dim=2)
