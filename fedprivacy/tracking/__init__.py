"""Run tracking: a run's per-round metrics and resolved config, also logged to TensorBoard and MLflow
(``tracking:`` in a run's config, :class:`~fedprivacy.config.TrackingConfig`; docs/TRACKING.md).

:func:`open_tracker` gives a :class:`RunTracker`, whose :meth:`RunTracker.log_round` is a
:data:`~fedprivacy.callbacks.RoundCallback` (``DPFedAvg(on_round=...)`` in one's own ServerApp). TensorBoard and
MLflow are imported only when tracking is on (the ``tracking`` extra).
"""

from fedprivacy.tracking.tracker import (STATE_FILE, RunTracker, TrackingUnavailable, experiment_name, open_tracker,
                                         tracked_name, tracking_uri)

__all__ = ["STATE_FILE", "RunTracker", "TrackingUnavailable", "experiment_name", "open_tracker", "tracked_name",
           "tracking_uri"]
