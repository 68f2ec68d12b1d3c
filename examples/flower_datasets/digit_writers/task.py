"""The data, model and run config of the digit-writers example.

Data: scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes; nothing is downloaded), a
stratified 20 % held out as the server's test set, written once to local Parquet files (``train.parquet``:
columns ``writer``, ``pixels`` (64 floats in [0, 1]), ``digit``; ``test.parquet`` without ``writer``). The
digits carry no writer ids, so this example assigns them, non-IID: writer ``w`` (0..99) writes two digits,
``w mod 10`` and ``(w mod 10 + 1 + floor(w / 10) mod 9) mod 10``, and each training image of digit ``d`` goes to
one of the 20 writers of ``d`` uniformly at random (``seed``). Flower Datasets' ``NaturalIdPartitioner`` then
makes each writer one partition, i.e. one client, as user-level DP needs (fedprivacy.flower_datasets).
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from flwr_datasets.partitioner import NaturalIdPartitioner
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from fedprivacy import FlowerDatasetsTask

WRITERS = 100
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _defaults() -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of this app's pyproject.toml: the run config ``flwr run`` starts from."""
    with _PYPROJECT.open("rb") as f:
        return dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


#: The run config's defaults; ``run.py --run-config`` updates them for an in-process run.
DEFAULTS: dict[str, Any] = _defaults()


def run_config(context) -> dict[str, Any]:
    """The run config: the pyproject defaults, overridden by what the runtime passes (``flwr run -c``)."""
    return {**DEFAULTS, **dict(context.run_config)}


def writers_digits(writer: int) -> tuple[int, int]:
    """The two (distinct) digits writer ``writer`` writes."""
    first = writer % 10
    return first, (first + 1 + writer // 10 % 9) % 10


def write_files(folder: Path, seed: int) -> tuple[Path, Path]:
    """``(train, test)`` Parquet files of ``seed`` in ``folder``, written once (each atomically, so processes
    starting together never read half a file)."""
    train_path, test_path = folder / f"train-seed{seed}.parquet", folder / f"test-seed{seed}.parquet"
    if train_path.is_file() and test_path.is_file():
        return train_path, test_path
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((x / 16.0).astype(np.float32), y, test_size=0.2,
                                                        stratify=y, random_state=seed)
    by_digit = [[w for w in range(WRITERS) if d in writers_digits(w)] for d in range(10)]
    rng = np.random.default_rng(seed)
    writer = np.array([rng.choice(by_digit[d]) for d in y_train])
    folder.mkdir(parents=True, exist_ok=True)
    for path, columns in ((train_path, {"writer": writer, "pixels": x_train, "digit": y_train}),
                          (test_path, {"pixels": x_test, "digit": y_test})):
        table = pa.table({name: pa.array(list(values)) if name == "pixels" else pa.array(values)
                          for name, values in columns.items()})
        part = path.with_suffix(f".{os.getpid()}.tmp")
        pq.write_table(table, part)
        os.replace(part, path)
    return train_path, test_path


def make_model() -> nn.Module:
    """Logistic regression on the 64 pixels, the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Linear(64, 10)


@cache
def load_task(data_dir: str, seed: int) -> FlowerDatasetsTask:
    """The writers as fedprivacy's FlowerDatasetsTask: partition ``i`` = the ``i``-th writer id in sorted order."""
    folder = Path(data_dir) if data_dir else Path(tempfile.gettempdir()) / "fedprivacy-digit-writers"
    train, test = write_files(folder, seed)
    return FlowerDatasetsTask(NaturalIdPartitioner(partition_by="writer"), dataset=train, test=test,
                              features="pixels", label="digit", model=make_model)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, epochs: int, lr: float, batch_size: int,
          seed: tuple[int, ...]) -> None:
    """Plain local SGD on ``loss_fn``, minibatches shuffled by ``seed``."""
    torch.set_num_threads(1)  # a model this small trains fastest on one thread
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([int(s) for s in seed]).generate_state(1)[0]))
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=gen).split(batch_size):
            opt.zero_grad()
            loss_fn(model(x[batch]), y[batch]).backward()
            opt.step()
