"""``jsonl``: ``metrics.jsonl`` (a record per step) and ``samples.jsonl`` in ``logging.dir``;
on resume, the records of steps after the checkpoint (the killed attempt's) are dropped."""
from __future__ import annotations

import json

from mcore_rl.tracking.base import TRACKERS, Tracker


@TRACKERS.register("jsonl")
class JsonlTracker(Tracker):
    name = "jsonl"

    def __init__(self, run):
        super().__init__(run)
        self.metrics_path = run.dir / "metrics.jsonl"
        self.samples_path = run.dir / "samples.jsonl"

    def start(self, resumed_after: int | None) -> None:
        last = -1 if resumed_after is None else resumed_after
        for path in (self.metrics_path, self.samples_path):
            if path.exists():
                keep = [line for line in path.read_text().splitlines()
                        if line.strip() and _step(line) <= last]
                path.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def samples(self, step: int, rows: list[dict]) -> None:
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def history(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines()
                if line.strip() and _step(line) != float("inf")]


def _step(line: str) -> float:
    """A record's step; a line a killed process left half-written counts as after every
    step (dropped on resume)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return float("inf")
