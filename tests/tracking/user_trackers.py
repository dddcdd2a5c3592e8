"""Trackers of a user's own (``logging.backends: [tests.tracking.user_trackers:Class]``)."""
from mcore_rl.tracking import Tracker


class FailsAtStep2(Tracker):
    """Records steps into ``seen`` (a class attribute) and raises at step 2, as a tracker
    whose server went away would."""

    seen: list[int] = []

    def log(self, step, metrics):
        if step == 2:
            raise ConnectionError("the tracking server went away\nsecond line")
        FailsAtStep2.seen.append(step)


class RecordsOutcome(Tracker):
    """Writes how the run's attempt ended (`mcore_rl.tracking.OUTCOMES`) to
    ``logging.dir``/outcome.txt."""

    def close(self, outcome="finished", artifacts=()):
        (self.run.dir / "outcome.txt").write_text(outcome)
