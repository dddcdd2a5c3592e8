"""Assemble a `TrainEngine`: model chunks -> (DDP, optimizer, schedule) as needed."""
from __future__ import annotations

from mcore_rl.config import OptimizerConfig
from mcore_rl.parallel import ParallelContext
from mcore_rl.train.engine import TrainEngine
from mcore_rl.train.optimizer import build_optimizer, build_scheduler, wrap_ddp


def build_engine(chunks: list, ctx: ParallelContext, *, kind: str = "lm",
                 vocab_size: int | None = None, optim: OptimizerConfig | None = None,
                 lr: float | None = None, total_steps: int = 1, micro_batch_tokens: int | None = None,
                 logprob_impl: str = "auto", fused_lm_head: bool = True,
                 share_prompts: bool = False, packing: bool = False) -> TrainEngine:
    """A trainable engine when ``optim`` is given (Megatron DDP + Adam + LR schedule), else a
    forward-only one (reference model, reward model)."""
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config  # shared by all chunks of a model
    budget = micro_batch_tokens or (optim.micro_batch_tokens if optim else 4096)
    if optim is None:
        return TrainEngine(chunks, ctx, kind=kind, vocab_size=vocab_size,
                           micro_batch_tokens=budget, logprob_impl=logprob_impl,
                           fused_lm_head=fused_lm_head, share_prompts=share_prompts,
                           packing=packing)
    # Losses come back summed with their unit counts; Megatron divides the gradient once by
    # the global count (finalize_model_grads) instead of per micro-batch and per DP rank.
    # Must be set before DDP reads it.
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_model_grads
    model = wrap_ddp(chunks, optim.distributed)
    lr = optim.lr if lr is None else lr
    optimizer = build_optimizer(optim, model, lr=lr, bf16=config.bf16)
    config.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(optim, optimizer, lr=lr, total_steps=total_steps)
    return TrainEngine(model, ctx, kind=kind, vocab_size=vocab_size, micro_batch_tokens=budget,
                       optimizer=optimizer, scheduler=scheduler, logprob_impl=logprob_impl,
                       fused_lm_head=fused_lm_head, share_prompts=share_prompts,
                           packing=packing)
