"""Cohorts trained together vs one at a time: local SGD milliseconds per client.

    python benchmarks/cohort_training.py [--cohorts 10 100 1000] [--lstm-cohorts 10] [--repeat 5]
                                         [--run-cohorts 100 1000]

For each model and cohort size, the same clients (same data, same batch orders from
``client_generator``) train with :func:`fedprivacy.client.trainer.local_sgd` one after another
(the in-process engine's path) and with :func:`fedprivacy.client.cohort_training.train_cohort` in
the engine's chunks (:func:`~fedprivacy.engines.cohorts.chunks_by_size` of
:func:`~fedprivacy.engines.cohorts.chunk_size`). Passes of the two are
interleaved, alternating which goes first, after one warm-up pass each; prints the median and the
range over ``--repeat`` passes and the ratio of medians (> 1: batched is faster). torch 1 thread.

Models (random weights, random data; only shapes matter for time):

* ``mlp-2k``: 64 -> 32 -> 10 (2,410 parameters), the size of a digits-like user task;
* ``mlp-19k``: 64 -> 256 -> 10 (19,210), near ``auto``'s threshold;
* ``mlp-77k``: 64 -> 1024 -> 10 (76,810), above it;
  MLP clients hold 5-60 examples (uniform), batch 10, 1 epoch, softmax cross-entropy.
* ``next_word``: TFF's LSTM for a 10,000-word vocabulary (4,053,428 parameters) with the task's
  masked loss; clients hold 1-256 sentences of 20 tokens (log-uniform), batch 16, 1 epoch
  (Reddi et al.'s client settings); only ``--lstm-cohorts`` (it is slow on 2 cores).

Then whole DP-FedAvg rounds (``fedprivacy.run``, in-process engine) of this file's user task
(:func:`make`: 2,000 users with ``mlp-2k`` and 5-60 examples each) at ``--run-cohorts`` expected
clients, ``cohort_batching`` ``on`` vs ``off``: the median seconds per round of rounds 2-6 (the
``seconds`` column of metrics.csv: clients, server clipping, noise), runs interleaved.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from fedprivacy.client.cohort_training import train_cohort
from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.config import build_config
from fedprivacy.engines.cohorts import chunk_size, chunks_by_size
from fedprivacy.models.lstm import NextWordLSTM
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import NextWordTask

MLP_WIDTHS = {"mlp-2k": 32, "mlp-19k": 256, "mlp-77k": 1024}


def _mlp_workload(width: int, cohort: int, rng: np.random.Generator):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
    clients = [(torch.randn(int(n), 64), torch.randint(0, 10, (int(n),))) for n in rng.integers(5, 61, cohort)]
    return model, clients, nn.functional.cross_entropy, 10


def _lstm_workload(cohort: int, rng: np.random.Generator):
    torch.manual_seed(0)
    model = NextWordLSTM(10_004)
    sizes = np.minimum(256, np.exp(rng.uniform(0, np.log(256), cohort)).astype(int))
    clients = [(rng.integers(0, 10_004, (n, 20)), rng.integers(0, 10_004, (n, 20))) for n in sizes]
    return model, clients, NextWordTask.loss, 16


def _one_at_a_time(model, clients, loss_fn, batch_size) -> None:
    for i, (x, y) in enumerate(clients):
        local_sgd(model, x, y, epochs=1, batch_size=batch_size, lr=0.1, rng=client_generator(0, 1, i),
                  loss_fn=loss_fn)


def _together(model, clients, loss_fn, batch_size) -> None:
    for part in chunks_by_size([len(y) for _, y in clients], chunk_size(model)):
        train_cohort(model, [clients[i] for i in part], epochs=1, batch_size=batch_size, lr=0.1, loss_fn=loss_fn,
                     rngs=[client_generator(0, 1, i) for i in part])


def _measure(name: str, workload, repeat: int) -> None:
    model, clients, loss_fn, batch_size = workload
    paths = {"one at a time": _one_at_a_time, "together": _together}
    times = {label: [] for label in paths}
    for label, fn in paths.items():  # warm-up
        fn(model, clients, loss_fn, batch_size)
    for rep in range(repeat):
        for label in (list(paths) if rep % 2 == 0 else list(paths)[::-1]):
            t0 = time.perf_counter()
            paths[label](model, clients, loss_fn, batch_size)
            times[label].append(1e3 * (time.perf_counter() - t0) / len(clients))
    params = sum(p.numel() for p in model.parameters())
    cells = []
    for label, ts in times.items():
        cells.append(f"{label} {np.median(ts):8.2f} ms/client [{min(ts):.2f}, {max(ts):.2f}]")
    ratio = np.median(times["one at a time"]) / np.median(times["together"])
    print(f"{name:9s} {params:>9,d} params  cohort {len(clients):5d}  chunk {chunk_size(model):3d}  "
          + "  ".join(cells) + f"  one/together {ratio:.2f}x", flush=True)


class PointsTask:
    """A user task (``data.task: cohort_training:make``) of ``mlp-2k`` on random points."""

    population = 2000
    majority_baseline = 0.1

    def __init__(self, data_config: object = None) -> None:
        rng = np.random.default_rng(0)
        self.sizes = rng.integers(5, 61, self.population)
        self.x = torch.randn(int(self.sizes.sum()), 64, generator=torch.Generator().manual_seed(0))
        self.y = torch.randint(0, 10, (len(self.x),), generator=torch.Generator().manual_seed(1))
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])

    def new_model(self, device: str = "cpu") -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)

    def client_data(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice(int(self.starts[index]), int(self.starts[index + 1]))
        return self.x[rows], self.y[rows]

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, labels)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"test_accuracy": float("nan")}


def make(data_config: object) -> PointsTask:
    return PointsTask(data_config)


def _round_seconds(mode: str, cohort: int, out: Path) -> list[float]:
    cfg = build_config({"rounds": 6, "eval_every": 100, "output_dir": str(out / f"{mode}-{cohort}"),
                        "cohort_batching": mode, "data": {"task": "cohort_training:make"},
                        "client": {"epochs": 1, "batch_size": 10, "lr": 0.1},
                        "privacy": {"clip_norm": 1.0, "noise_multiplier": 1.0, "expected_cohort": cohort,
                                    "accountants": ["rdp"]}})
    run(cfg)
    return pd.read_csv(cfg.output_dir / "metrics.csv")["seconds"].iloc[1:].tolist()


def _measure_rounds(cohorts: list[int], repeat: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # data.task: cohort_training:make
    with tempfile.TemporaryDirectory() as tmp:
        for cohort in cohorts:
            seconds = {"off": [], "on": []}
            for rep in range(repeat):
                for mode in (["off", "on"] if rep % 2 == 0 else ["on", "off"]):
                    seconds[mode].extend(_round_seconds(mode, cohort, Path(tmp) / str(rep)))
            cells = [f"{m} {np.median(s):.3f} s/round [{min(s):.3f}, {max(s):.3f}]" for m, s in seconds.items()]
            print(f"round     mlp-2k user task  cohort {cohort:5d}  " + "  ".join(cells)
                  + f"  off/on {np.median(seconds['off']) / np.median(seconds['on']):.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cohorts", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--lstm-cohorts", type=int, nargs="*", default=[10])
    ap.add_argument("--models", nargs="*", default=[*MLP_WIDTHS, "next_word"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--run-cohorts", type=int, nargs="*", default=[100, 1000])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.models:
        for cohort in (args.lstm_cohorts if name == "next_word" else args.cohorts):
            rng = np.random.default_rng(cohort)
            workload = (_lstm_workload(cohort, rng) if name == "next_word"
                        else _mlp_workload(MLP_WIDTHS[name], cohort, rng))
            _measure(name, workload, args.repeat)
    _measure_rounds(args.run_cohorts, max(1, args.repeat // 2))


if __name__ == "__main__":
    main()
