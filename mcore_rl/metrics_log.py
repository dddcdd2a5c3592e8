"""Where metrics go: the console's status line (`mcore_rl.status_line`) and the run's
trackers (``logging.backends``: JSONL, TensorBoard, W&B, MLflow; `mcore_rl.tracking`), plus
a reward-curve plot at the end. Only rank 0 writes."""
from __future__ import annotations

from pathlib import Path

from mcore_rl.status_line import RL_KEYS, StatusLine
from mcore_rl.tracking import RunInfo, Tracker, tracker_class


class MetricsLog:
    """The run's logs in ``directory`` (safe to reopen on resume), sent to the trackers
    named in ``backends`` (`mcore_rl.tracking`; ``logging`` holds their settings, ``config``
    is the run's whole config as a mapping).

    The trackers start at `truncate_after` (the step the run resumes after, or -1 for a
    fresh run), or at the first record. A tracker that fails while the run goes on (a
    tracking server that went away) is reported in one line and dropped; the others, and
    the run, go on."""

    def __init__(self, directory: str | Path, total_steps: int = 0,
                 backends: tuple[str, ...] | list[str] = ("jsonl",), live: bool | None = None,
                 enabled: bool = True, logging=None, config: dict | None = None,
                 keys: tuple[str, ...] = RL_KEYS):
        self.dir = Path(directory)
        self.enabled = enabled
        self.trackers: list[Tracker] = []
        self.started = False
        self.records: list[dict] = []  # this process's records (history without jsonl)
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        run = RunInfo(self.dir, logging, config or {})
        self.trackers = [tracker_class(name)(run) for name in backends]
        for tracker, name in zip(self.trackers, backends):
            if tracker.name == Tracker.name:  # a class of the user's without a name
                tracker.name = name
        self.status = StatusLine(total_steps, keys, live=live)

    @classmethod
    def for_config(cls, cfg, enabled: bool, keys: tuple[str, ...] = RL_KEYS,
                   live: bool | None = None) -> "MetricsLog":
        """The log of a run of ``cfg`` (its ``logging`` section; the whole config goes to the
        trackers that record it); ``keys``: the metrics the status line shows; ``live``:
        whether it is rewritten in place (default: on a terminal, with
        ``logging.progress_bar``)."""
        from mcore_rl.config.loader import config_to_dict

        lg = cfg.logging
        if live is None and not lg.progress_bar:
            live = False
        return cls(lg.dir, cfg.train.steps, backends=lg.backends, enabled=enabled, logging=lg,
                   live=live, config=config_to_dict(cfg), keys=keys)

    def _each(self, what: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, what)(*args)
            except Exception as err:  # noqa: BLE001 - a tracker's failure must not end the run
                self.trackers.remove(tracker)
                self.status.close()  # a live line ends first
                print(f"mcore-rl: the {tracker.name} tracker failed ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); it records nothing "
                      "more, the run goes on", flush=True)

    def _start(self, resumed_after: int | None) -> None:
        if not self.started:
            self.started = True
            self._each("start", resumed_after)

    def truncate_after(self, step: int) -> None:
        """Where the run starts: after ``step`` on resume (records of later steps, the
        killed attempt's, are dropped where the tracker can drop them), -1 for a fresh run
        (the logs of an earlier run in the same directory go). Starts the trackers."""
        if self.enabled:
            self._start(None if step < 0 else step)

    def log(self, step: int, metrics: dict[str, float], console: bool = True) -> None:
        if not self.enabled:
            return
        self._start(None)
        values = {k: float(v) for k, v in metrics.items()}
        self.records.append({"step": step, **values})
        self._each("log", step, values)
        self.status.update(step, values, keep=console)

    def samples(self, step: int, rows: list[dict]) -> None:
        if self.enabled:
            self._start(None)
            self._each("samples", step, rows)

    def history(self) -> list[dict]:
        """Every step's record: from ``metrics.jsonl`` (the whole run, resumed attempts
        included) when ``jsonl`` is a backend, else this process's."""
        jsonl = next((t for t in self.trackers if t.name == "jsonl"), None)
        return jsonl.history() if jsonl is not None else list(self.records)

    def close(self, outcome: str = "finished", artifacts: tuple[Path, ...] = ()) -> None:
        """End the trackers' runs: ``outcome`` (`OUTCOMES`), with ``artifacts`` (files) to
        keep. Later calls do nothing."""
        if self.enabled:
            self.status.close()
        if self.enabled and self.started:
            self._each("close", outcome, tuple(a for a in artifacts if a is not None))
            self.trackers = [t for t in self.trackers if t.name == "jsonl"]  # history stays
            self.started = False


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
