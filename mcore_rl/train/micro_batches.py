"""Splitting a batch over data-parallel ranks and into micro-batches by a token budget.

Both functions return index lists into the original batch, so results computed per
micro-batch can be put back in batch order.
"""
from __future__ import annotations

import torch


def split_for_data_parallel(seq_lens: torch.Tensor, dp_size: int) -> list[list[int]]:
    """Assign sequences to DP ranks with balanced token counts (longest first to the
    least-loaded rank); each rank's indices stay in batch order. Deterministic, so every
    rank computes the same assignment without talking."""
    if dp_size == 1:
        return [list(range(len(seq_lens)))]
    if len(seq_lens) < dp_size:
        raise ValueError(f"a batch of {len(seq_lens)} sequences cannot feed {dp_size} "
                         "data-parallel ranks; use at least one sequence per rank")
    order = sorted(range(len(seq_lens)), key=lambda i: (-int(seq_lens[i]), i))
    loads, counts = [0] * dp_size, [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        # Least tokens first; among equals, fewest sequences (so no rank ends up empty).
        r = min(range(dp_size), key=lambda k: (loads[k], counts[k], k))
        shards[r].append(i)
        loads[r] += int(seq_lens[i])
        counts[r] += 1
    return [sorted(s) for s in shards]


def pack_micro_batches(seq_lens: torch.Tensor, indices: list[int], token_budget: int,
                       multiple_of: int = 1, min_count: int = 1) -> list[list[int]]:
    """Group ``indices`` into micro-batches whose padded size (sequences x longest) stays
    within ``token_budget``. Sequences are taken in length order so similar lengths share
    a micro-batch (little padding). The count is raised to ``min_count`` and to a multiple
    of ``multiple_of`` (pipeline schedules need that) by splitting the largest groups.

    A single sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(indices, key=lambda i: (int(seq_lens[i]), i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = int(seq_lens[i])
        if current and max(longest, n) * (len(current) + 1) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    target = max(len(groups), min_count)
    target = -(-target // multiple_of) * multiple_of
    if target > len(indices):
        raise ValueError(f"{len(indices)} sequences cannot fill {target} micro-batches "
                         f"(pipeline schedules need a multiple of {multiple_of}); "
                         "give each data-parallel rank more sequences")
    while len(groups) < target:
        groups.sort(key=lambda g: (-len(g), g[0]))
        big = groups.pop(0)
        half = len(big) // 2
        groups += [big[:half], big[half:]]
    return [sorted(g) for g in groups]
