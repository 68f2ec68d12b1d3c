"""One MLflow run per fedprivacy run (:class:`mlflow.tracking.MlflowClient`, no global state): each tracked metric
at step = the round, the resolved config as params (dotted field names) and as the artifact ``config.yaml``.

MLflow 3 keeps its file store (``file:``) in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE``
is set: for a ``file:`` URI this module sets it to ``true`` (unless already set).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from fedprivacy.config import TrackingConfig, flat
from fedprivacy.tracking.tracker import experiment_name, tracking_uri

BATCH = 100
"""Params or tags per ``log_batch`` (MLflow's limit)."""


def client_for(uri: str) -> MlflowClient:
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def experiment_id(client: MlflowClient, name: str) -> str:
    """The id of the experiment ``name``, created if missing (by another process meanwhile: found again)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def params_of(config: Mapping[str, Any]) -> dict[str, str]:
    """Each config field (dotted) -> its value as MLflow keeps params, text (strings as they are, else JSON)."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in flat(dict(config)).items()}


class MlflowWriter:
    """The run's MLflow run: new, or the one ``state["run_id"]`` names in the same store (a resume), whose
    metrics' last steps it reads so that no step is logged twice. A resume that changed a config field
    (MLflow refuses to change a param) records the new value as the tag ``resumed.<field>``."""

    key = "mlflow"

    def __init__(self, folder: Path, state: Mapping[str, Any], settings: TrackingConfig, config: Mapping[str, Any],
                 config_text: str, run_name: str) -> None:
        self.uri = tracking_uri(folder, settings.mlflow_uri)
        self.client = client_for(self.uri)
        self.last: dict[str, int] = {}  # metric -> its last logged step
        if state.get("tracking_uri") == self.uri:
            self.run_id = str(state["run_id"])
            run = self.client.get_run(self.run_id)
            self.client.update_run(self.run_id, status="RUNNING")
            self.last = {key: max(m.step for m in self.client.get_metric_history(self.run_id, key))
                         for key in run.data.metrics}
            logged = run.data.params
        else:
            experiment = experiment_id(self.client, experiment_name(folder, settings))
            self.run_id = self.client.create_run(experiment, run_name=run_name).info.run_id
            logged = {}
        params = params_of(config)
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = [RunTag(f"resumed.{k}", v) for k, v in params.items() if k in logged and logged[k] != v]
        for i in range(0, len(new), BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + BATCH])
        for i in range(0, len(changed), BATCH):
            self.client.log_batch(self.run_id, tags=changed[i:i + BATCH])
        self.client.log_text(self.run_id, config_text, "config.yaml")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        new = [Metric(k, v, now, step) for k, v in metrics.items() if self.last.get(k, -1) < step]
        if new:
            self.client.log_batch(self.run_id, metrics=new)
            self.last |= {m.key: step for m in new}

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)
