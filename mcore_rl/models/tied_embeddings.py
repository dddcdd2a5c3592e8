"""Tied embeddings under pipeline parallelism: the last stage's copy of the word embeddings.

With ``tie_word_embeddings`` and PP > 1, Megatron keeps the embedding on the first stage and
a copy as ``output_layer.weight`` on the last stage. Both are filled from the same tensor
when loading (HF: ``model.embed_tokens.weight``; Megatron checkpoint: the copy is stored as
a replica of ``embedding.word_embeddings.weight``), Megatron's ``finalize_model_grads``
all-reduces their gradients over the embedding group during training, so identical updates
keep them equal; exports write the first-stage tensor once. These helpers check or restore
that invariant (e.g. in tests of the train engine, or after editing weights in place).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _tied_weight(chunks: list, ctx) -> torch.Tensor | None:
    """This rank's member of the tied pair (embedding on the first stage, copy on the last)."""
    if ctx.pp == 1 or ctx.embedding_group is None:
        return None
    first, last = chunks[0], chunks[-1]
    if not getattr(last, "share_embeddings_and_output_weights", False):
        return None
    if ctx.is_first_stage:
        return first.embedding.word_embeddings.weight
    if ctx.is_last_stage:
        return last.output_layer.weight
    return None


@torch.no_grad()
def tied_embedding_max_diff(chunks: list, ctx) -> float:
    """max |embedding - last-stage copy| over this rank's vocabulary shard (0.0 when in sync,
    untied or without PP). Collective over the embedding group (first and last stage)."""
    weight = _tied_weight(chunks, ctx)
    if weight is None:
        return 0.0
    signed = weight.detach().float().clone() * (1.0 if ctx.is_first_stage else -1.0)
    dist.all_reduce(signed, group=ctx.embedding_group)
    return signed.abs().max().item()


@torch.no_grad()
def sync_tied_embeddings(chunks: list, ctx) -> None:
    """Copy the first stage's embedding into the last stage's copy (collective as above)."""
    weight = _tied_weight(chunks, ctx)
    if weight is None:
        return
    src = dist.get_process_group_ranks(ctx.embedding_group)[0]
    dist.broadcast(weight.data, src=src, group=ctx.embedding_group)
