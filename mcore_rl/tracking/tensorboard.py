"""``tensorboard``: event files in ``logging.dir``/tensorboard, through torch's
``SummaryWriter``. On resume the writer purges the steps after the checkpoint, so
TensorBoard shows each step once (the resumed attempt's values); a fresh run in the same
directory purges the earlier run's."""
from __future__ import annotations

import math

from mcore_rl.tracking.base import TRACKERS, Tracker


@TRACKERS.register("tensorboard")
class TensorBoardTracker(Tracker):
    name = "tensorboard"
    package = "tensorboard"

    def start(self, resumed_after: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = 0 if resumed_after is None else resumed_after + 1  # a fresh run: all of them
        self.writer = SummaryWriter(str(self.run.dir / "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def samples(self, step: int, rows: list[dict]) -> None:
        lines = [f"| {r['reward']:.3g} | {_cell(r['prompt'])} | {_cell(r['response'])} |" for r in rows]
        self.writer.add_text("samples", "| reward | prompt | response |\n|---|---|---|\n"
                             + "\n".join(lines), step)

    def close(self, outcome: str = "finished", artifacts=()) -> None:
        self.writer.close()


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
