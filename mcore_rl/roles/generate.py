"""The rollout role: prompts -> a rollout `Batch`, sampled by an engine this role owns and
publishes (as ``engine/<i>``) for the trainer's weight sync.

    Controller("rollout", factory(Generate, cfg_data, model_dir, "engine/0"), data=prompts,
               data_output=rollouts)

The engine lives in the role's process: the rollout controller's own, or the trainer's
first rank with the ``fused`` placement (with vLLM that is the blocking, in-process engine:
vLLM's ``AsyncLLM`` always starts an engine process of its own)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

from mcore_rl.config import config_from_dict
from mcore_rl.data.batch import Batch
from mcore_rl.data.prompts import PromptRecord
from mcore_rl.errors import UsageError

ASLEEP_CHECK_S = 1.0
"""How long a rollout role waits at most for its (colocated) engine to wake before it looks
again (the wake itself ends the wait at once)."""


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


class Generate:
    """A rollout role: a list of prompts (texts, token ids or dicts with ``prompt`` and the
    reward's fields) -> a rollout `Batch`, sampled by an engine of this process, published
    as ``name`` for the trainer's weight sync."""

    def __init__(self, cfg_data: dict, model_dir: str | Path, name: str):
        from mcore_rl.data.tokenizer import load_tokenizer
        from mcore_rl.engines import build_rollout_engine
        from mcore_rl.engines.stale_shm import remove_stale_shared_memory
        from mcore_rl.flow import publish
        from mcore_rl.reshard.native import engine_options
        from mcore_rl.rl import phases
        from mcore_rl.sizes import format_bytes

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.cfg = config_from_dict(cfg_data)
        self.tokenizer = load_tokenizer(model_dir)
        removed, freed = remove_stale_shared_memory()
        if removed:
            print(f"mcore-rl: removed {removed} shared-memory file(s) ({format_bytes(freed)}) that "
                  "killed engine processes left in /dev/shm", flush=True)
        log_file = Path(self.cfg.logging.dir) / f"{name.replace('/', '_')}.log"
        kind, started = self.cfg.rollout.engine, time.perf_counter()
        print(f"mcore-rl: {name}: starting the {kind} engine", flush=True)
        self.engine = build_rollout_engine(
            self.cfg.rollout, model_dir, dtype=self.cfg.model.dtype, seed=self.cfg.train.seed,
            log_file=log_file, max_model_len=phases.context_length(self.cfg),
            **engine_options(self.cfg.reshard))
        where = f" (its log: {log_file})" if log_file.exists() else ""
        print(f"mcore-rl: {name}: {kind} engine ready in {time.perf_counter() - started:.1f} s"
              f"{where}", flush=True)
        self.lock = publish(name, self.engine)
        self.calls = 0

    def __call__(self, item: Sequence[Any] | dict) -> Batch:
        """``item``: the prompts, or ``{"step": k, "prompts": [...]}`` (``k`` seeds the
        sampling as step ``k`` of ``mcore-rl train`` does; default: this call's number)."""
        self.calls += 1
        step, prompts = (item["step"], item["prompts"]) if isinstance(item, dict) else \
            (self.calls, item)
        records = prompt_records(prompts)
        t = time.perf_counter()
        batch = self._sample(records, step=step)
        batch.meta["producer"] = [os.getpid()] * len(batch)
        batch.info["prompts"] = len(records)
        batch.info["time/generate"] = time.perf_counter() - t
        return batch

    def sample(self, prompts: Sequence[Any], n: int | None, greedy: bool, step: int) -> Batch:
        """`mcore_rl.RLTrainer.sample`: ``n`` responses per prompt (or one greedy), seeded as
        step ``step``; prompts given as token ids alone are decoded for the reward's text."""
        from mcore_rl.rl import phases

        records = prompt_records(prompts)
        records = [r if r.prompt or r.token_ids is None else
                   PromptRecord(self.tokenizer.decode(list(r.token_ids)), r.meta, r.token_ids)
                   for r in records]
        return phases.mark_truncated(self.cfg, self._sample(records, step=step, n=n, greedy=greedy))

    def _sample(self, records: list[PromptRecord], **how: Any) -> Batch:
        from mcore_rl.rl import phases

        encoded = phases.encode_prompts(self.tokenizer, self.cfg, records)
        while True:
            with self.lock:  # a weight update waits for this generation, and the other way round
                if not self.engine.asleep:
                    return phases.sample_batch(self.engine, self.tokenizer, self.cfg, encoded, **how)
            # colocated: the trainer has the devices until its weight sync wakes the engine
            self.engine.wait_awake(ASLEEP_CHECK_S)

    def close(self) -> None:
        self.engine.close()
