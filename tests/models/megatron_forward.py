"""Forward passes through Megatron model chunks in tests: stage by stage, outputs gathered.

No pipeline schedule: each PP stage runs its chunk and hands the hidden states [s, b, h] (a
TP rank's [s/tp, b, h] under sequence parallelism) to the next stage with point-to-point
send/recv; the last stage gathers its TP shards. The sequence length must divide by tp
where the model runs sequence-parallel.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def forward_all_stages(ctx, chunks, tokens: torch.Tensor, gather_vocab: bool = True):
    """The model output (logits [b, s, Vp] or values [b, s]) on last-stage ranks, else None."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    (chunk,) = chunks
    batch, seq = tokens.shape
    position_ids = torch.arange(seq).expand_as(tokens)
    stage_ranks = dist.get_process_group_ranks(ctx.pp_group) if ctx.pp > 1 else [ctx.rank]
    with torch.no_grad():
        if not ctx.is_first_stage:
            # under sequence parallelism a TP rank holds its slice of the sequence
            local = seq // ctx.tp if chunk.config.sequence_parallel else seq
            hidden = torch.empty(local, batch, chunk.config.hidden_size,
                                 dtype=chunk.config.params_dtype)
            dist.recv(hidden, src=stage_ranks[ctx.pp_rank - 1])
            chunk.set_input_tensor(hidden)
        out = chunk(tokens, position_ids, None)
        if not ctx.is_last_stage:
            dist.send(out.contiguous(), dst=stage_ranks[ctx.pp_rank + 1])
            return None
    if gather_vocab:
        out = gather_from_tensor_model_parallel_region(out)
    return out
