"""fedprivacy's DPFedAvg in one's own Flower ServerApp, watched in TensorBoard and MLflow (docs/TRACKING.md).

The strategy calls ``on_round(round, metrics)`` after each round's release; a tracker's ``log_round`` takes
them (``private/epsilon_rdp``, ``not_private/clipped_fraction``, ...), and the ServerApp's own evaluation is
logged the same way. With ``state_dir`` the strategy resumes after a crash, and the tracker continues the same
MLflow run and TensorBoard log (``tracking.json`` in the same folder).

Run:  python examples/tracked_strategy.py [OUT]          (default OUT: runs/tracked_strategy)
Then: tensorboard --logdir OUT/tensorboard
      MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri OUT/mlruns
"""

import sys
from pathlib import Path

from dp_strategy import USERS, accuracy, client_app
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from torch import nn

from fedprivacy.config import TrackingConfig
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.tracking import RunTracker, open_tracker


def tracked_server_app(out: Path, rounds: int = 20, users: int = USERS) -> ServerApp:
    """A ServerApp training with DPFedAvg for ``rounds`` rounds over ``users`` users, tracked into ``out``."""
    settings = {"noise_multiplier": 1.0, "clip_norm": 1.0, "expected_cohort": 10, "population": users,
                "optimizer": "adam", "lr": 0.05, "delta": 1e-3}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        with open_tracker(out, TrackingConfig(tensorboard=True, mlflow=True), {**settings, "rounds": rounds},
                          placement="central") as tracker:
            strategy = DPFedAvg(**settings, optimizer_settings={"tau": 1e-3}, state_dir=out,
                                on_round=tracker.log_round)
            strategy.start(grid=grid, initial_arrays=ArrayRecord(nn.Linear(20, 2).state_dict()), num_rounds=rounds,
                           evaluate_fn=lambda rnd, arrays: evaluate(tracker, rnd, arrays))

    return app


def evaluate(tracker: RunTracker, rnd: int, arrays: ArrayRecord) -> MetricRecord:
    """The server's evaluation of round ``rnd``'s model, tracked as ``not_private/test_accuracy``."""
    metrics = {"test_accuracy": accuracy(arrays)}
    tracker.log_round(rnd, metrics)
    return MetricRecord(metrics)


if __name__ == "__main__":
    run_inprocess(tracked_server_app(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tracked_strategy")),
                  client_app, USERS)
