"""``mlflow``: an MLflow run (``logging.mlflow``), through the MLflow client, on a tracking
server or in a database (by default the file ``logging.dir``/mlflow.db).

The config goes in as params (``section.field``) and the run's git revision as the
``mlflow.source.git.commit`` tag; each step's metrics at that step; sample rollouts as JSON
artifacts (``samples/step_N.json``); at the end, the reward-curve plot and the final config
(``config.yaml``) as artifacts. On resume the same MLflow run continues (its id is kept in
``logging.dir``/trackers.json); MLflow keeps every value logged, so the steps a killed
attempt logged after its last checkpoint have two values, the killed attempt's first."""
from __future__ import annotations

import importlib.util
import math
import os
import time
from pathlib import Path
from urllib.parse import urlparse

from mcore_rl.errors import UsageError
from mcore_rl.tracking.base import TRACKERS, Tracker, flat, git_revision

SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")
"""What MLflow tracks to (its file store, ``file:``, is frozen: MLflow refuses new runs there)."""


STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
"""MLflow's run status for each outcome of an attempt."""


def tracking_uri_of(logging) -> str:
    uri = logging.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    return uri or default_uri(logging)


def default_uri(logging) -> str:
    """The database file ``logging.dir``/mlflow.db."""
    return f"sqlite:///{Path(logging.dir).resolve() / 'mlflow.db'}"


def sqlite_path(uri: str) -> Path:
    """The database file of a ``sqlite:///`` URI (``sqlite:///rel.db`` is relative to the
    working directory, ``sqlite:////abs.db`` absolute)."""
    return Path(uri[len("sqlite:///"):]).resolve()


def _unreachable(uri: str) -> str | None:
    """Why the tracking server at ``uri`` does not answer, or None when it does."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10) as reply:
            return None if reply.status == 200 else f"/health answered {reply.status}"
    except urllib.error.HTTPError as err:  # behind a proxy that asks for the client's token: up
        return None if err.code in (401, 403) else f"/health answered {err.code}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        return str(getattr(err, "reason", err))


@TRACKERS.register("mlflow")
class MlflowTracker(Tracker):
    name = "mlflow"
    package = "mlflow"

    @classmethod
    def check(cls, logging) -> None:
        super().check(logging)
        uri = tracking_uri_of(logging)
        scheme = "databricks" if uri.startswith("databricks") else urlparse(uri).scheme
        if scheme in ("file", ""):
            raise UsageError(f"logging.mlflow.tracking_uri={uri}: MLflow no longer takes new runs in "
                             "a directory (its file store); use a database file, e.g. "
                             f"{default_uri(logging)}, or a server")
        if scheme not in SCHEMES:
            raise UsageError(f"logging.mlflow.tracking_uri={uri} has scheme {scheme!r}, which MLflow "
                             f"does not track to; use one of {', '.join(s + ':' for s in SCHEMES)}")
        if scheme in ("http", "https"):
            why = _unreachable(uri)
            if why is not None:
                raise UsageError(f"logging.mlflow.tracking_uri={uri}: the tracking server does not "
                                 f"answer ({why}); start it ('mlflow server') or fix the URI")
        if scheme not in ("http", "https", "databricks") \
                and importlib.util.find_spec("sqlalchemy") is None:
            raise UsageError(f"logging.mlflow.tracking_uri={uri} is a database, which the MLflow "
                             "client alone (mlflow-skinny) cannot write; pip install mlflow, or "
                             "give a tracking server's http:// address")
        if scheme == "sqlite":
            path = sqlite_path(uri)
            existing = next((p for p in (path, *path.parents) if p.exists()), None)
            if existing is not None and not os.access(existing if existing.is_dir() else existing.parent,
                                                      os.W_OK):
                raise UsageError(f"logging.mlflow.tracking_uri={uri}: {existing} is not writable; "
                                 "choose a directory of yours")

    def start(self, resumed_after: int | None) -> None:
        import logging as pylogging

        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        pylogging.getLogger("mlflow").setLevel(pylogging.WARNING)  # no INFO lines on the console

        cfg, uri = self.run.logging.mlflow, tracking_uri_of(self.run.logging)
        self.client = MlflowClient(uri)
        run_id = self.recall() if resumed_after is not None else None
        if run_id is not None:
            self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            self.run_id = run_id
            return
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # a database's artifacts beside it (MLflow would put them in ./mlruns)
            where = (sqlite_path(uri).parent / "mlartifacts").as_uri() \
                if uri.startswith("sqlite:///") else None
            experiment_id = self.client.create_experiment(cfg.experiment, artifact_location=where)
        tags = {"mlflow.source.git.commit": git_revision() or ""}
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.run_name or self.run.name,
                                             tags=tags).info.run_id
        self.remember(self.run_id)
        params = [Param(k, str(v)[:6000]) for k, v in flat(self.run.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def samples(self, step: int, rows: list[dict]) -> None:
        self.client.log_dict(self.run_id, rows, f"samples/step_{step:06d}.json")

    def close(self, outcome: str = "finished", artifacts=()) -> None:
        import yaml

        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        self.client.log_text(self.run_id, yaml.safe_dump(self.run.config, sort_keys=False),
                             "config.yaml")
        self.client.set_terminated(self.run_id, STATUS[outcome])
