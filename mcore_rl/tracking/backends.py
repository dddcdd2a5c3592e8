"""The built-in trackers (each module registers its class in `TRACKERS`; none imports its
backend's package until it starts), and the lookups by name."""
from __future__ import annotations

from mcore_rl.errors import UsageError
from mcore_rl.tracking import jsonl, mlflow_tracker, tensorboard, wandb_tracker  # noqa: F401
from mcore_rl.tracking.base import TRACKERS, Tracker


def tracker_class(name: str) -> type[Tracker]:
    """The tracker class of a ``logging.backends`` name (or ``module:Class``)."""
    cls = TRACKERS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Tracker)):
        raise UsageError(f"{name} is not a tracker; give a class that subclasses "
                         "mcore_rl.tracking.Tracker")
    return cls


def check_trackers(logging) -> None:
    """Every backend of ``logging.backends`` known, named once, and able to start (package
    installed, credentials or server there); one `UsageError` line otherwise."""
    seen: set[str] = set()
    for name in logging.backends:
        if name in seen:
            raise UsageError(f"logging.backends names {name} twice; name each backend once")
        seen.add(name)
        try:
            tracker = tracker_class(name)
        except UsageError as err:
            raise UsageError(f"logging.backends: {err}") from None
        tracker.check(logging)
