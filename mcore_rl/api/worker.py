"""What each rank of an `RLTrainer` holds: one RL run (`RunState`), driven call by call."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from mcore_rl.config import RLConfig
from mcore_rl.data.batch import Batch
from mcore_rl.data.prompts import PromptRecord
from mcore_rl.errors import UsageError
from mcore_rl.rl import phases
from mcore_rl.rl.setup import build_run, initial_model_removed_on_failure
from mcore_rl.rl.step_metrics import validation_score
from mcore_rl.train.run_checkpoints import RunCheckpoints
from mcore_rl.trainer import PhaseTimer, finish, learn, resume_or_warm_start, save_checkpoint


def prompt_records(prompts: Sequence[Any]) -> list[PromptRecord]:
    """Prompts as the API takes them: text, token ids, or dicts with ``prompt`` (text) or
    ``prompt_ids`` and any other fields (they reach reward functions as the prompt's meta)."""
    if isinstance(prompts, (str, dict)) or not len(prompts):
        raise UsageError("sample takes a non-empty list of prompts (texts, token-id lists or "
                         "dicts with 'prompt')")
    records = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            records.append(PromptRecord(p))
        elif isinstance(p, dict) and ("prompt" in p or "prompt_ids" in p):
            meta = {k: v for k, v in p.items() if k not in ("prompt", "prompt_ids")}
            ids = p.get("prompt_ids")
            records.append(PromptRecord(p.get("prompt", ""), meta,
                                        tuple(int(t) for t in ids) if ids is not None else None))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(t, int) for t in p):
            records.append(PromptRecord("", {}, tuple(p)))
        else:
            raise UsageError(f"prompt {i}: give a text, a list of token ids or a dict with "
                             f"'prompt', not {type(p).__name__}")
    return records


class RLWorker:
    """One rank's run, built in the rank's process (`mcore_rl.flow.rank_context`)."""

    def __init__(self, cfg_data: dict):
        from mcore_rl.config.loader import _build
        from mcore_rl.flow import rank_context

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        cfg = _build(RLConfig, cfg_data, "")
        ctx = rank_context()
        with initial_model_removed_on_failure(cfg, ctx):
            self.state = build_run(cfg, ctx)
            resume_or_warm_start(self.state)

    def sample(self, prompts: Sequence[Any], n: int | None, greedy: bool) -> Batch:
        state = self.state
        records = prompt_records(prompts)
        if any(r.token_ids is not None and not r.prompt for r in records):
            records = [r if r.prompt or r.token_ids is None else
                       PromptRecord(state.tokenizer.decode(list(r.token_ids)), r.meta, r.token_ids)
                       for r in records]
        return phases.generate(state, records, greedy=greedy, n=n, step=state.step + 1)

    def update(self, batch: Batch, scores: torch.Tensor) -> dict[str, float]:
        state = self.state
        state.step += 1
        timer = PhaseTimer()
        batch = phases.with_scores(state, batch, scores)
        metrics = learn(state, batch, timer)
        state.log.log(state.step, metrics, console=False)
        return metrics

    def validate(self) -> float:
        score = validation_score(self.state)
        self.state.log.log(self.state.step, {"val/score": score}, console=False)
        return score

    def save(self, path: str | None) -> str:
        checkpoints = None if path is None else RunCheckpoints(Path(path))
        return str(save_checkpoint(self.state, checkpoints))

    def info(self) -> dict[str, Any]:
        s = self.state
        return {"step": s.step, "weight_version": s.weight_version, "layout": str(s.ctx.layout),
                "log_dir": str(s.log.dir), "n_samples_per_prompt": s.cfg.rollout.n_samples_per_prompt}

    def close(self) -> None:
        finish(self.state)
