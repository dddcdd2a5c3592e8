"""Reference log-probs computed once per dataset and kept on disk
(``finetune.reference_logps: cached``).

The frozen reference gives every sequence the same summed completion log-prob, so a run
computes them in one pass over the training and validation data before its first step and
then looks them up. Entries are keyed by the sequence (its tokens and where its completion
starts); the file is keyed by the model and the data (`cache_key`), so a resumed run, or
another run on the same model and data, reads it instead of computing again. Sequences
not in the cache (KTO's mismatched pairs, which depend on the batch) are computed on the
fly and added.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from mcore_rl.data.batch import Batch


def row_keys(batch: Batch) -> list[bytes]:
    """One key per sequence: its real tokens and the start of its completion."""
    keys = []
    for ids, real, resp in zip(batch["input_ids"], batch["attention_mask"], batch["response_mask"]):
        tokens = ids[real.bool()].to(torch.int64).numpy().tobytes()
        start = int(resp.argmax()) if resp.any() else -1
        keys.append(hashlib.blake2b(tokens + start.to_bytes(8, "little", signed=True),
                                    digest_size=16).digest())
    return keys


def cache_key(cfg, model_dir: Path, examples: list, layout: str) -> str:
    """Digest of what the reference's log-probs depend on: the model files, the warm start
    that made the reference (its settings and the layout it ran at), dtype, and the data."""
    t, m = cfg.train, cfg.model
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime))
                   for p in Path(model_dir).iterdir() if p.is_file())
    warm = [t.warm_start_steps, t.warm_start_lr, t.warm_start_batch, t.seed, layout,
            cfg.data.source, cfg.data.seed] if t.warm_start_steps else None
    h = hashlib.sha256(json.dumps([str(model_dir), files, warm, m.dtype, cfg.train.job]).encode())
    for e in examples:
        h.update(repr(sorted(vars(e).items())).encode())
    return h.hexdigest()[:24]


class ReferenceCache:
    """Sequence key -> summed reference log-prob, identical on every rank."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.values: dict[bytes, float] = {}
        self.computed = 0
        """Sequences computed by the reference so far (not found in the cache)."""
        if self.path.is_file():
            self.values = torch.load(self.path, weights_only=True)

    def lookup(self, batch: Batch, compute: Callable[[Batch], torch.Tensor]) -> torch.Tensor:
        """[B] log-probs of ``batch``; the missing ones from ``compute`` (collective: every
        rank holds the same cache, so every rank computes the same rows)."""
        keys = row_keys(batch)
        missing = [i for i, k in enumerate(keys) if k not in self.values]
        if missing:
            for i, v in zip(missing, compute(batch.select(missing)).tolist()):
                self.values[keys[i]] = v
            self.computed += len(missing)
        return torch.tensor([self.values[k] for k in keys], dtype=torch.float32)

    def save(self, is_writer: bool) -> None:
        """Written by one rank to a temporary file, then renamed into place."""
        if not is_writer:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(self.values, tmp)
        os.replace(tmp, self.path)
