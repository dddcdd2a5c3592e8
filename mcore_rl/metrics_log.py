"""Where metrics go: console summary, progress bar, JSONL, TensorBoard, sample rollouts,
and a reward-curve plot at the end. Only rank 0 writes."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

CONSOLE_KEYS = ("reward/mean", "val/score", "val/rm_score", "actor/kl", "actor/entropy",
                "actor/clip_fraction", "critic/loss", "response/length", "perf/tokens_per_s")


class MetricsLog:
    """Append-only run logs in ``directory`` (safe to reopen on resume)."""

    def __init__(self, directory: str | Path, total_steps: int = 0, start_step: int = 0,
                 tensorboard: bool = True, progress_bar: bool = True, enabled: bool = True):
        self.dir = Path(directory)
        self.enabled = enabled
        self.writer = None
        self.bar = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:
                print("mcore-rl: tensorboard is not installed; skipping event files")
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="rl", unit="step",
                            dynamic_ncols=True)
        self.t0 = time.time()

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (on resume they run again; 0: a fresh run)."""
        if not self.enabled:
            return
        for path in (self.metrics_path, self.samples_path):
            if path.exists():
                keep = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= step]
                path.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict[str, float], console: bool = True) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self.writer.add_scalar(k, float(v), step)
            self.writer.flush()
        if self.bar is not None and step > self.bar.n:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in
                                  ("reward/mean", "val/score") if k in metrics})
        if console:
            parts = [f"{k} {metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics]
            line = f"step {step}: " + "  ".join(parts)
            (self.bar.write if self.bar is not None else print)(line)

    def samples(self, step: int, rows: list[dict]) -> None:
        if not self.enabled:
            return
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def history(self) -> list[dict]:
        if not self.enabled or not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def plot_reward_curve(history: list[dict], path: str | Path) -> Path | None:
    """PNG of training reward (and validation score) per step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [h["step"] for h in history if "reward/mean" in h]
    ax.plot(steps, [h["reward/mean"] for h in history if "reward/mean" in h], label="train reward")
    val = [(h["step"], h["val/score"]) for h in history if "val/score" in h]
    if val:
        ax.plot(*zip(*val), "o-", label="validation (greedy)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
