"""The StackOverflow tasks: data files, client views, pooled test set, model, loss, metrics.

``data.task`` picks one of three tasks, all implementing :class:`~fedprivacy.task.Task` (``population``,
``new_model``, ``client_data(i)``, ``loss``, ``evaluate``, ``majority_baseline``; optionally
``public``, ``prefetch``), or a user's own task (``package.module:factory``):

* ``tag`` (default): single-label tag prediction as in AdaDPS, softmax cross-entropy, accuracy
  (:class:`TagPredictionTask`);
* ``tag_multilabel``: multi-hot tags as in Reddi et al. (2021), sigmoid binary cross-entropy,
  recall@5 (:class:`MultiLabelTagTask`);
* ``next_word``: TFF's next-word prediction, LSTM, accuracy without pad/OOV/EOS
  (:class:`NextWordTask`).

Views (``data.view``): ``natural``, the population is the training users (sorted TFF client ids,
optionally the first ``data.max_clients``, optionally a seeded ``data.client_sample`` of those);
client ``i`` of the federation is user ``i``; evaluation uses the pooled ``test`` split (users'
posts after 2018-01-01 in TFF's data), example-weighted. ``adadps``: the first ``max_clients``
(default 400) training users, each split by position into train (the client) and test (pooled).
``data.max_examples_per_client`` caps each client's training posts; ``data.public_clients``
loads the first held-out users as a public pool (``task.public``, side information).
Preprocessed splits come from the cache (:mod:`fedprivacy.data.prepared`). ``data.source: synthetic``
generates the training users on demand instead (:mod:`fedprivacy.data.on_demand`; tag tasks, natural view).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from fedprivacy.config import ConfigError, DataConfig
from fedprivacy.data.hdf5 import SPLIT_FILES
from fedprivacy.data.next_word import FederatedTokenData, special_tokens
from fedprivacy.data.on_demand import OnDemandPopulation, OnDemandTags, TagRows, count_files, count_paths
from fedprivacy.data.prepared import prepared_tags, prepared_tokens
from fedprivacy.data.readahead import advise_rows
from fedprivacy.data.sources import ExampleSource, file_identity, open_source
from fedprivacy.data.synthetic import (DEFAULT_MAX_EXAMPLES, SYNTHETIC_MARKER, TFF_MEAN_EXAMPLES, TFF_MIN_EXAMPLES,
                                       generate)
from fedprivacy.data.tag_prediction import FederatedTagData
from fedprivacy.data.views import Partition, natural, split_by_position
from fedprivacy.models.logistic import SparseLogisticRegression
from fedprivacy.models.lstm import NextWordLSTM
from fedprivacy.models.metrics import masked_accuracy_counts, recall_at_k_counts
from fedprivacy.task import Task

log = logging.getLogger(__name__)

SQLITE, WORD_COUNT, TAG_COUNT = "stackoverflow.sqlite", "stackoverflow.word_count", "stackoverflow.tag_count"
ADADPS_CLIENTS = 400
"""AdaDPS's federated StackOverflow subset: 400 users (Li et al. 2022, arXiv:2202.05963v2, §6.2), the first
400 training client ids in the paper's code (github.com/litian96/AdaDPS)."""
EVAL_BATCH = 4096


def on_demand_population(cfg: DataConfig) -> OnDemandPopulation:
    """The population ``data.source: synthetic`` generates on demand (the stored generator's default sizes)."""
    return OnDemandPopulation(num_clients=cfg.synthetic_clients, seed=cfg.synthetic_seed,
                              min_examples=TFF_MIN_EXAMPLES, mean_examples=TFF_MEAN_EXAMPLES,
                              max_examples=DEFAULT_MAX_EXAMPLES)


def data_files(cfg: DataConfig) -> tuple[Path, ...]:
    """The TFF files ``cfg.source`` needs in ``cfg.path``: example file(s), word and tag counts (on demand:
    the two count files only, :func:`~fedprivacy.data.on_demand.count_paths`)."""
    if cfg.source == "synthetic":
        return count_paths(on_demand_population(cfg), cfg.path)
    examples = ([cfg.path / SQLITE] if cfg.source == "tff-sqlite"
                else [cfg.path / name for name in SPLIT_FILES.values()])
    return (*examples, cfg.path / WORD_COUNT, cfg.path / TAG_COUNT)


def word_count_file(cfg: DataConfig) -> Path:
    """The ``stackoverflow.word_count`` the tasks read (on demand: the counted users', :func:`data_files`)."""
    return count_paths(on_demand_population(cfg), cfg.path)[0] if cfg.source == "synthetic" else cfg.path / WORD_COUNT


def may_generate(cfg: DataConfig) -> bool:
    """Whether missing data may be generated into ``cfg.path``: asked for, or the default synthetic folder."""
    if cfg.generate_if_missing is not None:
        return cfg.generate_if_missing
    return cfg.path == DataConfig.model_fields["path"].default


def ensure_data(cfg: DataConfig) -> None:
    """Generate the synthetic data set if it is missing and allowed (:func:`may_generate`); otherwise
    name what is missing. A user's task brings its own data; a TFDS dataset is checked when it is read
    (:mod:`fedprivacy.tfds_task`: never generated, never downloaded)."""
    if is_user_task(cfg) or cfg.source == "tfds":
        return
    if cfg.source == "synthetic":
        count_files(on_demand_population(cfg), cfg.path)  # written once, then reused
        return
    files = data_files(cfg)
    missing = [p for p in files if not p.exists()]
    if not missing:
        return
    if len(missing) < len(files) or not may_generate(cfg):
        raise FileNotFoundError(
            "data file(s) not found: " + ", ".join(str(p) for p in missing)
            + (" (the folder is partly filled; remove it or supply the missing files)" if len(missing) < len(files)
               else " (check data.path, or set data.generate_if_missing=true to generate synthetic data there)"))
    log.info("generating synthetic StackOverflow data (%d users, seed %d) in %s",
             cfg.synthetic_clients, cfg.synthetic_seed, cfg.path)
    generate(cfg.path, num_clients=cfg.synthetic_clients, seed=cfg.synthetic_seed, format=cfg.source)


def data_provenance(cfg: DataConfig) -> dict[str, Any]:
    """Where a run's data came from, for ``summary.json``: the source format, the folder, whether the
    files are synthetic (with the generator's arguments, from :data:`SYNTHETIC_MARKER`) and each data
    file's identity (:func:`~fedprivacy.data.sources.file_identity`: size, mtime, SHA-256 of its ends);
    a TFDS dataset's: :func:`~fedprivacy.tfds_task.tfds_provenance`."""
    if cfg.source == "tfds":
        from fedprivacy.tfds_task import tfds_provenance  # tensorflow-datasets, on demand

        return tfds_provenance(cfg)
    if is_user_task(cfg):
        return {"source": "user task", "task": cfg.task}
    if cfg.source == "synthetic":
        return {"source": "synthetic on demand", "path": str(cfg.path.resolve()), "synthetic": True,
                "generator": on_demand_population(cfg).describe(),
                "files": {p.name: file_identity(p) for p in data_files(cfg)}}
    marker = cfg.path / SYNTHETIC_MARKER
    generator = json.loads(marker.read_text()) if marker.is_file() else None
    return {"source": cfg.source, "path": str(cfg.path.resolve()), "synthetic": generator is not None,
            "generator": generator, "files": {p.name: file_identity(p) for p in data_files(cfg)}}


def cache_root(cfg: DataConfig) -> Path | None:
    """The folder of ``cfg``'s preprocessing cache (``data.cache_dir``, else ``<data.path>/.fedprivacy-cache``),
    or None when ``data.cache`` is off."""
    if not cfg.cache:
        return None
    return cfg.cache_dir if cfg.cache_dir is not None else cfg.path / ".fedprivacy-cache"


def _split_views(cfg: DataConfig, prepare) -> tuple[object, Partition, object, slice | np.ndarray, object]:
    """Loads (through the cache) the training users, the evaluation rows and the public pool.

    ``prepare(source, split, first=, sample=, seed=, cache_root=)`` is :func:`prepared_tags` or
    :func:`prepared_tokens` with the task options bound. Returns ``(train data, train partition,
    test data, test rows, public data or None)``; test rows are a slice (natural view) or row
    indices into the test data (adadps view, where the test data is the training users' data).
    """
    source: ExampleSource = open_source(cfg.source, cfg.path)
    root = cache_root(cfg)
    first = ADADPS_CLIENTS if cfg.view == "adadps" and cfg.max_clients is None else cfg.max_clients
    train, status = prepare(source, "train", first=first, sample=cfg.client_sample,
                            seed=cfg.client_sample_seed, cache_root=root)
    log.info("train split: %d users, %d posts (cache: %s)", train.num_clients, train.offsets[-1], status)
    if cfg.view == "adadps":
        partition, held = split_by_position(train.offsets, cfg.train_fraction)
        test, rows = train, held.rows()[:cfg.max_test_examples]
    else:
        partition = natural(train.offsets)
        test, status = prepare(source, "test", cache_root=root)
        log.info("test split: %d users, %d posts (cache: %s)", test.num_clients, test.offsets[-1], status)
        rows = slice(0, cfg.max_test_examples)
    public = None
    if cfg.public_clients:
        public, _ = prepare(source, "heldout", first=cfg.public_clients, cache_root=root)
    return train, partition.capped(cfg.max_examples_per_client), test, rows, public


def _take(values, rows: slice | np.ndarray):
    """Rows of an array or CSR matrix as a private, writable copy (:func:`_csr_rows` cuts a CSR row range)."""
    if isinstance(values, sp.csr_matrix) and isinstance(rows, slice) and rows.step in (None, 1):
        view = _csr_rows(values, rows)
        return sp.csr_matrix((view.data.copy(), view.indices.copy(), view.indptr), shape=view.shape, copy=False)
    taken = values[rows]
    return taken.copy() if isinstance(taken, (np.ndarray, sp.csr_matrix)) else taken


def _csr_rows(values: sp.csr_matrix, rows: slice) -> sp.csr_matrix:
    """A contiguous row range of a CSR matrix WITHOUT copying its entries: READ-ONLY views of the
    parent's ``data`` and ``indices`` (shared by every client; memory-mapped ones are read-only anyway)
    and a rebased ``indptr``. SciPy's row slicing copies twice; a client's rows are read, never written."""
    start, stop, _ = rows.indices(values.shape[0])
    stop = max(start, stop)
    lo, hi = int(values.indptr[start]), int(values.indptr[stop])
    data, indices = values.data[lo:hi], values.indices[lo:hi]
    data.flags.writeable = indices.flags.writeable = False
    return sp.csr_matrix((data, indices, values.indptr[start:stop + 1] - lo), shape=(stop - start, values.shape[1]),
                         copy=False)


@dataclass(frozen=True)
class _BagOfWordsTask:
    """What both tag tasks share: the data, the partition, and the logistic-regression model.

    Attributes:
        train: Preprocessed posts of the selected training users (possibly memory-mapped); for
            ``data.source: synthetic`` the on-demand users (:class:`_OnDemandUsers`).
        partition: Rows of ``train`` owned by each client (None on demand).
        test_features, test_labels: The pooled evaluation set (labels: ids, or multi-hot CSR).
        public: The public pool (held-out users), or None.
    """

    public_split = "heldout"
    """The split of the public pool (side information's provenance)."""
    train: FederatedTagData
    partition: Partition
    test_features: sp.csr_matrix
    test_labels: np.ndarray | sp.csr_matrix
    public: FederatedTagData | None = None

    @property
    def population(self) -> int:
        return self.partition.num_clients

    def new_model(self, device: str = "cpu") -> SparseLogisticRegression:
        return SparseLogisticRegression(self.train.vocab_size, self.train.num_tags).to(device)

    def _client_rows(self, index: int) -> slice:
        return slice(self.partition.starts[index], self.partition.stops[index])

    def prefetch(self, clients: list[int]) -> None:
        """Start reading these clients' posts from the memory-mapped cache (:mod:`.data.readahead`)."""
        f = self.train.features
        for c in clients:
            rows = self._client_rows(c)
            lo, hi = int(f.indptr[rows.start]), int(f.indptr[rows.stop])
            advise_rows(f.data, lo, hi)
            advise_rows(f.indices, lo, hi)


@dataclass(frozen=True)
class TagPredictionTask(_BagOfWordsTask):
    """Single-label tag prediction (AdaDPS): softmax regression, cross-entropy, accuracy."""

    closed_form_softmax = True
    """Local SGD takes the sparse model's closed-form softmax path (fedprivacy.client.trainer)."""

    @property
    def majority_baseline(self) -> float:
        """Test accuracy of always predicting the most frequent training label."""
        majority = self._majority_label()
        return float(np.mean(self.test_labels == majority)) if len(self.test_labels) else float("nan")

    def _majority_label(self) -> int:
        labels = self.train.labels[self.partition.rows()]
        return int(np.bincount(labels, minlength=self.train.num_tags).argmax())

    def client_data(self, index: int) -> tuple[sp.csr_matrix, np.ndarray]:
        """The client's posts (read-only CSR views) and labels (a copy)."""
        rows = self._client_rows(index)
        return _csr_rows(self.train.features, rows), _take(self.train.labels, rows)

    def public_examples(self) -> tuple[sp.csr_matrix, np.ndarray] | None:
        """The public pool's posts and labels (held-out users), or None."""
        return None if self.public is None else (self.public.features, self.public.labels)

    @staticmethod
    def loss(logits: torch.Tensor, labels: np.ndarray) -> torch.Tensor:
        """Mean softmax cross-entropy over the batch."""
        y = torch.as_tensor(labels, dtype=torch.long).to(logits.device, non_blocking=True)  # no wait for the device
        return nn.functional.cross_entropy(logits, y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Example-weighted test loss and accuracy."""
        from fedprivacy.client.trainer import evaluate

        return evaluate(model, self.test_features, self.test_labels)


@dataclass(frozen=True)
class MultiLabelTagTask(_BagOfWordsTask):
    """Multi-label tag prediction (Reddi et al. 2021, App. C; TFF ``tag_prediction_tasks``).

    The same logistic-regression model, with an independent sigmoid per tag:
    ``loss = mean over the batch and the K tags of BCE(sigmoid(logit_k), t_k)``. TFF's Keras
    loss is the per-post mean over tags summed over the batch (``Reduction.SUM``); the mean here
    is that divided by the batch size, i.e. a rescaled learning rate. Metric: recall@5
    (:func:`~fedprivacy.models.metrics.recall_at_k_counts`). Targets: ``train.tags``; the test
    labels are multi-hot CSR ``(n, num_tags)``.
    """

    closed_form_sigmoid = True
    """Local SGD takes the sparse model's closed-form path with this loss (fedprivacy.models.logit_losses)."""

    @property
    def majority_baseline(self) -> float:
        """Test recall@5 of always predicting the 5 most frequent training tags."""
        top = self._top_tags()
        positives = self.test_labels.sum()
        return float(self.test_labels[:, top].sum() / positives) if positives else float("nan")

    def _top_tags(self) -> np.ndarray:
        counts = np.asarray(self.train.tags[self.partition.rows()].sum(axis=0)).ravel()
        return np.argsort(-counts, kind="stable")[:5]

    def client_data(self, index: int) -> tuple[sp.csr_matrix, sp.csr_matrix]:
        """The client's posts and multi-hot tags (read-only CSR views)."""
        rows = self._client_rows(index)
        return _csr_rows(self.train.features, rows), _csr_rows(self.train.tags, rows)

    def public_examples(self) -> tuple[sp.csr_matrix, sp.csr_matrix] | None:
        """The public pool's posts and multi-hot tags (held-out users), or None."""
        return None if self.public is None else (self.public.features, self.public.tags)

    @staticmethod
    def loss(logits: torch.Tensor, tags: sp.csr_matrix) -> torch.Tensor:
        """Mean binary cross-entropy with logits over the batch and the tags."""
        target = torch.as_tensor(tags.toarray(), dtype=logits.dtype).to(logits.device, non_blocking=True)
        return nn.functional.binary_cross_entropy_with_logits(logits, target)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Test loss (mean BCE per post) and recall@5 over all test posts."""
        model.eval()
        n = self.test_features.shape[0]
        if n == 0:
            return {"test_loss": float("nan"), "test_recall_at_5": float("nan")}
        loss_sum, hits, positives = 0.0, 0, 0
        for lo in range(0, n, EVAL_BATCH):
            logits = model(self.test_features[lo:lo + EVAL_BATCH])
            target = torch.as_tensor(self.test_labels[lo:lo + EVAL_BATCH].toarray(), dtype=logits.dtype,
                                     device=logits.device)
            loss_sum += float(nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="sum"))
            h, p = recall_at_k_counts(logits, target, k=5)
            hits, positives = hits + h, positives + p
        return {"test_loss": loss_sum / (n * self.train.num_tags),
                "test_recall_at_5": hits / positives if positives else float("nan")}


class _OnDemandUsers:
    """The tag tasks with training users generated on demand (``data.source: synthetic``).

    ``train`` is an :class:`~fedprivacy.data.on_demand.OnDemandTags` (client ``i`` is train user ``i``,
    generated when asked for), ``partition`` is None; the evaluation set and the public pool
    are ordinary arrays. The majority baselines read the training counts off the tag count file (tags
    sorted by train examples carrying them): the most frequent label is tag column 0 (a post labelled j
    carries tag j, and every post carrying tag 0 is labelled 0, so label 0 counts at least tag 0's
    examples, which are at least tag j's, which are at least label j's), and the five most frequent tags
    are columns 0..4; with every train user counted (population <= 10,000), training and uncapped (no
    ``data.max_clients``, ``data.max_examples_per_client``), these are the stored data's baselines exactly.
    """

    target = ""
    """The attribute of a client's :class:`~fedprivacy.data.tag_prediction.FederatedTagData` it trains on."""

    @property
    def population(self) -> int:
        return self.train.num_clients

    prefetch = None
    """No read-ahead: a client is generated when the engine asks for it (a background thread measured no gain)."""

    def client_data(self, index: int) -> tuple[sp.csr_matrix, np.ndarray | sp.csr_matrix]:
        """The client's posts and its labels (``tag``) or multi-hot tags (``tag_multilabel``), freshly generated."""
        data = self.train.client(index)
        return data.features, getattr(data, self.target)

    def _majority_label(self) -> int:
        return 0

    def _top_tags(self) -> np.ndarray:
        return np.arange(min(5, self.train.num_tags))


class OnDemandTagPredictionTask(_OnDemandUsers, TagPredictionTask):
    """:class:`TagPredictionTask` over an on-demand population."""

    target = "labels"


class OnDemandMultiLabelTagTask(_OnDemandUsers, MultiLabelTagTask):
    """:class:`MultiLabelTagTask` over an on-demand population."""

    target = "tags"


def on_demand_rows(cfg: DataConfig) -> OnDemandTags:
    """The on-demand training users of ``data.source: synthetic`` (count files written once, then read)."""
    population = on_demand_population(cfg)
    words, tags = count_files(population, cfg.path)
    rows = TagRows(population.seed, words, tags, vocab_size=cfg.vocab_size, num_tags=cfg.num_tags,
                   no_tag=cfg.no_tag)
    num_clients = min(cfg.synthetic_clients, cfg.max_clients or cfg.synthetic_clients)
    return OnDemandTags(population, rows, num_clients=num_clients,
                        max_examples_per_client=cfg.max_examples_per_client)


def _on_demand_task(cfg: DataConfig) -> Task:
    """The tag task over ``data.source: synthetic``: test set = the first ``max_test_examples`` pooled test posts."""
    users = on_demand_rows(cfg)
    test = users.split("test", max_examples=cfg.max_test_examples)
    rows = slice(0, cfg.max_test_examples)
    public = users.split("heldout", first_users=cfg.public_clients) if cfg.public_clients else None
    log.info("on-demand synthetic population: %d train users (seed %d), %d test posts", users.num_clients,
             cfg.synthetic_seed, min(test.offsets[-1], cfg.max_test_examples))
    if cfg.task == "tag_multilabel":
        return OnDemandMultiLabelTagTask(train=users, partition=None, test_features=_take(test.features, rows),
                                         test_labels=_take(test.tags, rows), public=public)
    return OnDemandTagPredictionTask(train=users, partition=None, test_features=_take(test.features, rows),
                                     test_labels=_take(test.labels, rows), public=public)


@dataclass(frozen=True)
class NextWordTask:
    """Next-word prediction (TFF baseline; Reddi et al. 2021): LSTM, masked cross-entropy, accuracy.

    Loss: mean cross-entropy over the positions whose target is not pad. Accuracy
    (``test_accuracy``): TFF's ``accuracy_without_out_of_vocab_or_end_of_sentence``, i.e. argmax
    over all ``V + 4`` classes against targets that are not pad, OOV or EOS;
    ``test_accuracy_with_oov_eos`` masks pad only (TFF's ``accuracy``).

    Attributes:
        train: Token rows of the selected training users.
        partition: Rows of ``train`` owned by each client.
        test_tokens: Pooled evaluation rows ``(n, seq_len + 1)``.
        public: The public pool (held-out users), or None.
    """

    train: FederatedTokenData
    partition: Partition
    test_tokens: np.ndarray
    public: FederatedTokenData | None = None

    @property
    def population(self) -> int:
        return self.partition.num_clients

    @property
    def test_features(self) -> np.ndarray:
        return self.test_tokens[:, :-1]

    @property
    def test_labels(self) -> np.ndarray:
        return self.test_tokens[:, 1:]

    @property
    def _masked(self) -> tuple[int, ...]:
        special = special_tokens(self.train.vocab_size)
        return special.pad, special.oov, special.eos

    @property
    def majority_baseline(self) -> float:
        """Test accuracy of always predicting the most frequent counted training target."""
        targets = self.train.tokens[self.partition.rows(), 1:].ravel()
        special = special_tokens(self.train.vocab_size)
        counts = np.bincount(targets, minlength=special.num_classes)
        counts[list(self._masked)] = 0
        test = np.asarray(self.test_labels)
        counted = ~np.isin(test, self._masked)
        correct = counted & (test == counts.argmax())
        return float(correct.sum() / counted.sum()) if counted.any() else float("nan")

    def new_model(self, device: str = "cpu") -> NextWordLSTM:
        return NextWordLSTM(special_tokens(self.train.vocab_size).num_classes).to(device)

    def prefetch(self, clients: list[int]) -> None:
        """Start reading these clients' token rows from the memory-mapped cache (:mod:`.data.readahead`)."""
        for c in clients:
            advise_rows(self.train.tokens, int(self.partition.starts[c]), int(self.partition.stops[c]))

    def client_data(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.array(self.train.tokens[self.partition.starts[index]:self.partition.stops[index]], dtype=np.int64)
        return rows[:, :-1], rows[:, 1:]

    @staticmethod
    def loss(logits: torch.Tensor, targets: np.ndarray) -> torch.Tensor:
        """Mean cross-entropy over non-pad target positions."""
        y = torch.as_tensor(np.asarray(targets, dtype=np.int64)).to(logits.device, non_blocking=True)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=0)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 256) -> dict[str, float]:
        """Test loss (per non-pad target) and TFF's two accuracies."""
        model.eval()
        loss_sum, tokens, correct, counted, correct_all, counted_all = 0.0, 0, 0, 0, 0, 0
        for lo in range(0, len(self.test_tokens), batch_size):
            x = np.asarray(self.test_features[lo:lo + batch_size], dtype=np.int64)
            y = torch.as_tensor(np.asarray(self.test_labels[lo:lo + batch_size], dtype=np.int64))
            logits = model(x).cpu()
            loss_sum += float(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=0,
                                                          reduction="sum"))
            tokens += int((y != 0).sum())
            c, k = masked_accuracy_counts(logits, y, self._masked)
            correct, counted = correct + c, counted + k
            c, k = masked_accuracy_counts(logits, y, (0,))
            correct_all, counted_all = correct_all + c, counted_all + k
        nan = float("nan")
        return {"test_loss": loss_sum / tokens if tokens else nan,
                "test_accuracy": correct / counted if counted else nan,
                "test_accuracy_with_oov_eos": correct_all / counted_all if counted_all else nan}


BUILTIN_TASKS = ("tag", "tag_multilabel", "next_word")


def is_user_task(cfg: DataConfig) -> bool:
    """Whether ``data.task`` names a user's task (``package.module:factory``), whose data is the user's."""
    return cfg.task not in (*BUILTIN_TASKS, "classification")


def _user_task(cfg: DataConfig) -> Task:
    module_name, _, attr = cfg.task.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"data.task: cannot import {cfg.task!r} ({err})") from None
    task = factory(cfg)
    if not isinstance(task, Task):
        missing = [m for m in ("population", "majority_baseline", "new_model", "client_data", "loss", "evaluate")
                   if not hasattr(task, m)]
        raise ConfigError(f"data.task: {cfg.task!r} returned a {type(task).__name__} without {', '.join(missing)} "
                          "(see fedprivacy.task.Task)")
    return task


@functools.lru_cache(maxsize=2)
def load_task(cfg: DataConfig) -> Task:
    """Load (once per process and config) the task ``cfg.task``: client views, evaluation set, public pool."""
    if cfg.source == "tfds":
        from fedprivacy.tfds_task import load_tfds_task  # tensorflow-datasets, on demand

        return load_tfds_task(cfg)
    if is_user_task(cfg):
        return _user_task(cfg)
    if cfg.source == "synthetic":
        return _on_demand_task(cfg)
    if cfg.task == "next_word":
        def prepare_tokens(source, split, **kw):
            return prepared_tokens(source, split, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, **kw)

        train, partition, test, rows, public = _split_views(cfg, prepare_tokens)
        return NextWordTask(train=train, partition=partition, test_tokens=_take(test.tokens, rows), public=public)

    def prepare_tags(source, split, **kw):
        return prepared_tags(source, split, vocab_size=cfg.vocab_size, num_tags=cfg.num_tags, no_tag=cfg.no_tag, **kw)

    train, partition, test, rows, public = _split_views(cfg, prepare_tags)
    if train.num_dropped:
        log.info("dropped %d training posts without a tag in the top %d (data.no_tag=drop)", train.num_dropped,
                 cfg.num_tags)
    features = _take(test.features, rows)
    if cfg.task == "tag_multilabel":
        return MultiLabelTagTask(train=train, partition=partition, test_features=features,
                                 test_labels=_take(test.tags, rows), public=public)
    return TagPredictionTask(train=train, partition=partition, test_features=features,
                             test_labels=_take(test.labels, rows), public=public)
