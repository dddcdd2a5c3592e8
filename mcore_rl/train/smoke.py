"""A distributed smoke run of the Megatron model: next-token training on a synthetic stream.

It exercises the whole distributed stack of a layout on real Megatron-Core machinery
(GPT model chunks, Megatron DDP, the Megatron optimizer, the 1F1B / interleaved pipeline
schedules, vocab-parallel cross-entropy) and shows the loss falling. Used by
``mcore-rl train`` until the RL loop is configured, and as a quick health check of a layout.
"""
from __future__ import annotations

import time
from functools import partial

import torch

from mcore_rl.config import RLConfig
from mcore_rl.models import ModelArch
from mcore_rl.parallel import ParallelContext


def arch_from_inline(cfg: RLConfig) -> ModelArch:
    m = cfg.model
    return ModelArch(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                     intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                     num_attention_heads=m.num_attention_heads, num_kv_heads=m.num_kv_heads,
                     max_position_embeddings=m.max_position_embeddings,
                     tie_word_embeddings=m.tie_word_embeddings)


def synthetic_batches(vocab: int, seq_len: int, micro_batch: int, seed: int):
    """Sequences counting up modulo a small period: learnable in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    period = min(vocab, 17)
    while True:
        start = torch.randint(0, period, (micro_batch, 1), generator=gen)
        tokens = (start + torch.arange(seq_len + 1)) % period
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _forward_step(data_iterator, model):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    tokens, labels = next(data_iterator)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, position_ids, attention_mask=None)  # [b, s, V/tp] on the last stage

    def loss_func(logits):
        losses = vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(),
                                              labels.transpose(0, 1).contiguous())
        loss = losses.mean()
        # clone: Megatron divides the returned loss by num_microbatches *in place*, and a
        # detached view would share that storage.
        return loss, {"lm loss": loss.detach().clone()}

    return logits, loss_func


def run_smoke(cfg: RLConfig, ctx: ParallelContext, steps: int = 10, log=print) -> list[float]:
    """Train on synthetic sequences for ``steps`` optimizer steps; returns the losses seen
    by the last pipeline stage (the same on every rank after a broadcast)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mcore_rl.models.gpt import build_gpt_chunks

    arch = arch_from_inline(cfg)
    chunks = build_gpt_chunks(arch, ctx, dtype=cfg.model.dtype)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=cfg.optimizer.distributed)
    model = [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=cfg.model.dtype == "bf16",
                        use_distributed_optimizer=cfg.optimizer.distributed,
                        clip_grad=cfg.optimizer.clip_grad),
        model, use_gloo_process_groups=False)
    # What Megatron's own training loop wires up: after the last backward, reduce gradients
    # over DP and the embedding group (tied embeddings); scale the loss for mixed precision.
    from megatron.core.distributed import finalize_model_grads

    chunks[0].config.finalize_model_grads_func = finalize_model_grads
    chunks[0].config.grad_scale_func = opt.scale_loss
    seq_len, micro_batch = 32, 4
    num_micro = 2 * ctx.pp  # enough for the pipeline's steady state; a multiple of pp (VPP)
    # Every stage and virtual chunk draws the same micro-batch sequence (labels are read on
    # the last stage, tokens on the first), so each gets its own identically seeded stream.
    iters = [synthetic_batches(arch.vocab_size, seq_len, micro_batch, cfg.train.seed + ctx.dp_rank)
             for _ in model]
    fwd_bwd = get_forward_backward_func()
    losses = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        for m in model:
            m.zero_grad_buffer()
        opt.zero_grad()
        out = fwd_bwd(forward_step_func=_forward_step, data_iterator=iters if len(model) > 1 else iters[0], model=model,
                      num_microbatches=num_micro, seq_length=seq_len, micro_batch_size=micro_batch,
                      forward_only=False)
        ok, grad_norm, _ = opt.step()
        loss = torch.tensor([sum(o["lm loss"].item() for o in out) / len(out) if out else 0.0])
        # The loss lives on the last stage: share it, then average over DP replicas.
        last = torch.distributed.get_process_group_ranks(ctx.pp_group)[-1]
        torch.distributed.broadcast(loss, src=last, group=ctx.pp_group)
        torch.distributed.all_reduce(loss, group=ctx.dp_group)
        losses.append(loss.item() / ctx.dp)
        if ctx.rank == 0:
            log(f"step {step:3d}/{steps}  loss {losses[-1]:.4f}  grad-norm {grad_norm or 0:.3f}  "
                f"{time.perf_counter() - t0:.2f}s")
    return losses
