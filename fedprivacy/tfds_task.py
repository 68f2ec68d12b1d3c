"""A TensorFlow Datasets dataset as a federated classification task: ``data.source: tfds``.

:func:`load_tfds_task` reads the dataset of ``data.tfds`` from its local ``data_dir`` (never downloading;
:mod:`fedprivacy.data.tfds_source`) into a :class:`TFDSClassificationTask`, which implements
:class:`~fedprivacy.task.Task`; :func:`tfds_task` is the same from Python, with keyword arguments.

* Federated partition: one client per distinct value of ``client_feature`` in ``train_split`` (one user =
  one client, the unit user-level DP protects: McMahan et al. 2018, arXiv:1710.06963, §2). Client ``i`` holds
  the records of the ``i``-th smallest id, in the split's record order; ``data.max_clients``,
  ``data.client_sample`` and ``data.max_examples_per_client`` select and cap as for StackOverflow.
* Model: softmax regression on the flattened inputs (``hidden: 0``) or an MLP with one hidden ReLU layer;
  loss: mean cross-entropy; evaluation: example-weighted test loss and accuracy on ``test_split`` (first
  ``data.max_test_examples`` records).
* Public pool: ``public_split``, whose records must be disjoint from ``train_split``'s (checked on the record
  files TFDS resolves each split expression to). It feeds AdaDPS's ``rmsprop`` side information
  (:func:`~fedprivacy.fl.side_information.build_side_information` through :meth:`public_examples`; Li et al.
  2022, arXiv:2202.05963v2, Alg. 3) and centralized pre-training (:meth:`public_dataset` for
  :func:`fedprivacy.centralized.train_centralized`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedprivacy.client.trainer import evaluate
from fedprivacy.config import DataConfig, TFDSConfig, validate_tree
from fedprivacy.data.sources import file_identity
from fedprivacy.data.tfds_source import TFDSError, check_features, open_dataset, read_split, split_records
from fedprivacy.data.views import Partition, sample_clients

log = logging.getLogger(__name__)

__all__ = ["TFDSClassificationTask", "load_tfds_task", "tfds_task", "tfds_provenance", "group_by_client"]


def group_by_client(ids: np.ndarray) -> tuple[np.ndarray, Partition, np.ndarray]:
    """Records grouped by user id: ``(order, partition, distinct ids)`` with ``records[order]`` holding client
    ``i``'s records at rows ``partition.starts[i]:partition.stops[i]``, client ``i`` being the ``i``-th smallest
    id, its records in their original order (a stable sort)."""
    distinct, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    stops = np.cumsum(np.bincount(inverse, minlength=len(distinct))).astype(np.int64)
    return order, Partition(np.r_[0, stops[:-1]].astype(np.int64), stops), distinct


class DenseClassifier(nn.Sequential):
    """Softmax regression or a one-hidden-layer MLP; inputs are moved to the model's device first."""

    def __init__(self, dim: int, classes: int, hidden: int) -> None:
        layers = [nn.Linear(dim, classes)] if hidden == 0 else [nn.Linear(dim, hidden), nn.ReLU(),
                                                                 nn.Linear(hidden, classes)]
        super().__init__(*layers)

    def forward(self, x: Any) -> torch.Tensor:
        return super().forward(torch.as_tensor(x, device=self[0].weight.device))


@dataclass(frozen=True)
class TFDSClassificationTask:
    """The task of ``data.source: tfds`` (module docstring): a :class:`~fedprivacy.task.Task`.

    Attributes:
        inputs, labels: the train split's records grouped by client (float32 ``(n, d)``, int64 ``(n,)``).
        partition: client ``i`` owns rows ``starts[i]:stops[i]``.
        client_ids: the user id of each client.
        test_inputs, test_labels: the evaluation records.
        num_classes, hidden: the model's classes and hidden width (0: softmax regression).
        public_inputs, public_labels: the public pool, or None.
        public_split: the split expression of the public pool (provenance), or None.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    partition: Partition
    client_ids: np.ndarray
    test_inputs: torch.Tensor
    test_labels: np.ndarray
    num_classes: int
    hidden: int = 0
    public_inputs: torch.Tensor | None = None
    public_labels: torch.Tensor | None = None
    public_split: str | None = None

    @property
    def population(self) -> int:
        return self.partition.num_clients

    @property
    def majority_baseline(self) -> float:
        """Test accuracy of always predicting the most frequent training label."""
        counts = np.bincount(self.labels.numpy()[self.partition.rows()], minlength=self.num_classes)
        return float(np.mean(self.test_labels == counts.argmax()))

    def new_model(self, device: str = "cpu") -> DenseClassifier:
        return DenseClassifier(self.inputs.shape[1], self.num_classes, self.hidden).to(device)

    def client_data(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``index``'s inputs and labels (views of the grouped arrays)."""
        rows = slice(int(self.partition.starts[index]), int(self.partition.stops[index]))
        return self.inputs[rows], self.labels[rows]

    @staticmethod
    def loss(logits: torch.Tensor, labels: Any) -> torch.Tensor:
        """Mean softmax cross-entropy over the batch."""
        return nn.functional.cross_entropy(logits, torch.as_tensor(labels, dtype=torch.long, device=logits.device))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Example-weighted test loss and accuracy."""
        with torch.no_grad():
            return evaluate(model, self.test_inputs, self.test_labels)

    def public_examples(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The public pool's inputs and labels (AdaDPS side information), or None."""
        return None if self.public_inputs is None else (self.public_inputs, self.public_labels)

    def public_dataset(self) -> TensorDataset:
        """The public pool as ``(input, label)`` records, for centralized pre-training.

        Raises:
            ValueError: there is no public pool (``data.tfds.public_split`` unset).
        """
        if self.public_inputs is None:
            raise ValueError("no public pool: set data.tfds.public_split")
        return TensorDataset(self.public_inputs, self.public_labels)


def _check_disjoint(builder: Any, t: TFDSConfig) -> None:
    """The public split reads no record the train split reads (a shared record would make A depend on it)."""
    train = split_records(builder, t.train_split, "data.tfds.train_split")
    public = split_records(builder, t.public_split, "data.tfds.public_split")
    for name, rows in public.items():
        shared = rows & train.get(name, set())
        if shared:
            raise TFDSError(f"data.tfds.public_split {t.public_split!r} shares {len(shared)} record(s) of {name} with "
                            f"data.tfds.train_split {t.train_split!r}: the public pool must hold no training record")


def _select(cfg: DataConfig, partition: Partition) -> np.ndarray:
    """The clients kept: the first ``max_clients``, then a seeded ``client_sample`` of those."""
    kept = np.arange(min(partition.num_clients, cfg.max_clients or partition.num_clients))
    if cfg.client_sample is not None:
        kept = kept[sample_clients(len(kept), cfg.client_sample, cfg.client_sample_seed)]
    return kept


@functools.lru_cache(maxsize=2)
def load_tfds_task(cfg: DataConfig) -> TFDSClassificationTask:
    """The task of ``data.source: tfds`` (module docstring), read once per process and config.

    Raises:
        TFDSError: the dataset, a split or a feature is missing or unsupported, or a record lies
            (a label out of range, a non-finite input); the message names which.
    """
    t = cfg.tfds
    builder = open_dataset(t.name, t.data_dir)
    dim, classes = check_features(builder, t.inputs, t.label, t.client_feature, t.num_classes)
    read = functools.partial(read_split, builder, inputs=t.inputs, label=t.label, num_classes=classes,
                             input_scale=t.input_scale)
    if t.public_split is not None:
        _check_disjoint(builder, t)
    train = read(t.train_split, "data.tfds.train_split", client_feature=t.client_feature)
    order, grouped, ids = group_by_client(train.clients)
    kept = _select(cfg, grouped)
    partition = Partition(grouped.starts[kept], grouped.stops[kept]).capped(cfg.max_examples_per_client)
    test = read(t.test_split, "data.tfds.test_split")
    rows = slice(0, cfg.max_test_examples)
    public = read(t.public_split, "data.tfds.public_split") if t.public_split is not None else None
    log.info("TFDS %s: %d clients (of %d user ids), %d train records, input dimension %d, %d classes",
             builder.info.full_name, partition.num_clients, len(ids), int(partition.sizes.sum()), dim, classes)
    return TFDSClassificationTask(
        inputs=torch.from_numpy(train.inputs[order]), labels=torch.from_numpy(train.labels[order]),
        partition=partition, client_ids=ids[kept], test_inputs=torch.from_numpy(test.inputs[rows]),
        test_labels=test.labels[rows], num_classes=classes, hidden=t.hidden,
        public_inputs=None if public is None else torch.from_numpy(public.inputs),
        public_labels=None if public is None else torch.from_numpy(public.labels), public_split=t.public_split)


def tfds_task(name: str, data_dir: str | Path, *, client_feature: str, inputs: list[str], label: str,
              **options: Any) -> TFDSClassificationTask:
    """:func:`load_tfds_task` from Python: ``options`` are the other fields of ``data.tfds`` (``train_split``,
    ``test_split``, ``public_split``, ``num_classes``, ``input_scale``, ``hidden``) and of ``data``
    (``max_clients``, ``client_sample``, ``max_examples_per_client``, ``max_test_examples``, ...).

    Raises:
        ConfigError: an argument is invalid (naming it as its config field).
        TFDSError: as :func:`load_tfds_task`.
    """
    tfds_fields = set(TFDSConfig.model_fields)
    section = {"name": name, "data_dir": str(data_dir), "client_feature": client_feature, "inputs": inputs,
               "label": label, **{k: v for k, v in options.items() if k in tfds_fields}}
    data = {"source": "tfds", "tfds": section, **{k: v for k, v in options.items() if k not in tfds_fields}}
    return load_tfds_task(validate_tree(DataConfig, data, source="tfds_task()"))


def tfds_provenance(cfg: DataConfig) -> dict[str, Any]:
    """Where a ``data.source: tfds`` run's data came from, for ``summary.json``: the dataset's full name
    (name/config/version), its folder, the splits and the identity of its ``dataset_info.json``."""
    t = cfg.tfds
    builder = open_dataset(t.name, t.data_dir)
    info = Path(builder.data_dir) / "dataset_info.json"
    return {"source": "tfds", "dataset": builder.info.full_name, "path": str(Path(builder.data_dir).resolve()),
            "file_format": builder.info.file_format.value,
            "splits": {"train": t.train_split, "test": t.test_split, "public": t.public_split},
            "files": {info.name: file_identity(info)}}
