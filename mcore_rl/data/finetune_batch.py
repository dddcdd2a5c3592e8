"""Tokenized fine-tuning records -> `Batch` (completion tokens in ``response_mask``).

A DPO/RM pair is two rows, chosen then rejected, sharing one ``pack_unit`` id (1-based; 0
marks the all-padding filler rows the engine may add), so the data-parallel split and the
micro-batch packing keep them together and the loss finds both sides in one micro-batch.
"""
from __future__ import annotations

import torch

from mcore_rl.data.batch import Batch
from mcore_rl.data.finetune_records import Completion, Pair


def completion_batch(examples: list[Completion], pad_id: int) -> Batch:
    """Rows prompt + completion; ``desirable`` [B] (KTO labels, 1 for SFT)."""
    batch = Batch.from_sequences([e.prompt_ids + e.completion_ids for e in examples],
                                 prompt_lens=[len(e.prompt_ids) for e in examples], pad_id=pad_id)
    return batch.with_tensors(desirable=torch.tensor([int(e.desirable) for e in examples]))


def mismatched_batch(examples: list[Completion], pad_id: int) -> Batch:
    """KTO's mismatched pairs: prompt i with the completion of example i - 1 (cyclically),
    so the completions are those of the batch itself, each under another prompt."""
    n = len(examples)
    shifted = [Completion(examples[i].prompt_ids, examples[(i - 1) % n].completion_ids)
               for i in range(n)]
    return completion_batch(shifted, pad_id)


def pair_batch(pairs: list[Pair], pad_id: int) -> Batch:
    """Rows 2k (chosen) and 2k+1 (rejected) of pair k; ``pack_unit`` [B] = k + 1,
    ``chosen`` [B] 1/0, ``margin`` [B] (the pair's margin on both rows)."""
    seqs, prompt_lens = [], []
    for p in pairs:
        seqs += [p.prompt_ids + p.chosen_ids, p.prompt_ids + p.rejected_ids]
        prompt_lens += [len(p.prompt_ids)] * 2
    batch = Batch.from_sequences(seqs, prompt_lens=prompt_lens, pad_id=pad_id)
    unit = torch.arange(1, len(pairs) + 1).repeat_interleave(2)
    return batch.with_tensors(pack_unit=unit, chosen=torch.tensor([1, 0] * len(pairs)),
                              margin=torch.tensor([p.margin for p in pairs]).repeat_interleave(2))


def sides(per_row: torch.Tensor, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row values [b] of a micro-batch of pairs -> (chosen [p], rejected [p]), matched by
    pair, filler rows left out."""
    unit, chosen = mb["pack_unit"], mb["chosen"].bool()
    c_rows = torch.nonzero((unit > 0) & chosen).flatten()
    r_rows = torch.nonzero((unit > 0) & ~chosen).flatten()
    c_rows = c_rows[torch.argsort(unit[c_rows])]
    r_rows = r_rows[torch.argsort(unit[r_rows])]
    if not torch.equal(unit[c_rows], unit[r_rows]):
        raise RuntimeError("a micro-batch holds one side of a pair without the other")
    return per_row[c_rows], per_row[r_rows]
