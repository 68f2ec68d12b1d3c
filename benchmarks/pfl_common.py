"""The DP-FedAvg run both pfl-research workloads share (``pfl_round.py``, ``pfl_next_word.py``), in pfl's venv.

Each user's update re-weighted to 1 (``WeightByUser``), clipped to L2 norm C and noised once on the
server with std z C (``CentrallyAppliedPrivacyMechanism(GaussianMechanism(C, z))``), averaged over the
cohort (``FederatedAveraging``: divisor = the total weight = the cohort), central SGD lr 1; cohorts of
exactly ``cohort`` users from pfl's ``random`` sampler. Prints one JSON line: the median seconds per
round after the first, every round's seconds, peak RSS. No fedprivacy import: this venv has only pfl
and torch.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics
from pfl.model.pytorch import PyTorchModel
from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism


class Stopwatch(TrainingProcessCallback):
    """Time stamps after every central iteration (round)."""

    def __init__(self) -> None:
        self.stamps = [time.perf_counter()]

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        self.stamps.append(time.perf_counter())
        return False, Metrics()


def seed_single_thread() -> None:
    """One torch thread (as fedprivacy's default ``num_threads``) and fixed seeds."""
    torch.set_num_threads(1)
    np.random.seed(0)
    torch.manual_seed(0)


def run_dp_fedavg(net: torch.nn.Module, make_dataset: Callable[[int], Dataset], users: list[int], *, rounds: int,
                  cohort: int, clip: float, z: float, local_lr: float, local_batch_size: int,
                  eval_batch_size: int) -> None:
    """Run ``rounds`` rounds of DP-FedAvg (module docstring) on ``net`` and print the timing line."""
    federated = FederatedDataset(make_dataset, get_user_sampler("random", users))
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    mechanism = CentrallyAppliedPrivacyMechanism(GaussianMechanism(clip, z))
    backend = SimulatedBackend(training_data=federated, val_data=None, postprocessors=[WeightByUser(), mechanism])
    watch = Stopwatch()
    t0 = time.perf_counter()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=10**9,
                                           train_cohort_size=cohort, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=local_lr, local_num_epochs=1,
                                              local_batch_size=local_batch_size),
        model_eval_params=NNEvalHyperParams(local_batch_size=eval_batch_size), callbacks=[watch])
    seconds = np.diff(watch.stamps).tolist()
    per_round = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    print(json.dumps({"engine": "pfl", "seconds_per_round": per_round, "client_updates_per_s": cohort / per_round,
                      "rounds_timed": len(seconds) - 1, "round_seconds": seconds,
                      "wall_s_including_startup": time.perf_counter() - t0,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "pfl_threads": torch.get_num_threads()}), flush=True)
