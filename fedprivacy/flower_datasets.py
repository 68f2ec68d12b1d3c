"""Flower Datasets as a fedprivacy task: :class:`FlowerDatasetsTask`, client ``i`` = partition ``i``.

The same object serves a Flower App (``load_data(partition_id, num_partitions)`` in the ClientApp,
``population`` and ``evaluate`` in a ServerApp running :class:`~fedprivacy.fl.strategy.DPFedAvg`) and fedprivacy's
own apps (``data.task: my_module:factory`` returning it; :class:`~fedprivacy.task.Task`). Which partitioners give
user-level DP, and how that is checked: :mod:`fedprivacy.data.flower_datasets`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import numpy as np
import torch
from flwr_datasets.partitioner import Partitioner
from torch import nn

from fedprivacy.client.trainer import evaluate
from fedprivacy.data.flower_datasets import (Source, arrays, as_dataset, check_columns, check_user_level, class_ids,
                                             partitioner_name, user_column_of)


class FlowerDatasetsTask:
    """Classification over the partitions of a Flower Datasets ``partitioner``: client ``i`` holds partition
    ``i``'s records, its features flattened and concatenated in ``features`` order (float32 ``(n, d)``; a model
    wanting images reshapes, e.g. ``nn.Unflatten``) and its integer ``label`` column (int64).

    ``partitioner``: any ``flwr_datasets.partitioner.Partitioner``; its records are ``dataset`` (a Hugging Face
    ``Dataset`` or a local ``.parquet``/``.csv``/``.json``/``.jsonl`` file), or the dataset it already holds
    (``fds.partitioners["train"]`` of a ``FederatedDataset``). ``test``: the server's held-out records, same
    columns. ``model``: builds the model, the same initial weights in every process. ``user_column``: the
    column naming each record's person (default: a ``NaturalIdPartitioner``'s own column), checked on
    construction (:func:`~fedprivacy.data.flower_datasets.check_user_level`: a user split over partitions is
    refused; without a user column, a warning that the DP unit is the partition).

    Loss: softmax cross-entropy, ``-log softmax(model(x))_y`` averaged over the batch (the label must be below
    the model's output width). Column errors are raised on construction; a partition's records are read,
    checked (missing values, ragged lists, NaN) and kept on its first use.
    """

    def __init__(self, partitioner: Partitioner, *, features: str | Sequence[str], label: str,
                 model: Callable[[], nn.Module], test: Source, dataset: Source | None = None,
                 user_column: str | None = None) -> None:
        self.features = (features,) if isinstance(features, str) else tuple(features)
        if not self.features:
            raise ValueError("features: name at least one feature column")
        self.label = label
        user_column = user_column_of(partitioner, user_column)
        if dataset is not None:
            if partitioner.is_dataset_assigned():
                raise ValueError("dataset: the partitioner already holds a dataset; pass one or the other")
            train, self.source = as_dataset(dataset)
            check_columns(train, self.source, self.features, label, user_column)
            partitioner.dataset = train
        elif partitioner.is_dataset_assigned():
            self.source = "the partitioner's dataset"
            check_columns(partitioner.dataset, self.source, self.features, label, user_column)
        else:
            raise ValueError("dataset: the partitioner holds no dataset; pass dataset= (a datasets.Dataset or a "
                             "local file) or a FederatedDataset's partitioner (fds.partitioners['train'])")
        check_user_level(partitioner, user_column)
        self.partitioner = partitioner
        self.name = partitioner_name(partitioner)
        self._population = partitioner.num_partitions
        test_set, test_name = as_dataset(test)
        check_columns(test_set, f"test ({test_name})", self.features, label)
        x_test, self._test_labels = arrays(test_set, f"test ({test_name})", self.features, label)
        self._test_features = torch.from_numpy(x_test)
        self._model = model
        self._clients: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def population(self) -> int:
        """The number of partitions: the clients ``DPFedAvg(population=...)`` samples over and accounts for."""
        return self._population

    @cached_property
    def majority_baseline(self) -> float:
        """Test accuracy of always predicting the most frequent training label."""
        majority = np.bincount(class_ids(self.partitioner.dataset, self.source, self.label)).argmax()
        return float(np.mean(self._test_labels == majority))

    def new_model(self, device: str = "cpu") -> nn.Module:
        return self._model().to(device)

    def client_data(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Partition ``index``'s ``(features, labels)`` (read and checked once, then kept): as many feature values
        per record as the test records."""
        if not 0 <= index < self._population:
            raise ValueError(f"partition {index} of {self.name}: there are {self._population} (0..{self._population - 1})")
        if index not in self._clients:
            name = f"partition {index} of {self.name}"
            x, y = arrays(self.partitioner.load_partition(index), name, self.features, self.label)
            if x.shape[1] != self._test_features.shape[1]:
                raise ValueError(f"{name}: {x.shape[1]} feature values per record in columns {self.features}, the "
                                 f"test records have {self._test_features.shape[1]}")
            self._clients[index] = torch.from_numpy(x), torch.from_numpy(y)
        return self._clients[index]

    def load_data(self, partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A Flower ClientApp's ``load_data(context.node_config["partition-id"], ...["num-partitions"])``:
        :meth:`client_data`, once ``num_partitions`` (the SuperNodes) is checked to be the population."""
        if num_partitions != self._population:
            raise ValueError(f"num-partitions is {num_partitions} but {self.name} has {self._population} partitions: "
                             f"DPFedAvg samples over, and accounts for, all of them; run {self._population} SuperNodes "
                             f"(num-supernodes={self._population})")
        return self.client_data(partition_id)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, labels)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``test_loss`` (mean cross-entropy) and ``test_accuracy`` over the test records."""
        device = next(model.parameters()).device
        return evaluate(model, self._test_features.to(device), self._test_labels)
