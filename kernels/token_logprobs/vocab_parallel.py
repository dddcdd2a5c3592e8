"""Vocabulary sharding as Megatron lays it out, and merging per-shard softmax statistics.

With tensor parallelism the LM head is split along the vocabulary: rank ``r`` of a group of
``tp`` ranks holds the contiguous columns ``[r * V_local, (r + 1) * V_local)`` of the (padded)
vocabulary. Only columns below ``vocab_size`` are real; the padding may reach into the last
rank's slice, or cover it completely.

Each rank reduces its own columns to a few numbers per token (its log-sum-exp as max and
log-sum, its entropy, and the target logit when it owns the label) and two all-reduces turn
those into the global values.
The backward pass needs nothing else: every gradient column only depends on its own logit and
on the global log-sum-exp and entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """Which vocabulary columns the local logits hold.

    start: global id of local column 0; local_size: local columns (``logits.shape[-1]``);
    n_valid: local columns that are real tokens (``< vocab_size``); may be 0.
    """

    start: int
    local_size: int
    n_valid: int
    group: object | None
    world_size: int


def vocab_shard(local_size: int, vocab_size: int | None, tp_group=None) -> VocabShard:
    """Describe this rank's slice of a vocabulary of ``vocab_size`` real tokens."""
    world, rank = 1, 0
    if tp_group is not None:
        world = dist.get_world_size(tp_group)
        rank = dist.get_rank(tp_group)
    padded = local_size * world
    if vocab_size is None:
        vocab_size = padded
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} must be in [1, {padded}] "
            f"(local vocab {local_size} x tensor-parallel size {world})"
        )
    start = rank * local_size
    n_valid = max(0, min(local_size, vocab_size - start))
    return VocabShard(start, local_size, n_valid, tp_group if world > 1 else None, world)


def local_labels(labels: torch.Tensor, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as local column ids, clamped into range, and whether this rank owns each one."""
    local = labels - shard.start
    owned = (local >= 0) & (local < shard.n_valid)
    return local.clamp(0, max(shard.n_valid - 1, 0)), owned


def combine_stats(
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor | None,
    target: torch.Tensor,
    shard: VocabShard,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Merge per-shard statistics into the global ones; all [tokens] fp32.

    Per shard, over its real columns, with x the raw logits and z = x / T: row_max m_r = max x,
    log_sum l_r = log sum exp((x - m_r) / T), entropy H_r, and the target's raw logit (0 where
    the shard does not own the label). A shard with no real columns passes m = -inf, l = 0,
    H = 0, target 0. With M = max_r m_r, g_r = (m_r - M) / T, a_r = exp(g_r + l_r), S = sum a_r:
        global (max, log_sum) = (M, log S),  H = log S + sum_r a_r (H_r - g_r - l_r) / S,
        target = the owner's.
    Maxima stay in raw-logit units and the log-sum-exp stays split in (max, log_sum): then
    log p = (target - max) / T - log_sum and (x - max) / T are exact subtractions even where
    logits are huge (e.g. 1e4, where an fp32 sum or a rescaled max would lose three decimals).
    Every term is bounded, so extreme logits cannot overflow.
    """
    if shard.group is None:
        return row_max, log_sum, entropy, target
    big = row_max.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=shard.group)
    gap = (row_max - big) / temperature  # <= 0, -inf on an empty shard
    a = torch.exp(gap + log_sum)
    parts = [a, target]
    if entropy is not None:
        # a == 0 on an empty shard, where the bracket is +inf: contribute exactly 0
        parts.append(torch.where(a > 0, a * (entropy - gap - log_sum), torch.zeros_like(a)))
    stacked = torch.stack(parts)
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=shard.group)
    s = stacked[0]
    ent = torch.log(s) + stacked[2] / s if entropy is not None else None
    return big, torch.log(s), ent, stacked[1].clone()
