"""A distributed smoke run of the Megatron model: next-token training on a synthetic stream.

It exercises the whole distributed stack of a layout on real Megatron-Core machinery (GPT
model chunks, Megatron DDP and optimizer, the 1F1B / interleaved pipeline schedules,
vocab-parallel log-probs) through the `TrainEngine`, and shows the loss falling. A quick
health check of a layout: ``mcore-rl train CONFIG`` runs it when the config has no RL data.

It runs with the run-level services the RL loop uses the same way:
checkpoints every ``checkpoint.save_every`` steps (with ``save_every: 0`` the smoke run saves
only when asked to stop, so re-running the quick start starts afresh), resuming from the
latest complete checkpoint (``checkpoint.resume``), a stop check at every step boundary
(a `StopSignal` of the launcher), and one JSON line per step in ``<logging.dir>/metrics.jsonl``.
Batches are drawn from a generator seeded by (seed, step), so a resumed run sees the same
data as an uninterrupted one.
"""
from __future__ import annotations

import time

import torch

from mcore_rl.config import RLConfig
from mcore_rl.data.batch import Batch
from mcore_rl.metrics_log import MetricsLog
from mcore_rl.models import ModelArch
from mcore_rl.parallel import ParallelContext
from mcore_rl.train.run_checkpoints import RunCheckpoints


def arch_from_inline(cfg: RLConfig) -> ModelArch:
    m = cfg.model
    return ModelArch(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                     intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                     num_attention_heads=m.num_attention_heads, num_kv_heads=m.num_kv_heads,
                     max_position_embeddings=m.max_position_embeddings,
                     tie_word_embeddings=m.tie_word_embeddings)


def synthetic_batch(vocab: int, seq_len: int, n: int, gen: torch.Generator) -> Batch:
    """Sequences counting up modulo a small period: learnable in a few steps."""
    period = min(vocab, 17)
    start = torch.randint(0, period, (n, 1), generator=gen)
    tokens = (start + torch.arange(seq_len)) % period
    return Batch.from_sequences(tokens.tolist(), prompt_lens=[1] * n)


def next_token_loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


class SmokeRun:
    """Next-token training on synthetic sequences up to step ``train.steps``, one `step` at a
    time. ``losses``: the global token-mean loss of every step so far (the same on every
    rank), including steps run before a resume."""

    def __init__(self, cfg: RLConfig, ctx: ParallelContext, log=print):
        from dataclasses import replace

        from mcore_rl.models.gpt import build_gpt_chunks
        from mcore_rl.train.build import build_engine

        self.cfg, self.ctx, self.print = cfg, ctx, log
        self.steps = cfg.train.steps
        self.arch = arch_from_inline(cfg)
        optim = replace(cfg.optimizer, lr=1e-3)  # a visible drop within a few steps
        chunks = build_gpt_chunks(self.arch, ctx, dtype=cfg.model.dtype, recompute=cfg.model.recompute,
                                  sequence_parallel=cfg.parallel.sequence_parallel)
        self.engine = build_engine(chunks, ctx, vocab_size=self.arch.vocab_size, optim=optim,
                                   total_steps=self.steps, packing=cfg.train.packing)
        self.checkpoints = RunCheckpoints.for_config(cfg)
        self.losses: list[float] = []
        resume = self.checkpoints.resolve_resume(cfg.checkpoint.resume, ["model"],
                                                 cfg.logging.dir).path
        if resume is not None:
            self.losses = list(self.checkpoints.load(resume, {"model": self.engine})["losses"])
            if ctx.rank == 0:
                log(f"mcore-rl: resumed from {resume} after step {len(self.losses)}", flush=True)
        self.metrics = MetricsLog.for_config(cfg, enabled=ctx.rank == 0, live=False)  # it prints its own lines
        self.metrics.truncate_after(len(self.losses) if resume is not None else -1)

    @property
    def step_count(self) -> int:
        return len(self.losses)

    def step(self, stop=None) -> float:
        """One training step, its log line and (when due) checkpoint; ``stop``: as for the
        RL loop (an agreed stop saves a checkpoint and raises `StopRequested`)."""
        cfg, ctx = self.cfg, self.ctx
        step = len(self.losses) + 1
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
        result = self.engine.train_batch(synthetic_batch(self.arch.vocab_size, 32, 8 * ctx.dp, gen),
                                         next_token_loss)
        self.losses.append(result.loss)
        seconds = time.perf_counter() - t0
        self.metrics.log(step, {"loss": result.loss, "grad_norm": result.grad_norm,
                                "seconds": seconds}, console=False)
        if ctx.rank == 0:
            self.print(f"step {step:3d}/{self.steps}  loss {result.loss:.4f}  "
                       f"grad-norm {result.grad_norm:.3f}  {seconds:.2f}s", flush=True)
        saved = None
        every = cfg.checkpoint.save_every
        if every and (step % every == 0 or step == self.steps):
            saved = self.save()
        if stop is not None and step < self.steps and stop.should_stop(ctx):
            from mcore_rl.errors import StopRequested

            path = saved or self.save()
            self.metrics.close("stopped")
            raise StopRequested(step, path)
        return result.loss

    def save(self):
        return self.checkpoints.save(len(self.losses), {"model": self.engine}, {"losses": self.losses})
