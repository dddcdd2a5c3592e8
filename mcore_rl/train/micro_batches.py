"""Splitting a batch over data-parallel ranks and into micro-batches by a token budget.

Both functions return index lists into the original batch, so results computed per
micro-batch can be put back in batch order.

Both work on *packing units*: groups of sequences that must land on the same rank and in
the same micro-batch (the chosen and rejected sides of a DPO pair, whose loss needs both).
Without units every sequence is a unit of its own.
"""
from __future__ import annotations

import torch


def units_of(unit_ids: torch.Tensor | None, n: int) -> list[list[int]]:
    """Rows grouped by their unit id (each unit in row order, units by their first row);
    ``None``: one unit per row."""
    if unit_ids is None:
        return [[i] for i in range(n)]
    groups: dict[int, list[int]] = {}
    for i, u in enumerate(unit_ids.tolist()):
        groups.setdefault(int(u), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def split_for_data_parallel(seq_lens: torch.Tensor, dp_size: int,
                            units: list[list[int]] | None = None) -> list[list[int]]:
    """Assign units (default: single sequences) to DP ranks with balanced token counts
    (largest first to the least-loaded rank); each rank's indices stay in batch order.
    Deterministic, so every rank computes the same assignment without talking."""
    units = units if units is not None else [[i] for i in range(len(seq_lens))]
    if dp_size == 1:
        return [sorted(i for u in units for i in u)]
    if len(units) < dp_size:
        what = "sequences" if all(len(u) == 1 for u in units) else "packing units (pairs)"
        raise ValueError(f"a batch of {len(units)} {what} cannot feed {dp_size} "
                         "data-parallel ranks; use at least one sequence per rank")
    size = [sum(int(seq_lens[i]) for i in u) for u in units]
    order = sorted(range(len(units)), key=lambda k: (-size[k], units[k][0]))
    loads, counts = [0] * dp_size, [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for k in order:
        # Least tokens first; among equals, fewest sequences (so no rank ends up empty).
        r = min(range(dp_size), key=lambda j: (loads[j], counts[j], j))
        shards[r].extend(units[k])
        loads[r] += size[k]
        counts[r] += len(units[k])
    return [sorted(s) for s in shards]


def pack_micro_batches(seq_lens: torch.Tensor, indices: list[int], token_budget: int,
                       multiple_of: int = 1, min_count: int = 1,
                       units: list[list[int]] | None = None) -> list[list[int]]:
    """Group ``indices`` into micro-batches whose padded size (sequences x longest) stays
    within ``token_budget``. Units (default: each index alone; else the units of ``units``
    that lie in ``indices``) are taken by their longest sequence so similar lengths share a
    micro-batch (little padding). The count is raised to ``min_count`` and to a multiple of
    ``multiple_of`` (pipeline schedules need that) by splitting the largest groups between
    units.

    A single unit larger than the budget gets a micro-batch of its own.
    """
    mine = set(indices)
    units = ([[i] for i in indices] if units is None
             else [u for u in units if u[0] in mine])
    longest_of = [max(int(seq_lens[i]) for i in u) for u in units]
    order = sorted(range(len(units)), key=lambda k: (longest_of[k], units[k][0]))
    groups: list[list[list[int]]] = []
    current: list[list[int]] = []
    rows = longest = 0
    for k in order:
        n, size = longest_of[k], len(units[k])
        if current and max(longest, n) * (rows + size) > token_budget:
            groups.append(current)
            current, rows, longest = [], 0, 0
        current.append(units[k])
        rows += size
        longest = max(longest, n)
    if current:
        groups.append(current)
    return [sorted(i for u in g for i in u)
            for g in raise_group_count(groups, len(units), multiple_of, min_count)]


def raise_group_count(groups: list[list[list[int]]], n_units: int, multiple_of: int,
                      min_count: int = 1) -> list[list[list[int]]]:
    """``groups`` (micro-batches of units) raised to at least ``min_count`` and to a multiple
    of ``multiple_of`` by splitting the largest groups between units; a `ValueError` naming
    the shortfall when there are too few units."""
    target = max(len(groups), min_count)
    target = -(-target // multiple_of) * multiple_of
    if target > n_units:
        single = all(len(u) == 1 for g in groups for u in g)
        what = "sequences" if single else "packing units (pairs)"
        raise ValueError(f"{n_units} {what} cannot fill {target} micro-batches "
                         f"(pipeline schedules need a multiple of {multiple_of}); "
                         "give each data-parallel rank more sequences")
    while len(groups) < target:
        groups.sort(key=lambda g: (-len(g), g[0][0]))
        big = groups.pop(0)
        half = len(big) // 2
        groups += [big[:half], big[half:]]
    return groups
