"""`Rollouts`: what `RLTrainer.sample` returns, and what `RLTrainer.update` takes back."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from mcore_rl.data.batch import Batch
from mcore_rl.errors import UsageError


class Rollouts:
    """Sampled responses, one row per response (``n`` rows per prompt, prompt by prompt).

    Read by key (lists, one entry per row): ``prompt`` (text), ``meta`` (the prompt's
    fields, e.g. ``answer``), ``prompt_ids``, ``response_ids`` (the engine's token ids),
    ``response`` (their text), ``logprobs`` (the engine's log-prob of each response
    token), ``finish_reason`` (``stop`` | ``length``), ``weight_version`` (the version
    of the weights that generated the row: 1 after the initial sync, +1 per update) and
    ``reward`` once set. Set ``rollouts["reward"]`` to one finite float per row before
    `RLTrainer.update`."""

    KEYS = ("prompt", "meta", "prompt_ids", "response_ids", "response", "logprobs",
            "finish_reason", "weight_version", "reward")

    def __init__(self, batch: Batch):
        self.batch = batch
        self.rewards: list[float] | None = None

    def __len__(self) -> int:
        return len(self.batch)

    def keys(self) -> tuple[str, ...]:
        return self.KEYS if self.rewards is not None else self.KEYS[:-1]

    def __getitem__(self, key: str) -> list:
        b = self.batch
        if key == "prompt":
            return [m["prompt"] for m in b.meta["prompt_meta"]]
        if key == "meta":
            return [{k: v for k, v in m.items() if k != "prompt"} for m in b.meta["prompt_meta"]]
        if key == "prompt_ids":
            return [row[(mask == 0) & (attn == 1)].tolist() for row, mask, attn in self._rows()]
        if key == "response_ids":
            return [row[mask == 1].tolist() for row, mask, _ in self._rows()]
        if key == "response":
            return list(b.meta["response_text"])
        if key == "logprobs":
            lp = b["rollout_logprobs"]
            return [lp[i][b["response_mask"][i] == 1].tolist() for i in range(len(b))]
        if key in ("finish_reason", "weight_version"):
            return list(b.meta[key])
        if key == "reward":
            if self.rewards is None:
                raise KeyError("reward: not set yet; set rollouts['reward'] = [one float per row]")
            return list(self.rewards)
        raise KeyError(f"{key!r}: Rollouts has {', '.join(self.keys())}")

    def __setitem__(self, key: str, value: Sequence[float] | torch.Tensor) -> None:
        if key != "reward":
            raise UsageError(f"Rollouts: only 'reward' can be set, not {key!r}")
        values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
        if len(values) != len(self):
            raise UsageError(f"rollouts['reward'] needs one value per row: got {len(values)} "
                             f"for {len(self)} rows")
        bad = [i for i, v in enumerate(values)
               if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)]
        if bad:
            raise UsageError(f"rollouts['reward'][{bad[0]}] = {values[bad[0]]!r}: every reward "
                             "must be a finite number")
        self.rewards = [float(v) for v in values]

    def scores(self) -> torch.Tensor:
        """[B] float32 rewards; a `UsageError` if they were not set."""
        if self.rewards is None:
            raise UsageError("update needs rewards: set rollouts['reward'] = [one float per row] "
                             "first")
        return torch.tensor(self.rewards, dtype=torch.float32)

    def _rows(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        b = self.batch
        return list(zip(b["input_ids"], b["response_mask"], b["attention_mask"]))

    def __repr__(self) -> str:
        versions = sorted(set(self.batch.meta["weight_version"]))
        return f"Rollouts({len(self)} rows, weight version {versions}, keys {list(self.keys())})"
