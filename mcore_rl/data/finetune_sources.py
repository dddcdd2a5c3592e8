"""Where the fine-tuning jobs' raw records come from: a JSONL/parquet file (``data.path``,
validation ``data.val_path`` or its first ``data.num_val`` rows), or the built-in addition
task, made into SFT, preference and KTO records with checkable answers."""
from __future__ import annotations

import random

from mcore_rl.config import RLConfig
from mcore_rl.data.prompts import read_rows
from mcore_rl.data.toy_task import all_problems
from mcore_rl.errors import UsageError


def toy_rows(job: str, split: str, num_val: int, seed: int) -> list[dict]:
    """Records of the single-digit addition task. Validation: a seeded sample of ``num_val``
    sums, held out of training. The completion is the right sum; the rejected (dpo, rm) or
    undesirable (kto) one is off by one."""
    problems = all_problems()
    held_out = set(random.Random(seed + 1).sample(problems, min(num_val, len(problems) - 1)))
    chosen = [p for p in problems if (p in held_out) == (split == "val")]
    rows = []
    for a, b in chosen:
        prompt, right, wrong = f"{a}+{b}=", str(a + b), str(a + b + 1)
        if job == "kto":
            rows += [{"prompt": prompt, "completion": right, "label": True},
                     {"prompt": prompt, "completion": wrong, "label": False}]
        elif job == "sft":
            rows.append({"prompt": prompt, "completion": right})
        else:
            rows.append({"prompt": prompt, "chosen": right, "rejected": wrong})
    return rows


def finetune_rows(cfg: RLConfig, split: str) -> tuple[list[dict], str]:
    """(raw rows, where they come from) of the train or val split; no validation rows at
    ``data.num_val=0`` without a ``data.val_path``."""
    d, job = cfg.data, cfg.train.job
    if d.source == "builtin":
        if split == "val" and d.num_val == 0:
            return [], "the built-in task"
        return toy_rows(job, split, d.num_val, d.seed), f"the built-in task ({split})"
    if d.source not in ("jsonl", "parquet"):
        raise UsageError(f"data.source={d.source} cannot feed train.job={job}; use jsonl or parquet "
                         "(data.path) or builtin")
    if split == "val" and d.val_path:
        return read_rows(d.val_path), d.val_path
    if not d.path:
        raise UsageError(f"data.source={d.source} needs data.path (train.job={job})")
    rows = read_rows(d.path)
    if split == "val":
        return (rows[:d.num_val] if d.num_val < len(rows) else []), f"{d.path} (first {d.num_val} rows)"
    held = 0 if d.val_path or d.num_val >= len(rows) else d.num_val
    return rows[held:], d.path
