"""One run's trackers (TensorBoard, MLflow) and what a resume needs to continue them, ``<folder>/tracking.json``.

A round reaches the trackers named ``private/<column>`` or ``not_private/<column>``, as ``metrics_columns.json``
classifies the ``metrics.csv`` column (:func:`fedprivacy.outputs.metrics_columns`: private means covered by the
reported epsilon), at step = the round; a NaN (a metric not measured that round) is not logged, and the
``round`` column is the step itself. Resume without duplicated steps: TensorBoard's readers drop what a crash
left after the last round recorded in ``tracking.json`` (``purge_step``) and the rounds after it are written
again; MLflow continues the run whose id ``tracking.json`` holds and skips each metric's steps it already has.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlparse

import yaml

from fedprivacy.config import TrackingConfig
from fedprivacy.outputs import metrics_columns

STATE_FILE = "tracking.json"
EXTRA = "pip install 'fedprivacy[tracking]'"


class TrackingUnavailable(ImportError):
    """Tracking was asked for and its library is not installed (the message names the extra)."""


class Writer(Protocol):
    """One tracker: metrics at a step, its part of ``tracking.json``, closed with the run's status."""

    key: str

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def close(self, status: str) -> None: ...


def tracked_name(column: str, private: bool) -> str:
    """The tracked name of a ``metrics.csv`` column: ``private/<column>`` (covered by the reported epsilon) or
    ``not_private/<column>`` (a diagnostic that epsilon does not cover)."""
    return f"{'private' if private else 'not_private'}/{column}"


def tracking_uri(folder: Path, given: str | None) -> str:
    """The MLflow tracking URI: ``given`` when it is a URI (a scheme of two letters or more), a folder's
    ``file:`` URI when it is a path, ``<folder>/mlruns`` when None."""
    if given is not None and len(urlparse(given).scheme) > 1:
        return given
    return Path(given if given is not None else folder / "mlruns").resolve().as_uri()


def experiment_name(folder: Path, settings: TrackingConfig) -> str:
    """The MLflow experiment: ``settings.experiment``, else the run folder's name."""
    return settings.experiment or Path(folder).resolve().name


def read_state(folder: Path) -> dict[str, dict[str, Any]]:
    """``tracking.json`` (empty without one): ``tensorboard: {round}``, ``mlflow: {run_id, tracking_uri}``.

    Raises:
        ValueError: the file is not such a mapping, naming it.
    """
    path = folder / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); move it away to start new tracking runs") from None
    fields: dict[str, dict[str, type]] = {"tensorboard": {"round": int}, "mlflow": {"run_id": str, "tracking_uri": str}}
    ok = isinstance(state, dict) and all(
        key in fields and isinstance(entry, dict) and set(entry) == set(fields[key])
        and all(isinstance(entry[f], t) and not isinstance(entry[f], bool) for f, t in fields[key].items())
        for key, entry in state.items())
    if not ok:
        raise ValueError(f"{path} must map tensorboard to {{round: int}} and mlflow to {{run_id: str, tracking_uri: "
                         f"str}}; move it away to start new tracking runs")
    return state


class RunTracker:
    """Sends each round to every writer and keeps ``tracking.json``; a context manager closing the writers with
    the run's status (``FINISHED``, ``KILLED`` on an interrupt, else ``FAILED``)."""

    def __init__(self, folder: Path, writers: Sequence[Writer], placement: str) -> None:
        self.folder, self.writers, self.placement = Path(folder), list(writers), placement
        self.offered = 0  # the last round given to the writers by this tracker
        self._names: dict[str, str] = {}

    def log_round(self, round_: int, metrics: Mapping[str, float]) -> None:
        """Round ``round_``'s ``metrics`` (``metrics.csv`` columns -> values) to every writer (a
        :data:`~fedprivacy.callbacks.RoundCallback`)."""
        if not self.writers:
            return
        new = [c for c in metrics if c != "round" and c not in self._names]
        self._names |= {c: tracked_name(c, info["private"])
                        for c, info in metrics_columns(new, self.placement).items()}
        values = {self._names[c]: float(v) for c, v in metrics.items() if c != "round" and not math.isnan(float(v))}
        for writer in self.writers:
            writer.write(round_, values)
        self.offered = max(self.offered, round_)
        self._save()

    def log_rows(self, rows: Sequence[Mapping[str, float]]) -> None:
        """The rows (``metrics.csv``'s, each with its ``round``) after the last one given: a run gives its rows
        once they are checkpointed, so a resume never has a tracked round to take back."""
        start = len(rows)
        while start and rows[start - 1]["round"] > self.offered:
            start -= 1
        for row in rows[start:]:
            self.log_round(int(row["round"]), row)

    def _save(self) -> None:
        tmp = self.folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps({w.key: w.state() for w in self.writers}, indent=1))
        os.replace(tmp, self.folder / STATE_FILE)

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        status = "FINISHED" if kind is None else "KILLED" if issubclass(kind, KeyboardInterrupt) else "FAILED"
        for writer in self.writers:
            writer.close(status)


def _writer_module(name: str, field: str) -> Any:
    try:
        return importlib.import_module(f"fedprivacy.tracking.{name}")
    except ImportError as err:
        raise TrackingUnavailable(f"tracking.{field}: true needs a package that is not installed ({err}); install "
                                  f"it with: {EXTRA}") from err


def open_tracker(folder: str | Path, settings: TrackingConfig, config: Mapping[str, Any], placement: str,
                 run_name: str | None = None, resume: bool = True) -> RunTracker:
    """The trackers ``settings`` switches on for the run in ``folder`` (created if missing), continuing those
    ``tracking.json`` names when ``resume`` (else a new MLflow run, and TensorBoard's readers drop the folder's
    earlier events); ``config`` (the resolved config, a nested mapping) is logged as MLflow params and as text;
    ``placement`` (``privacy.placement``) decides whether ``server_noise_std`` is private; ``run_name``: the MLflow
    run's name (default: the folder's name).

    Raises:
        TrackingUnavailable: a tracker's library is missing (naming the extra).
        ValueError: ``tracking.json`` is damaged, naming it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = read_state(folder) if resume else {}
    text = yaml.safe_dump(dict(config), sort_keys=False)
    writers: list[Writer] = []
    try:
        if settings.tensorboard:
            writers.append(_writer_module("tensorboard_writer", "tensorboard").TensorBoardWriter(
                folder, state.get("tensorboard", {}), text))
        if settings.mlflow:
            writers.append(_writer_module("mlflow_writer", "mlflow").MlflowWriter(
                folder, state.get("mlflow", {}), settings, config, text, run_name or folder.resolve().name))
    except BaseException:
        for writer in writers:
            writer.close("FAILED")
        raise
    return RunTracker(folder, writers, placement)
