"""Everything one fine-tuning run holds (`FinetuneRun`, built by `build_finetune_run`): the
trained model's engine, the frozen reference, tokenized data, logs and checkpoints."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_rl.config import RLConfig
from mcore_rl.data.batch import Batch
from mcore_rl.data.finetune_records import EXAMPLES, RecordReport
from mcore_rl.data.finetune_sources import finetune_rows
from mcore_rl.data.prompts import PromptStream
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.finetune.jobs import FINETUNE_JOBS, FinetuneJob
from mcore_rl.finetune.greedy_score import ScoreState, build_score_state
from mcore_rl.finetune.logps import completion_logps
from mcore_rl.finetune.reference_cache import ReferenceCache, cache_key
from mcore_rl.metrics_log import MetricsLog
from mcore_rl.parallel import ParallelContext
from mcore_rl.train.engine import TrainEngine
from mcore_rl.train.run_checkpoints import RunCheckpoints


def build_job(cfg: RLConfig) -> FinetuneJob:
    return FINETUNE_JOBS.get(cfg.train.job)(cfg)


def load_examples(cfg: RLConfig, tokenizer: Tokenizer, split: str) -> tuple[list, RecordReport | None]:
    """Tokenized records of a split, and the report of what was left out (the validation
    split may be empty; the training split may not)."""
    rows, where = finetune_rows(cfg, split)
    if split == "val" and not rows:
        return [], None
    return EXAMPLES[cfg.train.job](rows, cfg, tokenizer, where, max_length(cfg))


def max_length(cfg: RLConfig) -> int:
    """The longest prompt + completion a record may have (``finetune.max_length``, by default
    the model's positions)."""
    from mcore_rl.models.shape import model_shape

    return cfg.finetune.max_length or model_shape(cfg.model).max_position_embeddings


def trained_parts(cfg: RLConfig) -> list[str]:
    """Checkpoint parts: the trained model, and the reference when a warm start made it
    (otherwise the reference is the initial model and is rebuilt from it)."""
    job = FINETUNE_JOBS.get(cfg.train.job)
    return ["model"] + (["reference"] if job.needs_reference and cfg.train.warm_start_steps else [])


LINE_KEYS = ("loss", "reward/mean", "pairs", "rewards/accuracy", "rewards/margin", "kto/kl", "val/score",
             "val/loss", "val/preference_accuracy", "val/reward_accuracy", "val/rm_accuracy")
"""The metrics of a fine-tuning step the console's status line shows."""

@dataclass
class FinetuneRun:
    cfg: RLConfig
    ctx: ParallelContext
    job: FinetuneJob
    model_dir: Path
    tokenizer: Tokenizer
    model: TrainEngine
    """The trained model (policy, or reward model)."""
    reference: TrainEngine | None
    """The frozen reference policy (dpo, kto)."""
    examples: PromptStream
    """Training examples in seeded epochs (``position`` is saved with checkpoints)."""
    val_examples: list
    log: MetricsLog
    checkpoints: RunCheckpoints
    prompts: PromptStream | None = None
    """Prompts of an online job (``data``), in seeded epochs."""
    last_rollout_reward: float | None = None
    scorer: ScoreState | None = None
    """Greedy validation through the rollout engine (``finetune.val_score``)."""
    reference_cache: ReferenceCache | None = None
    """``finetune.reference_logps: cached``: the reference's log-probs by sequence."""
    step: int = 0
    losses: list[float] = field(default_factory=list)
    _val_batch: Batch | None = None
    _val_ref: torch.Tensor | None = None

    def engines(self) -> dict[str, TrainEngine]:
        parts = trained_parts(self.cfg)
        return {"model": self.model, **({"reference": self.reference} if "reference" in parts else {})}

    def val_batch(self) -> Batch:
        if self._val_batch is None:
            self._val_batch = self.job.batch(self.val_examples, self.tokenizer.pad_id)
        return self._val_batch

    def reference_logps(self, batch: Batch) -> torch.Tensor:
        """[B] summed completion log-probs under the frozen reference: from the cache
        (``cached``), or computed on the fly (the validation batch's once: the reference
        does not change)."""
        if self.reference_cache is not None:
            return self.reference_cache.lookup(batch, lambda b: completion_logps(self.reference, b))
        if batch is self._val_batch:
            if self._val_ref is None:
                self._val_ref = completion_logps(self.reference, batch)
            return self._val_ref
        return completion_logps(self.reference, batch)


def build_finetune_run(cfg: RLConfig, ctx: ParallelContext) -> FinetuneRun:
    from mcore_rl.models import build_model
    from mcore_rl.rl.setup import moe_options, prepare_model_dir
    from mcore_rl.train.build import build_engine

    job = build_job(cfg)
    model_dir = prepare_model_dir(cfg, ctx)
    tokenizer = load_tokenizer(model_dir)
    examples, report = load_examples(cfg, tokenizer, "train")
    val_examples, val_report = load_examples(cfg, tokenizer, "val")
    if ctx.is_controller:
        for r in (report, val_report):
            if r is not None:
                print(f"mcore-rl: data {r.line()}", flush=True)
    m = cfg.model
    moe = moe_options(cfg)
    sp = cfg.parallel.sequence_parallel
    built = build_model(model_dir, ctx, role=job.role, dtype=m.dtype, recompute=m.recompute,
                        seed=cfg.train.seed, moe=moe, sequence_parallel=sp)
    vocab = built.spec.arch.vocab_size
    share = cfg.train.share_prompts  # a DPO pair's two completions share their prompt
    packed = cfg.train.packing
    model = build_engine(built.chunks, ctx, kind=job.engine_kind, vocab_size=vocab,
                         optim=cfg.optimizer, total_steps=max(1, cfg.train.steps),
                         share_prompts=share, packing=packed)
    reference = None
    if job.needs_reference:
        ref = build_model(model_dir, ctx, role="reference", dtype=m.dtype, moe=moe, sequence_parallel=sp)
        reference = build_engine(ref.chunks, ctx, vocab_size=vocab, share_prompts=share,
                                 packing=packed)
    log = MetricsLog.for_config(cfg, enabled=ctx.is_controller, keys=LINE_KEYS)
    scorer = None
    if job.engine_kind == "lm":
        scorer = build_score_state(cfg, ctx, model_dir, tokenizer, model, built.spec.arch,
                                   always=job.online)
    prompts = None
    if job.online:
        from mcore_rl.data.prompts import load_prompt_records

        prompts = PromptStream(load_prompt_records(cfg.data, "train"), cfg.data.seed)
    return FinetuneRun(cfg=cfg, ctx=ctx, job=job, model_dir=model_dir, tokenizer=tokenizer,
                       model=model, reference=reference, scorer=scorer, prompts=prompts,
                       examples=PromptStream(examples, cfg.data.seed), val_examples=val_examples,
                       log=log, checkpoints=RunCheckpoints.for_config(cfg))


@torch.no_grad()
def copy_weights(source: TrainEngine, target: TrainEngine) -> None:
    """Copy the weights of one engine's chunks into another's of the same model and layout
    (the reference becomes the warm-started policy)."""
    def unwrap(chunk):
        while hasattr(chunk, "module"):  # DDP, Float16Module
            chunk = chunk.module
        return chunk

    for src, dst in zip(source.model, target.model):
        src_params = dict(unwrap(src).named_parameters())
        for name, p in unwrap(dst).named_parameters():
            p.copy_(src_params[name])


def open_reference_cache(run: FinetuneRun) -> None:
    """``finetune.reference_logps: cached``: read the cache of this model and data, or fill
    it in one pass over the training and validation examples and write it."""
    cfg = run.cfg
    if cfg.finetune.reference_logps != "cached" or run.reference is None:
        return
    examples = run.examples.records
    key = cache_key(cfg, run.model_dir, examples + run.val_examples, str(run.ctx.layout))
    run.reference_cache = ReferenceCache(Path(cfg.logging.dir) / "reference_cache" / f"{key}.pt")
    if run.reference_cache.values:
        if run.ctx.is_controller:
            print(f"mcore-rl: reference log-probs from {run.reference_cache.path}", flush=True)
        return
    size = cfg.finetune.batch_size
    for start in range(0, len(examples), size):
        run.reference_logps(run.job.batch(examples[start:start + size], run.tokenizer.pad_id))
    if run.val_examples:
        run.reference_logps(run.val_batch())
    run.reference_cache.save(run.ctx.is_controller)
    run.ctx.barrier()
    if run.ctx.is_controller:
        print(f"mcore-rl: reference log-probs of {run.reference_cache.computed} sequences cached in "
              f"{run.reference_cache.path}", flush=True)
