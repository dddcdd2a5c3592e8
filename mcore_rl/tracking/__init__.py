"""Experiment trackers: where each step's metrics, sample rollouts and the run's final
artifacts go (``logging.backends``). One interface (`Tracker`), one class per backend,
registered in `TRACKERS`; `mcore_rl.metrics_log.MetricsLog` fans out to the run's trackers.

Only this package imports ``wandb`` and ``mlflow``, and only when the backend is used."""
from mcore_rl.tracking.backends import check_trackers, tracker_class
from mcore_rl.tracking.base import OUTCOMES, TRACKERS, RunInfo, Tracker

__all__ = ["OUTCOMES", "TRACKERS", "RunInfo", "Tracker", "check_trackers", "tracker_class"]
