"""`Batch`: the one batch type every phase of an RL step reads and returns.

Legend: B sequences, T tokens per (right-padded) sequence.

Tensors (each with leading dimension B):
- ``input_ids`` [B, T]: prompt then response, right-padded.
- ``attention_mask`` [B, T]: 1 on real tokens (prompt and response), 0 on padding.
- ``response_mask`` [B, T]: 1 on generated tokens that are trained on (stop token included).
- Per-token fields are aligned to the token they describe: ``logprobs[b, t]`` is
  log p(input_ids[b, t] | input_ids[b, :t]) (so column 0 is always 0); ``values[b, t]`` is
  the critic's output at the position that predicts token t; ``rewards[b, t]`` is 0 except
  on the last response token. Per-sequence tensors are [B] (``scores``, ``group_id``).

``meta`` holds per-sequence Python values (lists of length B: reward metadata, finish
reasons, weight versions); ``info`` batch-level values (step, weight version).

Right padding makes causal attention exact without a mask: a real token never attends to
a later (padding) position, so padding changes nothing at real positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch


def pad_tokens(v: torch.Tensor, T: int) -> torch.Tensor:
    """A per-token tensor [B, T0, ...] right-padded with zeros along its token dimension to
    [B, T, ...] (trailing dimensions, e.g. the experts of each layer, are left alone)."""
    if v.shape[1] >= T:
        return v
    return torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, T - v.shape[1]))


@dataclass
class Batch:
    """A dict of [B, ...] tensors plus per-sequence metadata and batch-level info."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, list] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.meta.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields disagree on the number of sequences: {sizes}")

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int] | None = None,
                       pad_id: int = 0, **meta: list) -> "Batch":
        """Right-pad token lists into a batch; tokens after ``prompt_lens[i]`` are the response."""
        T = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)
        attn = torch.zeros((len(sequences), T), dtype=torch.long)
        resp = torch.zeros((len(sequences), T), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
            attn[i, :len(s)] = 1
            start = prompt_lens[i] if prompt_lens is not None else 0
            resp[i, start:len(s)] = 1
        return cls({"input_ids": ids, "attention_mask": attn, "response_mask": resp}, dict(meta))

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    @property
    def seq_lens(self) -> torch.Tensor:
        """[B] number of real tokens per sequence."""
        return self.tensors["attention_mask"].sum(-1)

    @property
    def policy_logprobs(self) -> torch.Tensor:
        """[B, T] log-probs of the weights that generated the batch: the trainer's
        (``old_logprobs``, computed before an off-policy update) where present, else the
        engine's (``rollout_logprobs``; an on-policy update takes the trainer's from its own
        forward pass)."""
        if "old_logprobs" in self.tensors:
            return self.tensors["old_logprobs"]
        return self.tensors["rollout_logprobs"]

    @property
    def num_tokens(self) -> int:
        """Padded tokens per sequence (T)."""
        return self.tensors["input_ids"].shape[1]

    def select(self, index: Sequence[int] | torch.Tensor) -> "Batch":
        """The sequences at ``index``, in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        tensors = {k: v.index_select(0, idx) for k, v in self.tensors.items()}
        meta = {k: [v[i] for i in idx.tolist()] for k, v in self.meta.items()}
        return Batch(tensors, meta, dict(self.info))

    def trimmed(self) -> "Batch":
        """Drop trailing columns that are padding in every sequence."""
        T = int(self.seq_lens.max().item()) if len(self) else 0
        if T == self.num_tokens:
            return self
        tensors = {k: (v[:, :T] if v.dim() >= 2 and v.shape[1] == self.num_tokens else v)
                   for k, v in self.tensors.items()}
        return Batch(tensors, self.meta, dict(self.info))

    def padded_to(self, rows: int, T: int) -> "Batch":
        """Append all-padding sequences (every mask 0) and columns up to [rows, T]."""
        extra = rows - len(self)
        tensors = {}
        for k, v in self.tensors.items():
            if v.dim() >= 2 and v.shape[1] == self.num_tokens:
                v = pad_tokens(v, T)
            tensors[k] = torch.cat([v, v.new_zeros((extra, *v.shape[1:]))]) if extra else v
        meta = {k: list(v) + [None] * extra for k, v in self.meta.items()}
        return Batch(tensors, meta, dict(self.info))

    def to(self, device: torch.device | str) -> "Batch":
        """The batch with its tensors on ``device`` (itself when they are all there already)."""
        device = torch.device(device)
        if all(v.device == device for v in self.tensors.values()):
            return self
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.meta, dict(self.info))

    def with_tensors(self, **tensors: torch.Tensor) -> "Batch":
        """A batch with fields added or replaced (the original is unchanged)."""
        return Batch({**self.tensors, **tensors}, self.meta, dict(self.info))

    @staticmethod
    def cat(batches: Iterable["Batch"]) -> "Batch":
        """Concatenate along sequences; per-token tensors are right-padded to the longest T."""
        batches = list(batches)
        keys = batches[0].tensors.keys()
        tensors = {}
        for k in keys:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() >= 2:
                T = max(p.shape[1] for p in parts)
                parts = [pad_tokens(p, T) for p in parts]
            if parts[0].dim() >= 3:  # e.g. kept ids per token: sets of different widths
                width = max(p.shape[2] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 3) + (0, width - p.shape[2]))
                         for p in parts]
            tensors[k] = torch.cat(parts)
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        return Batch(tensors, meta, dict(batches[0].info))
