"""Padding-free packing: a micro-batch as one sequence of its rows, end to end.

A micro-batch of right-padded rows [b, T] computes b x T positions, however short most of
its rows are; with the long-tailed response lengths of RL, much of that is padding.
`pack` lays the rows end to end in one row [1, S], S the sum of their lengths (rounded up
to what sequence parallelism needs), each row restarting its positions at 0:

    [a a a a | b b | c c c | _]          cu_seqlens  0 4 6 9 10

and hands Megatron the segment boundaries as its ``thd`` `PackedSeqParams` (``cu_seqlens``).
Attention never crosses a boundary and costs the sum of the rows' squared lengths, not the
square of S: Transformer Engine's attention takes ``cu_seqlens`` natively on a GPU, and the
local spec's `mcore_rl.models.sdpa_attention.SDPAttention` runs one causal attention per
segment. Megatron's rotary embedding restarts at every boundary.

With shared prompts (`mcore_rl.train.shared_prompts`) a segment may be a prompt and the
continuations of the rows that share it, under its own mask (``segment_masks``), and the
rotary embedding then takes every token's own position. The model's outputs over [1, S]
go back to the micro-batch's [b, T] through the same `unshare` as a shared layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from mcore_rl.data.batch import Batch
from mcore_rl.train.micro_batches import raise_group_count
from mcore_rl.train.shared_prompts import SharedLayout, _plan_rows, prompt_lengths


@dataclass
class SegmentParams(PackedSeqParams):
    """Megatron's ``thd`` parameters, and what the local attention needs besides."""

    segment_bounds: tuple[int, ...] = ()
    """``cu_seqlens`` as Python ints (no device sync per layer)."""
    segment_masks: tuple = ()
    """Per segment: None (causal), or a [1, 1, n, n] bool mask in Megatron's convention
    (True: may not attend) for a shared prompt's segment."""


@dataclass
class PackedLayout(SharedLayout):
    """A micro-batch of b rows [b, T] packed into one row [1, S]."""

    params: SegmentParams = field(default=None)
    exact_positions: bool = False
    """Some segment holds a shared prompt: the rotary embedding must give every token the
    angle of its own position (`mcore_rl.train.shared_prompts.token_positions`)."""
    padding: torch.Tensor | None = None
    """[1, S] bool: the tail that only rounds S up (an MoE router must not count it)."""

    def to(self, device: torch.device | str) -> "PackedLayout":
        p = self.params
        params = SegmentParams(
            qkv_format="thd", cu_seqlens_q=p.cu_seqlens_q.to(device),
            cu_seqlens_kv=p.cu_seqlens_kv.to(device), max_seqlen_q=p.max_seqlen_q,
            max_seqlen_kv=p.max_seqlen_kv, segment_bounds=p.segment_bounds,
            segment_masks=tuple(None if m is None else m.to(device) for m in p.segment_masks))
        return PackedLayout(self.input_ids.to(device), self.position_ids.to(device), None,
                            self.index.to(device), params=params,
                            exact_positions=self.exact_positions,
                            padding=self.padding.to(device))


def pack(mb: Batch, hidden_size: int, *, share: bool = False, multiple_of: int = 1,
         length: int | None = None, segment_multiple: int = 1) -> PackedLayout:
    """The packed layout of a right-padded micro-batch: its rows end to end (``share``: rows
    with the same prompt as one segment, where that pays, `shared_prompts._plan_rows`),
    then padding up to a multiple of ``multiple_of`` tokens, or to ``length`` (every
    micro-batch one shape), as a segment of its own. ``segment_multiple``: every segment
    padded at its end to a multiple of that many tokens (context parallelism splits each
    segment into 2 x cp chunks)."""
    ids, lens = mb["input_ids"].tolist(), mb.seq_lens.tolist()
    b, T = len(ids), (len(ids[0]) if ids else 0)
    rows = _plan_rows(ids, prompt_lengths(mb).tolist(), lens, hidden_size) if share and b else None
    if rows is None:
        rows = [(lens[i], [i]) for i in range(b)]
    tokens: list[int] = []
    positions: list[int] = []
    index = [[0] * T for _ in range(b)]
    bounds, masks = [0], []
    pads: list[tuple[int, int]] = []
    for p, members in rows:
        base = len(tokens)
        first = members[0]
        tokens += ids[first][:p]
        positions += range(p)
        for i in members:
            index[i][:p] = range(base, base + p)
        segment = [0] * p
        for k, i in enumerate(members, start=1):
            at, n = len(tokens), lens[i] - p
            tokens += ids[i][p:lens[i]]
            positions += range(p, lens[i])
            segment += [k] * n
            index[i][p:lens[i]] = range(at, at + n)
        short = -(len(tokens) - bounds[-1]) % segment_multiple
        if short:  # after the segment's tokens: causal attention keeps them from its outputs
            tokens += [0] * short
            positions += range(positions[-1] + 1, positions[-1] + 1 + short)
            pads.append((len(tokens) - short, len(tokens)))
        bounds.append(len(tokens))
        masks.append(None if len(members) == 1 else _segment_mask(segment))
    real = len(tokens)
    multiple_of = multiple_of * segment_multiple // math.gcd(multiple_of, segment_multiple)
    S = max(-(-real // multiple_of) * multiple_of, multiple_of)
    if length is not None:
        if length < S or length % multiple_of:
            raise ValueError(f"cannot pack {real} tokens into {length}")
        S = length
    if S > real:  # the padding tail: a segment of its own, attending only within itself
        tokens += [0] * (S - real)
        positions += range(S - real)
        bounds.append(S)
        masks.append(None)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(e - s for s, e in zip(bounds, bounds[1:]))
    params = SegmentParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest,
                           segment_bounds=tuple(bounds), segment_masks=tuple(masks))
    padding = torch.zeros((1, S), dtype=torch.bool)
    padding[0, real:] = True
    for start, end in pads:
        padding[0, start:end] = True
    dtype = mb["input_ids"].dtype if b else torch.long
    return PackedLayout(torch.tensor([tokens], dtype=dtype), torch.tensor([positions]), None,
                        torch.tensor(index, dtype=torch.long).reshape(b, T), params=params,
                        exact_positions=any(m is not None for m in masks), padding=padding)


def to_packed(values: torch.Tensor, layout: PackedLayout, real: torch.Tensor) -> torch.Tensor:
    """Per-token ``values`` [b, T, ...] of the micro-batch (``real`` [b, T]: its tokens) in
    the packed order [1, S, ...] (0 where no token of the micro-batch sits)."""
    out = values.new_zeros((1, layout.num_tokens, *values.shape[2:]))
    real = real.bool()
    out[0, layout.index.to(real.device)[real]] = values[real]
    return out


def from_packed(values: torch.Tensor, layout: PackedLayout, real: torch.Tensor) -> torch.Tensor:
    """Per-token ``values`` [1, S, ...] in the packed order as the micro-batch's [b, T, ...]
    (0 at padding)."""
    index = layout.index.to(values.device)
    out = values[0][index]
    keep = real.bool().reshape(*real.shape, *([1] * (out.dim() - 2))).to(values.device)
    return torch.where(keep, out, torch.zeros_like(out))


def _segment_mask(segment: list[int]) -> torch.Tensor:
    """A shared prompt's segment (0: the prompt; k: the k-th continuation): each
    continuation sees the prompt and itself, causally. [1, 1, n, n], True: masked."""
    seg = torch.tensor(segment)
    q, k = seg[:, None], seg[None, :]
    causal = torch.ones((len(segment), len(segment)), dtype=torch.bool).tril()
    allowed = causal & ((k == 0) | (k == q))
    return ~allowed[None, None]


def pack_by_tokens(seq_lens: torch.Tensor, indices: list[int], token_budget: int,
                   multiple_of: int = 1, units: list[list[int]] | None = None) -> list[list[int]]:
    """Group ``indices`` into micro-batches whose *real* tokens stay within ``token_budget``
    (what a packed micro-batch computes): units (default: each index alone) longest first,
    each into the first micro-batch it fits (first-fit decreasing). A unit larger than the
    budget gets a micro-batch of its own. The count is raised to a multiple of
    ``multiple_of`` (pipeline schedules) by splitting the largest groups between units."""
    mine = set(indices)
    units = ([[i] for i in indices] if units is None
             else [u for u in units if u[0] in mine])
    size = [sum(int(seq_lens[i]) for i in u) for u in units]
    order = sorted(range(len(units)), key=lambda k: (-size[k], units[k][0]))
    groups: list[list[list[int]]] = []
    loads: list[int] = []
    for k in order:
        for g, load in enumerate(loads):
            if load + size[k] <= token_budget:
                groups[g].append(units[k])
                loads[g] += size[k]
                break
        else:
            groups.append([units[k]])
            loads.append(size[k])
    groups = raise_group_count(groups, len(units), multiple_of)
    return sorted((sorted(i for u in g for i in u) for g in groups), key=lambda g: g[0])


def check_packing_supported(chunks: list) -> None:
    """Refuse, in one line, a model whose attention cannot take packed segments: it must be
    the local spec's `SDPAttention` or Transformer Engine's, with plain rotary or learned
    positions."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mcore_rl.models.sdpa_attention import SDPAttention
    from mcore_rl.train.fused_head import unwrap

    for chunk in chunks:
        model = unwrap(chunk)
        rotary = getattr(model, "rotary_pos_emb", None)
        if rotary is not None and type(rotary) is not RotaryEmbedding:
            raise ValueError(f"train.packing: the model's {type(rotary).__name__} positions do "
                             "not restart per packed row here; set train.packing: false")
        for m in model.modules():
            name = type(m).__name__
            if name.endswith("DotProductAttention") and not (
                    isinstance(m, SDPAttention) or name.startswith("TE")):
                raise ValueError(f"train.packing: {name} cannot attend within packed rows; "
                                 "use the local layer spec's SDPA attention or Transformer "
                                 "Engine, or set train.packing: false")


def cp_local_positions(layout: PackedLayout, cp: int, rank: int) -> torch.Tensor:
    """The packed positions CP rank ``rank`` runs: each segment's chunks ``rank`` and
    ``2 cp - 1 - rank`` (every segment a multiple of 2 x cp long). [S / cp] long."""
    from mcore_rl.parallel.context_parallel import chunk_positions

    bounds = layout.params.segment_bounds
    return torch.cat([start + chunk_positions(end - start, cp, rank)
                      for start, end in zip(bounds[:-1], bounds[1:])])
