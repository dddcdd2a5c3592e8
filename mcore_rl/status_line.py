"""The console's line per step: the step of the run, the headline metrics, the latest
validation score, tokens/s, each phase's share of the step, and the time left.

Where the process that writes it (the trainer's first rank) has a terminal for its output
(under torchrun or srun), the line is live: it is rewritten in place at every step and
kept (a new line) every ``logging.log_every`` steps. Elsewhere (a file, a pipe, the
Ray driver relaying a rank's output) each kept line is a plain line and nothing else is
written: no progress-bar frames."""
from __future__ import annotations

import sys
import time
from typing import TextIO

RL_KEYS = ("reward/mean", "actor/kl", "actor/entropy", "actor/clip_fraction", "critic/loss",
           "response/length")
"""The headline metrics of an RL step, in the order shown."""
VALIDATION_KEYS = ("val/score", "val/rm_score")
NOT_PHASES = ("time/step", "time/batch_interval")
"""``time/*`` metrics that are not a phase of the step (nor are waits, ``time/*_s``)."""


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def phase_shares(metrics: dict[str, float], top: int = 3) -> str:
    """``generate 36%, update 56%``: the largest phases (``time/<phase>``) as shares of
    ``time/step``, in the order the step ran them."""
    total = metrics.get("time/step", 0.0)
    phases = [(k[len("time/"):], v / total) for k, v in metrics.items()
              if k.startswith("time/") and k not in NOT_PHASES and not k.endswith("_s")
              and total > 0]
    kept = sorted(sorted(phases, key=lambda p: -p[1])[:top], key=lambda p: phases.index(p))
    return ", ".join(f"{name} {share:.0%}" for name, share in kept if share >= 0.01)


class StatusLine:
    """Renders `update` calls as the line described in the module doc, on ``stream``
    (live when it is a terminal, unless ``live`` says otherwise)."""

    def __init__(self, total_steps: int, keys: tuple[str, ...] = RL_KEYS,
                 stream: TextIO | None = None, live: bool | None = None,
                 clock=time.monotonic):
        self.total, self.keys = total_steps, keys
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.clock = clock
        self.validation: dict[str, float] = {}
        self.first: tuple[int, float] | None = None  # (step, time) of this attempt's first step
        self.pending = False  # a live line without its newline

    def render(self, step: int, metrics: dict[str, float]) -> str:
        for key in VALIDATION_KEYS:
            if key in metrics:
                self.validation[key] = metrics[key]
        head = f"step {step}/{self.total}:" if self.total and step > 0 else f"step {step}:"
        parts = [f"{k} {metrics[k]:.4g}" for k in self.keys if k in metrics]
        parts += [f"{k} {v:.4g}" for k, v in self.validation.items() if k not in self.keys]
        line = " ".join([head, "  ".join(parts)])
        extra = []
        if "perf/tokens_per_s" in metrics:
            extra.append(f"{metrics['perf/tokens_per_s']:.3g} tokens/s")
        shares = phase_shares(metrics)
        if shares:
            extra.append(shares)
        eta = self._eta(step)
        if eta is not None:
            extra.append(f"eta {eta}")
        return " | ".join([line, *extra])

    def _eta(self, step: int) -> str | None:
        if step <= 0 or not self.total:
            return None
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
            return None
        done = step - self.first[0]
        if done <= 0:
            return None
        return format_duration((now - self.first[1]) / done * max(0, self.total - step))

    def update(self, step: int, metrics: dict[str, float], keep: bool = True) -> None:
        """Show ``step``'s line: kept (``keep``) or, live, in place (until the next line or
        `close`)."""
        line = self.render(step, metrics)
        if not self.live:
            if keep:
                print(line, file=self.stream, flush=True)
            return
        self.stream.write("\r\x1b[K" + line + ("\n" if keep else ""))
        self.stream.flush()
        self.pending = not keep

    def close(self) -> None:
        if self.pending:
            self.stream.write("\n")
            self.stream.flush()
            self.pending = False
