"""The StackOverflow tag-prediction task: data files, per-user train clients, pooled test set, model.

The population is the training users (sorted TFF client ids, optionally the first
``data.max_clients``); client ``i`` of the federation is training user ``i``. Evaluation uses
the pooled ``test`` split (users' posts after 2018-01-01 in TFF's data), example-weighted.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from fedprivacy.config import DataConfig
from fedprivacy.data.synthetic import generate
from fedprivacy.data.tag_prediction import FederatedTagData, load_tag_prediction
from fedprivacy.models.logistic import SparseLogisticRegression

log = logging.getLogger(__name__)

SQLITE, WORD_COUNT, TAG_COUNT = "stackoverflow.sqlite", "stackoverflow.word_count", "stackoverflow.tag_count"


def data_files(cfg: DataConfig) -> tuple[Path, Path, Path]:
    """The three TFF files in ``cfg.path``."""
    return cfg.path / SQLITE, cfg.path / WORD_COUNT, cfg.path / TAG_COUNT


def ensure_data(cfg: DataConfig) -> None:
    """Generate the synthetic data set if it is missing and allowed; otherwise name what is missing."""
    missing = [p for p in data_files(cfg) if not p.exists()]
    if not missing:
        return
    if len(missing) < 3 or not cfg.generate_if_missing:
        raise FileNotFoundError(
            "data file(s) not found: " + ", ".join(str(p) for p in missing)
            + (" (set data.generate_if_missing=true to generate synthetic data)" if not cfg.generate_if_missing else
               " (the folder is partly filled; remove it or supply the missing files)")
        )
    log.info("generating synthetic StackOverflow data (%d users, seed %d) in %s",
             cfg.synthetic_clients, cfg.synthetic_seed, cfg.path)
    generate(cfg.path, num_clients=cfg.synthetic_clients, seed=cfg.synthetic_seed)


@dataclass(frozen=True)
class TagPredictionTask:
    """Loaded data for one run (shared by the server and every in-process client)."""

    train: FederatedTagData
    test_features: sp.csr_matrix
    test_labels: np.ndarray

    @property
    def population(self) -> int:
        return self.train.num_clients

    @property
    def majority_baseline(self) -> float:
        """Test accuracy of always predicting the most frequent training label."""
        majority = np.bincount(self.train.labels, minlength=self.train.num_tags).argmax()
        return float(np.mean(self.test_labels == majority)) if len(self.test_labels) else float("nan")

    def new_model(self, device: str = "cpu") -> SparseLogisticRegression:
        return SparseLogisticRegression(self.train.vocab_size, self.train.num_tags).to(device)

    def client_data(self, index: int) -> tuple[sp.csr_matrix, np.ndarray]:
        return self.train.client(index)


@functools.lru_cache(maxsize=2)
def load_task(cfg: DataConfig) -> TagPredictionTask:
    """Load (once per process and config) the train clients and the pooled test set."""
    sqlite, word_count, tag_count = data_files(cfg)
    opts = dict(vocab_size=cfg.vocab_size, num_tags=cfg.num_tags, no_tag=cfg.no_tag)
    train = load_tag_prediction(sqlite, word_count, tag_count, "train", max_clients=cfg.max_clients, **opts)
    test = load_tag_prediction(sqlite, word_count, tag_count, "test", **opts)
    n_test = test.features.shape[0] if cfg.max_test_examples is None else min(cfg.max_test_examples, test.features.shape[0])
    return TagPredictionTask(train=train, test_features=test.features[:n_test], test_labels=test.labels[:n_test])
