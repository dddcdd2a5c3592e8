"""Prompt sources: JSONL/parquet files, reasoning-gym generators, the built-in toy task.

A source yields `PromptRecord`s in a fixed seeded order and can say where it is
(`position`) so a resumed run continues with the same prompts.
"""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

from mcore_rl.config import DataConfig
from mcore_rl.data.records import PromptRecord
from mcore_rl.errors import UsageError
from mcore_rl.registry import Registry


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a JSONL or parquet file (by its suffix); one-line `UsageError` for a
    missing file or a line that is not JSON."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"data file '{path}' does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UsageError(f"{path}:{n} is not valid JSON ({err.msg})") from None
    return rows


def read_records(path: str | Path, prompt_key: str, answer_key: str) -> list[PromptRecord]:
    """JSONL or parquet rows -> records; a missing field names the file, row and key."""
    path = Path(path)
    rows = read_rows(path)
    records = []
    for n, row in enumerate(rows, 1):
        for key, name in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if key not in row:
                raise UsageError(f"{path}: row {n} has no field '{key}' ({name}); fields there: "
                                 f"{', '.join(sorted(row))}")
        meta = {k: v for k, v in row.items() if k != prompt_key}
        meta["answer"] = row[answer_key]
        records.append(PromptRecord(str(row[prompt_key]), meta))
    if not records:
        raise UsageError(f"data file '{path}' holds no records")
    return records


def reasoning_gym_records(task: str, size: int, seed: int) -> list[PromptRecord]:
    try:
        import reasoning_gym
    except ImportError:
        raise UsageError("data.source=reasoning_gym needs: pip install reasoning-gym") from None
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed)
    except Exception as err:  # noqa: BLE001 - unknown task names etc.
        raise UsageError(f"reasoning-gym cannot create task '{task}' (data.task): {err}") from None
    return [PromptRecord(e["question"], {"answer": e["answer"], "entry": e, "task": task})
            for e in dataset]


IDENTITY_KEYS = ("data_epoch", "data_index")
"""Fields `PromptStream.take` adds to each record's ``meta``: the epoch and the record's
index in the dataset, a prompt's identity that stays the same across a kill and resume
(``samples.jsonl`` carries it)."""


class PromptStream:
    """Endless seeded epochs over records (any items; e.g. preference pairs too);
    ``position`` counts records handed out. Each `PromptRecord` taken carries its identity
    (`IDENTITY_KEYS`) in its ``meta``."""

    def __init__(self, records: list[PromptRecord], seed: int):
        self.records = records
        self.seed = seed
        self.position = 0
        self._epoch_order: tuple[tuple, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        """The records' order in ``epoch`` (shuffled once per epoch: a take of n records
        from N once shuffled N records n times)."""
        key = (epoch, self.seed, len(self.records))
        if self._epoch_order is None or self._epoch_order[0] != key:
            order = list(range(len(self.records)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (key, order)
        return self._epoch_order[1]

    def take(self, n: int) -> list[PromptRecord]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.records))
            index = self._order(epoch)[i]
            record = self.records[index]
            if isinstance(record, PromptRecord):
                record = replace(record, meta={**record.meta, "data_epoch": epoch,
                                               "data_index": index})
            out.append(record)
            self.position += 1
        return out


PROMPT_SOURCES: Registry = Registry("prompt source")
"""``data.source`` name -> ``fn(cfg: DataConfig, split: "train" | "val") -> list[PromptRecord]``."""


@PROMPT_SOURCES.register("jsonl", aliases=("parquet",))
def file_records(cfg: DataConfig, split: str) -> list[PromptRecord]:
    """Records of the JSONL or parquet file ``data.path`` (by its suffix); validation:
    ``data.val_path``, or the first ``num_val`` rows."""
    if split == "val" and cfg.val_path:
        return read_records(cfg.val_path, cfg.prompt_key, cfg.answer_key)
    if not cfg.path:
        raise UsageError(f"data.source={cfg.source} needs data.path")
    records = read_records(cfg.path, cfg.prompt_key, cfg.answer_key)
    if split == "val":
        return records[:cfg.num_val]
    return records[cfg.num_val:] if not cfg.val_path and len(records) > cfg.num_val else records


@PROMPT_SOURCES.register("reasoning_gym")
def reasoning_gym_source(cfg: DataConfig, split: str) -> list[PromptRecord]:
    """Generated items of the reasoning-gym task ``data.task`` (validation: another seed)."""
    if not cfg.task:
        raise UsageError("data.source=reasoning_gym needs data.task (e.g. basic_arithmetic)")
    seed = cfg.seed + (7919 if split == "val" else 0)
    return reasoning_gym_records(cfg.task, cfg.num_val if split == "val" else 2000, seed)


@PROMPT_SOURCES.register("builtin")
def builtin_source(cfg: DataConfig, split: str) -> list[PromptRecord]:
    """The quick start's single-digit addition task."""
    from mcore_rl.data.toy_task import toy_records

    return toy_records(split, cfg.num_val, cfg.seed)


@PROMPT_SOURCES.register("calculator")
def calculator_source(cfg: DataConfig, split: str) -> list[PromptRecord]:
    """Two-step arithmetic for the calculator environment (``environment.name: calculator``)."""
    from mcore_rl.data.calculator_task import calculator_records

    return calculator_records(split, cfg.num_val, cfg.seed)


def load_prompt_records(cfg: DataConfig, split: str) -> list[PromptRecord]:
    """Train or validation records of the configured source (``data.source``); no
    validation records at ``data.num_val=0``."""
    if split == "val" and cfg.num_val == 0:
        return []
    return PROMPT_SOURCES.get(cfg.source)(cfg, split)
