"""Log-probs of the distribution an engine samples from when ``top_k`` / ``top_p`` truncate it.

With z = logits / T, an engine that samples with top-k and top-p (vLLM, HF ``generate``)
keeps the set K of tokens

* top-k (``top_k >= 1``): every token whose z is at least the k-th largest (ties kept);
* then top-p (``top_p < 1``): over the top-k set renormalised, with tokens in descending
  order, every token whose *preceding* probability mass is below ``top_p`` (the most likely
  token always stays); tokens tied with the least likely kept one stay too (an engine's
  sort orders ties arbitrarily, and bf16 logits tie often),

and samples from p~ = softmax(z) restricted to K and renormalised. The log-prob of a kept
token is then ``z_y - log sum_K exp(z)``, larger than the untruncated one by -log m_K, with
m_K the kept mass. The gradient over the logits has the untruncated form with p~ in place of
p and 0 outside K (K is locally constant in the logits).

K is found from a few *candidates* per row, the largest local logits: a shard's candidates
suffice once the smallest of them is below the kept set's threshold, and below the k-th
largest value with top-k (then every token of the shard the sets count is among them), or
the shard has no more columns. Rows start with ``top_k`` candidates (``INITIAL_CANDIDATES``
without top-k); the rows whose candidates do not suffice on some shard ask again for eight
times as many, so a peaked distribution costs one ``topk`` pass and a flat row a few more of
its own. With tensor parallelism the candidates of every rank are all-gathered and each rank
finds the same K.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from mcore_rl.kernels.token_logprobs.vocab_parallel import VocabShard

INITIAL_CANDIDATES = 256
"""Candidates per row and shard in the first pass when only top-p truncates."""
GROWTH = 8


@dataclass(frozen=True)
class Truncation:
    """The sampling truncation whose distribution log-probs describe (the engine's)."""

    top_k: int = -1
    """Keep the ``top_k`` most likely tokens (ties kept); -1 (or 0): no top-k."""
    top_p: float = 1.0
    """Then keep the smallest prefix whose probability reaches ``top_p``; 1: no top-p."""

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or -1 (or 0) for none, got {self.top_k!r}")

    def active_for(self, vocab: int) -> bool:
        """Whether anything is cut from a vocabulary of ``vocab`` tokens."""
        return self.top_p < 1.0 or 0 < self.top_k < vocab


NONE = Truncation()


@dataclass
class KeptSet:
    """Per row [N] fp32: ``threshold``, the raw logit of the least likely kept token (a token
    is kept iff its raw logit is >= it); ``log_sum``: log sum over K of exp((x - max) / T),
    with ``max`` the row's global maximum; ``entropy`` of p~ (or None)."""

    threshold: torch.Tensor
    log_sum: torch.Tensor
    entropy: torch.Tensor | None


def first_candidates(trunc: Truncation, shard: VocabShard) -> int:
    """How many candidates per row `kept_set` asks this shard for first (a fused LM head
    takes them while it computes the logits anyway)."""
    return min((trunc.top_k if trunc.top_k > 0 else INITIAL_CANDIDATES) + 1, shard.n_valid)


def top_candidates(x: torch.Tensor, k: int, rows_per_chunk: int = 256) -> torch.Tensor:
    """The ``k`` largest values of each row of ``x`` [N, V] as fp32 [N, k], descending
    (``k`` <= V), a chunk of rows at a time."""
    out = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], rows_per_chunk):
        out[s:s + rows_per_chunk] = x[s:s + rows_per_chunk].topk(k, dim=1, sorted=True).values.float()
    return out


def _gather(c: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    if shard.group is None:
        return c
    parts = [torch.empty_like(c) for _ in range(shard.world_size)]
    dist.all_gather(parts, c.contiguous(), group=shard.group)
    return torch.cat(parts, dim=1).sort(dim=1, descending=True).values


def _all_rows(flags: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Per row: true on every rank of the group."""
    if shard.group is None:
        return flags
    t = flags.to(torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=shard.group)
    return t.bool()


def kept_set(candidates: Callable[[int, torch.Tensor | None], torch.Tensor], shard: VocabShard,
             trunc: Truncation, temperature: float, row_max: torch.Tensor, log_sum: torch.Tensor,
             need_entropy: bool) -> KeptSet:
    """The kept set of every row from its candidates.

    candidates(k, rows): this shard's ``k`` largest raw logits of the rows ``rows`` (an
        ascending LongTensor; None: all rows), fp32 [rows, k], descending (k <= the shard's real
        columns). Only the rows whose candidates did not suffice are asked again, so one flat
        row does not make every row's candidates grow;
    row_max, log_sum: the global statistics of the untruncated softmax (``combine_stats``).
    """
    n, dev = row_max.shape[0], row_max.device
    threshold = torch.empty(n, dtype=torch.float32, device=dev)
    lsk = torch.empty(n, dtype=torch.float32, device=dev)
    ent = torch.empty(n, dtype=torch.float32, device=dev) if need_entropy else None
    rows: torch.Tensor | None = None  # all of them
    want = trunc.top_k if trunc.top_k > 0 else INITIAL_CANDIDATES
    while n:
        idx = torch.arange(n, device=dev) if rows is None else rows
        m = len(idx)
        # one candidate more than wanted: it tells whether ties of the last one were cut off
        k_local = min(want + 1, shard.n_valid)
        local = candidates(k_local, rows) if k_local else torch.empty(m, 0, dtype=torch.float32, device=dev)
        if k_local < want + 1:  # an exhausted shard pads with -inf: every rank sends [m, want + 1]
            local = torch.cat([local, local.new_full((m, want + 1 - k_local), float("-inf"))], dim=1)
        c = _gather(local, shard)
        z = (c - row_max[idx, None]) / temperature  # <= 0; -inf on padding
        keep = torch.isfinite(z)
        # every candidate at or above `bound` must be in hand: the top-k set (with the ties of
        # its k-th value, which top-p's renormalisation counts) or else the kept set
        bound = None
        if 0 < trunc.top_k < c.shape[1]:
            bound = c[:, trunc.top_k - 1]
            keep &= c >= bound[:, None]
        if trunc.top_k > 0:
            norm = torch.logsumexp(z.masked_fill(~keep, float("-inf")), dim=1)
        else:
            norm = log_sum[idx]
        if trunc.top_p < 1.0:
            p = torch.exp(z - norm[:, None]).masked_fill(~keep, 0.0)
            before = torch.cumsum(p, dim=1) - p
            keep &= before < trunc.top_p
            keep[:, 0] = True
        thr = c.masked_fill(~keep, float("inf")).amin(dim=1)
        keep = c >= thr[:, None]  # ties of the least likely kept token stay too
        if bound is None:
            bound = thr
        if k_local == shard.n_valid:  # every column of this shard is a candidate
            enough = torch.ones(m, dtype=torch.bool, device=dev)
        else:
            enough = local[:, k_local - 1] < bound
        enough = _all_rows(enough, shard)
        done = idx[enough]
        zk = z[enough].masked_fill(~keep[enough], float("-inf"))
        row_lsk = torch.logsumexp(zk, dim=1)
        threshold[done], lsk[done] = thr[enough], row_lsk
        if ent is not None:
            logp = (zk - row_lsk[:, None]).masked_fill(~keep[enough], 0.0)
            ent[done] = -(logp.exp() * logp).masked_fill(~keep[enough], 0.0).sum(dim=1)
        if bool(enough.all()):
            break
        rows = idx[~enough]
        want *= GROWTH
    return KeptSet(threshold, lsk, ent)
