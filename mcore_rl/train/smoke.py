"""A distributed smoke run of the Megatron model: next-token training on a synthetic stream.

It exercises the whole distributed stack of a layout on real Megatron-Core machinery (GPT
model chunks, Megatron DDP and optimizer, the 1F1B / interleaved pipeline schedules,
vocab-parallel log-probs) through the `TrainEngine`, and shows the loss falling. A quick
health check of a layout: ``mcore-rl train CONFIG`` runs it when the config has no RL data.

It is also the first loop with the run-level services the RL loop uses the same way:
checkpoints every ``checkpoint.save_every`` steps (with ``save_every: 0`` the smoke run saves
only when asked to stop, so re-running the quick start starts afresh), resuming from the
latest complete checkpoint (``checkpoint.resume``), a stop check at every step boundary
(`mcore_rl.launch.stop_signal`), and one JSON line per step in ``<logging.dir>/metrics.jsonl``.
Batches are drawn from a generator seeded by (seed, step), so a resumed run sees the same
data as an uninterrupted one.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from mcore_rl.config import RLConfig
from mcore_rl.data.batch import Batch
from mcore_rl.models import ModelArch
from mcore_rl.parallel import ParallelContext


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


class StepCheckpoints:
    """``<root>/step_<k>`` directories and a ``latest`` pointer file naming the newest one.

    The pointer moves (write-then-rename) only after a checkpoint is complete, so a run
    killed mid-save resumes from the previous one. Keeps the ``keep_last`` newest.
    """

    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    @classmethod
    def for_config(cls, cfg: RLConfig) -> "StepCheckpoints":
        root = cfg.checkpoint.dir or os.path.join(cfg.logging.dir, "checkpoints")
        return cls(root, cfg.checkpoint.keep_last)

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "metadata.json").exists() else None

    def resume_path(self, resume: str) -> Path | None:
        """What ``checkpoint.resume`` (auto | never | a path) asks to load, if anything."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        if not (Path(resume) / "metadata.json").exists():
            raise FileNotFoundError(f"checkpoint.resume={resume} is not a complete checkpoint")
        return Path(resume)

    def save(self, engine, step: int, extra: dict) -> Path:
        """Save (collective over all ranks), then move the pointer and prune (rank 0)."""
        from mcore_rl.train.checkpoint import save_engine

        path = save_engine(engine, self.root / f"step_{step:06d}", extra=extra)
        if engine.ctx.rank == 0:
            tmp = self.root / "latest.tmp"
            tmp.write_text(path.name + "\n")
            os.replace(tmp, self.root / "latest")
            done = sorted(p for p in self.root.glob("step_*") if not p.name.endswith(".tmp"))
            for old in done[:-self.keep_last] if self.keep_last > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        return path


class MetricsLog:
    """``metrics.jsonl``: one line per step, appended as it happens (rank 0 writes)."""

    def __init__(self, path: str | Path, enabled: bool, keep_through_step: int):
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_through_step > 0 and self.path.exists():  # a resumed run: drop steps it redoes
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= keep_through_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def append(self, **record) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def run_smoke(cfg: RLConfig, ctx: ParallelContext, steps: int = 10, log=print,
              stop=None) -> list[float]:
    """Train on synthetic sequences up to step ``steps``; returns the global token-mean loss
    of every step 1..steps (the same on every rank), including steps run before a resume.

    ``stop``: a `mcore_rl.launch.stop_signal.StopSignal`; when all ranks agree to stop, the
    state is saved and `StopRequested` is raised.
    """
    from dataclasses import replace

    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.train.build import build_engine
    from mcore_rl.train.checkpoint import load_engine

    arch = arch_from_inline(cfg)
    optim = replace(cfg.optimizer, lr=1e-3)  # a visible drop within a few steps
    engine = build_engine(build_gpt_chunks(arch, ctx, dtype=cfg.model.dtype), ctx,
                          vocab_size=arch.vocab_size, optim=optim, total_steps=steps)
    ckpts = StepCheckpoints.for_config(cfg)
    losses: list[float] = []
    resume = ckpts.resume_path(cfg.checkpoint.resume)
    if resume is not None:
        extra = load_engine(engine, resume)
        losses = list(extra["losses"])
        if ctx.rank == 0:
            log(f"mcore-rl: resumed from {resume} after step {extra['step']}", flush=True)
    done = len(losses)
    metrics = MetricsLog(Path(cfg.logging.dir) / "metrics.jsonl", ctx.rank == 0, done)
    every = cfg.checkpoint.save_every
    for step in range(done + 1, steps + 1):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
        result = engine.train_batch(synthetic_batch(arch.vocab_size, 32, 8 * ctx.dp, gen),
                                    next_token_loss)
        losses.append(result.loss)
        seconds = time.perf_counter() - t0
        metrics.append(step=step, loss=result.loss, grad_norm=result.grad_norm, seconds=seconds)
        if ctx.rank == 0:
            log(f"step {step:3d}/{steps}  loss {result.loss:.4f}  "
                f"grad-norm {result.grad_norm:.3f}  {seconds:.2f}s", flush=True)
        saved = None
        if every and (step % every == 0 or step == steps):
            saved = ckpts.save(engine, step, {"step": step, "losses": losses})
        if stop is not None and step < steps and stop.should_stop(ctx):
            from mcore_rl.launch.stop_signal import StopRequested

            saved = saved or ckpts.save(engine, step, {"step": step, "losses": losses})
            raise StopRequested(step, saved)
    return losses
