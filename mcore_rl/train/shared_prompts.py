"""One forward over a prompt for all the samples drawn from it.

GRPO and RLOO train on n samples of every prompt, and PPO often does too: a micro-batch
holds each prompt n times, and the model computes the same hidden states over it n times
(under causal attention a prompt token never sees what follows it). `share_prompts` lays a
micro-batch out so that rows with the same prompt become one row, the prompt once and then
each row's continuation:

    [p p p p | a a | b b b | c]        positions  0 1 2 3 | 4 5 | 4 5 6 | 4
                                       a attends to the prompt and to a only, and so on

with the positions each token had in its own row (RoPE) and an attention mask that lets a
continuation see the prompt and itself, causally. `unshare` maps the model's outputs back to
the micro-batch's [b, T] layout, so log-probs, values and losses are computed as before;
through it the prompt's gradient gathers the contributions of all the rows that share it.
The result is the unshared model's up to round-off; the compute is the prompt once and n
continuations instead of n whole rows. The quick start's batch (16 prompts of 5 tokens, 8
samples each, of 4 tokens in the benchmark) goes from 1,152 tokens to 592.

How long a shared row may get: with an explicit mask the attention costs the row's length
squared (every pair: a masked kernel skips none), not half the sum of its rows' squares. A
row takes one more continuation while that lowers the estimated cost (tokens through the
layers plus attention pairs, weighed by the hidden size), and stays within
`MAX_ROW_TOKENS`; a micro-batch whose layout would cost more than its whole rows keeps them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mcore_rl.data.batch import Batch
from mcore_rl.train.fused_head import unwrap

MAX_ROW_TOKENS = 4096
"""Longest shared row (its attention mask and scores grow with the square of it)."""


@dataclass
class SharedLayout:
    """A micro-batch of b rows [b, T] laid out as R shared rows [R, S]."""

    input_ids: torch.Tensor
    """[R, S] tokens: a prompt, then the continuations of the rows that share it; 0-padded."""
    position_ids: torch.Tensor
    """[R, S] each token's position in its own row (padding: 0)."""
    attention_mask: torch.Tensor
    """[R, 1, S, S] bool, Megatron's convention: True where a query may *not* attend a key.
    A padding position attends to itself only (no row of the softmax is empty)."""
    index: torch.Tensor
    """[b, T] long: where each token of the micro-batch sits in the flattened [R * S] layout
    (a padding token: position 0 of its shared row; its output is never read)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> "SharedLayout":
        return SharedLayout(*(t.to(device) for t in (self.input_ids, self.position_ids,
                                                     self.attention_mask, self.index)))


def prompt_lengths(mb: Batch) -> torch.Tensor:
    """[b] tokens before each row's first response token (the whole row without one)."""
    resp = mb["response_mask"].bool() & mb["attention_mask"].bool()
    lens = mb.seq_lens
    first = torch.where(resp.any(-1), resp.long().argmax(-1), lens)
    return first


def _row_cost(length: int, hidden_size: int, masked: bool = True) -> float:
    """Estimated cost of a row of ``length`` tokens, in attention pairs: each token's matrix
    products (~24 H^2 FLOPs, forward and backward) weigh as much as 6 H pairs (~4 H each).
    Under an explicit mask the kernel computes every pair; causal, it skips the half above
    the diagonal."""
    return length * 6.0 * hidden_size + length * length / (1 if masked else 2)


def _groups(ids: list[list[int]], prompt_lens: list[int]) -> list[list[int]]:
    """Rows with the same (non-empty) prompt, in order of first appearance."""
    by_prompt: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompt_lens):
        key = tuple(ids[i][:p]) if p > 0 else ("row", i)
        by_prompt.setdefault(key, []).append(i)
    return list(by_prompt.values())


def plan_rows(mb: Batch, hidden_size: int) -> list[tuple[int, list[int]]] | None:
    """The shared rows of a micro-batch, as (prompt length, member rows); None when no row
    would hold two continuations (nothing to share)."""
    return _plan_rows(mb["input_ids"].tolist(), prompt_lengths(mb).tolist(), mb.seq_lens.tolist(),
                      hidden_size)


def _plan_rows(ids: list[list[int]], prompt_lens: list[int], lens: list[int],
               hidden_size: int) -> list[tuple[int, list[int]]] | None:
    rows: list[tuple[int, list[int]]] = []
    for group in _groups(ids, prompt_lens):
        p = prompt_lens[group[0]]
        members: list[int] = []
        length = p
        for i in group:
            extra = lens[i] - p
            if members:
                grown = length + extra
                apart = _row_cost(length, hidden_size) + _row_cost(lens[i], hidden_size)
                if grown > MAX_ROW_TOKENS or _row_cost(grown, hidden_size) >= apart:
                    rows.append((p, members))
                    members, length = [], p
            members.append(i)
            length += extra
        rows.append((p, members))
    if all(len(m) == 1 for _, m in rows):
        return None
    return rows


def share_prompts(mb: Batch, hidden_size: int, multiple_of: int = 1) -> SharedLayout | None:
    """The shared layout of a right-padded micro-batch (None: no two rows share a prompt, or
    sharing would not pay). ``multiple_of``: the shared rows' length is padded to a multiple
    of it (sequence parallelism splits it over the TP ranks)."""
    ids, lens = mb["input_ids"].tolist(), mb.seq_lens.tolist()
    rows = _plan_rows(ids, prompt_lengths(mb).tolist(), lens, hidden_size)
    if rows is None:
        return None
    b, T = len(ids), len(ids[0])
    lengths = [p + sum(lens[i] - p for i in members) for p, members in rows]
    S = -(-max(lengths) // multiple_of) * multiple_of
    R = len(rows)
    whole = -(-T // multiple_of) * multiple_of
    if R * _row_cost(S, hidden_size) >= b * _row_cost(whole, hidden_size, masked=False):
        return None  # padded to its longest shared row, the layout would cost more
    tokens, positions, segments = [], [], []  # per shared row
    index = [[0] * T for _ in range(b)]  # padding: the shared row's first position (never read)
    for r, (p, members) in enumerate(rows):
        base = r * S
        row_tokens, row_pos, row_seg = ids[members[0]][:p], list(range(p)), [0] * p
        for i in members:
            index[i][:p] = range(base, base + p)
        for k, i in enumerate(members, start=1):
            at, n = len(row_tokens), lens[i] - p
            row_tokens += ids[i][p:lens[i]]
            row_pos += range(p, lens[i])
            row_seg += [k] * n
            index[i][p:lens[i]] = range(base + at, base + at + n)
            index[i][lens[i]:] = [base] * (T - lens[i])
        pad = S - len(row_tokens)
        tokens.append(row_tokens + [0] * pad)
        positions.append(row_pos + [0] * pad)
        segments.append(row_seg + [-1] * pad)
    segment = torch.tensor(segments)
    padding = segment < 0
    q, k = segment[:, :, None], segment[:, None, :]
    causal = torch.ones((S, S), dtype=torch.bool).tril()
    allowed = causal & ((k == 0) & (q >= 0) | (k == q) & (q > 0))
    allowed |= torch.eye(S, dtype=torch.bool) & padding[:, :, None]
    return SharedLayout(torch.tensor(tokens, dtype=mb["input_ids"].dtype), torch.tensor(positions),
                        ~allowed[:, None], torch.tensor(index))


def unshare(output: torch.Tensor, layout: SharedLayout) -> torch.Tensor:
    """The model's batch-first output over the shared rows, [R, S, ...], as the micro-batch's
    [b, T, ...] (differentiable: the prompt's positions gather the gradient of every row that
    reads them)."""
    R, S = output.shape[:2]
    flat = output.reshape(R * S, *output.shape[2:])
    b, T = layout.index.shape
    picked = flat.index_select(0, layout.index.reshape(-1).to(output.device))
    return picked.reshape(b, T, *output.shape[2:])


def supports_shared_prompts(chunks: list, ctx) -> bool:
    """Whether a model can run shared layouts: a dense GPT (a mixture of experts would route
    and balance the prompt's tokens once instead of n times) whose attention is the local
    spec's `SDPAttention` (it takes the explicit mask; Transformer Engine's is built for a
    causal one) and whose positions are plain rotary or learned ones; not the interleaved
    schedule over gloo, which needs one shape for every micro-batch."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mcore_rl.models.sdpa_attention import SDPAttention
    from mcore_rl.parallel import megatron_cpu_compat

    if ctx.vpp and megatron_cpu_compat.is_applied():
        return False
    for chunk in chunks:
        model = unwrap(chunk)
        config = model.config
        if getattr(config, "num_moe_experts", None) or getattr(config, "context_parallel_size", 1) > 1:
            return False
        rotary = getattr(model, "rotary_pos_emb", None)
        if rotary is not None and type(rotary) is not RotaryEmbedding:
            return False
        attentions = [m for m in model.modules() if type(m).__name__.endswith("DotProductAttention")
                      or isinstance(m, SDPAttention)]
        if not attentions or not all(isinstance(m, SDPAttention) for m in attentions):
            return False
    return True


@contextmanager
def token_positions(chunk, position_ids: torch.Tensor):
    """While a chunk runs a shared layout, its rotary embedding gives each token the angle of
    its own position (``position_ids`` [R, S]) instead of its index in the shared row."""
    rotary = getattr(unwrap(chunk), "rotary_pos_emb", None)
    if rotary is None:
        yield
        return
    own = rotary.__dict__.get("forward")
    table = rotary.forward

    def per_token(*args, **kwargs):
        # [positions, 1, 1, d] -> [S, R, 1, d]: broadcast over the heads like [S, 1, 1, d]
        return table(int(position_ids.max()) + 1)[position_ids.t()].squeeze(2)

    rotary.forward = per_token
    try:
        yield
    finally:
        if own is None:
            del rotary.forward  # the class's again
        else:
            rotary.forward = own
