"""The model, the data and the run config of the digits example.

Data: scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes; UCI's "Optical
Recognition of Handwritten Digits", shipped inside scikit-learn, so nothing is downloaded). A
stratified 20 % is held out as the server's test set; the rest is split over the simulated users
non-IID, as in McMahan et al. (2017): sorted by label, cut into ``2 * users`` shards, two shards
per user, so most users hold only one or two digits. Everything is deterministic given ``seed``.
"""

from __future__ import annotations

import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _defaults() -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of this app's pyproject.toml: the run config ``flwr run`` starts from."""
    try:
        with _PYPROJECT.open("rb") as f:
            return dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])
    except (OSError, KeyError):
        return {}


#: The run config's defaults; ``run.py --run-config`` updates them for an in-process run.
DEFAULTS: dict[str, Any] = _defaults()


def run_config(context) -> dict[str, Any]:
    """The run config: the pyproject defaults, overridden by what the runtime passes (``flwr run -c``)."""
    return {**DEFAULTS, **dict(context.run_config)}


def make_model(hidden: int = 0) -> nn.Module:
    """Logistic regression (``hidden = 0``) or a one-hidden-layer MLP on the 64 pixels."""
    torch.manual_seed(0)  # the same initial weights in every process
    if hidden <= 0:
        return nn.Linear(64, 10)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@cache
def _split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)


def test_set(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out test images and labels (the server's, never a user's)."""
    _, x_test, _, y_test = _split(seed)
    return torch.from_numpy(x_test), torch.from_numpy(y_test)


def majority_baseline(seed: int = 0) -> float:
    """Test accuracy of always predicting the most frequent training label."""
    _, _, y_train, y_test = _split(seed)
    return float(np.mean(y_test == np.bincount(y_train).argmax()))


@cache
def _shards(num_users: int, seed: int) -> list[np.ndarray]:
    _, _, y_train, _ = _split(seed)
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(y_train)), y_train))  # by label, random within a label
    shards = np.array_split(order, 2 * num_users)
    perm = rng.permutation(2 * num_users)
    return [np.concatenate([shards[perm[2 * u]], shards[perm[2 * u + 1]]]) for u in range(num_users)]


def load_user(partition_id: int, num_users: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """User ``partition_id``'s training images and labels (two label-sorted shards)."""
    x_train, _, y_train, _ = _split(seed)
    idx = _shards(num_users, seed)[partition_id]
    return torch.from_numpy(x_train[idx]), torch.from_numpy(y_train[idx])


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, batch_size: int,
          seed: tuple[int, ...]) -> float:
    """Plain local SGD, minibatches shuffled by ``seed``; returns the last epoch's mean loss."""
    torch.set_num_threads(1)  # a model this small trains fastest on one thread (more only add contention)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([int(s) for s in seed]).generate_state(1)[0]))
    loss_sum = 0.0
    for _ in range(epochs):
        loss_sum = 0.0
        for batch in torch.randperm(len(y), generator=gen).split(batch_size):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(batch)
    return loss_sum / max(len(y), 1)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Loss and accuracy on ``(x, y)``."""
    logits = model(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())
