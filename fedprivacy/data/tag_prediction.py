"""StackOverflow tag prediction, preprocessed as in AdaDPS (after TFF).

Per post (TFF's ``tag_prediction_preprocessing``, used by the AdaDPS code):

* words = ``tokens + ' ' + title``, split on ASCII whitespace (on bytes, as
  ``tf.strings.split`` does);
* the vocabulary is the ``vocab_size`` most frequent words of the word count
  file (column j = the j-th most frequent word);
* x = the mean of the one-hot vectors of ALL the words, out-of-vocabulary ones
  included in the denominator, with the OOV column dropped; so x lies in
  [0, 1]^vocab_size and sums to (#in-vocabulary words / #words) <= 1 (a post
  with no words at all gets an all-zero row, where TensorFlow would give NaN);
* the tag vocabulary is the ``num_tags`` most frequent tags of the tag count
  file; the label is the argmax of the post's multi-hot tag vector, i.e. the
  lowest-index (most frequent) in-vocabulary tag of the post (repeated tags
  count once).

A post with no in-vocabulary tag has an all-zero multi-hot vector, whose argmax
is 0: ``no_tag="label0"`` keeps that quirk of the AdaDPS code, ``no_tag="drop"``
drops such posts instead (and counts them in ``num_dropped``).

The multi-hot vector itself is kept too (``tags``, a CSR matrix): it is the target
of the multi-label task of Reddi et al. (2021, arXiv:2003.00295, App. C; TFF's
``tag_prediction_tasks``: sigmoid outputs, binary cross-entropy, recall@5). There
``no_tag="label0"`` keeps the post with its all-zero target, as TFF does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from scipy import sparse

from fedprivacy.data.sources import ExampleSource, offsets_partition, open_source
from fedprivacy.data.stackoverflow import DataFormatError, read_tag_counts, read_word_counts

__all__ = ["FederatedTagData", "load_tag_prediction", "assemble"]

NoTag = Literal["label0", "drop"]

_FEATURES = ("tokens", "title", "tags")
"""The features a post's row is made of (the others are read and checked, not converted)."""


@dataclass(frozen=True)
class FederatedTagData:
    """Preprocessed tag-prediction examples of a population of clients.

    Attributes:
        features: float32 CSR matrix, shape ``(num_examples, vocab_size)``:
            normalized bags of words.
        labels: int64 array, shape ``(num_examples,)``, values in
            ``[0, num_tags)``.
        tags: float32 CSR matrix, shape ``(num_examples, num_tags)``: the
            multi-hot vectors (1 for each in-vocabulary tag of the post).
        offsets: int64 array, shape ``(num_clients + 1,)``: client ``i`` owns
            rows ``offsets[i]:offsets[i + 1]`` (possibly none).
        client_ids: The clients, in row order (sorted).
        vocab_size: Number of feature columns.
        num_tags: Number of classes.
        num_dropped: Posts dropped because no tag was in the vocabulary
            (``no_tag="drop"``); 0 otherwise.
    """

    features: sparse.csr_matrix
    labels: np.ndarray
    tags: sparse.csr_matrix
    offsets: np.ndarray
    client_ids: tuple[str, ...]
    vocab_size: int
    num_tags: int
    num_dropped: int = 0

    def __post_init__(self) -> None:
        n = self.features.shape[0]
        if (self.features.shape[1] != self.vocab_size or self.labels.shape != (n,)
                or self.tags.shape != (n, self.num_tags)
                or not offsets_partition(self.offsets, n, len(self.client_ids))):
            raise ValueError("inconsistent FederatedTagData shapes or offsets")

    @property
    def num_clients(self) -> int:
        """Number of clients, including those without examples."""
        return len(self.client_ids)

    def client(self, i: int) -> tuple[sparse.csr_matrix, np.ndarray]:
        """Features and labels of the ``i``-th client."""
        start, stop = self.offsets[i], self.offsets[i + 1]
        return self.features[start:stop], self.labels[start:stop]


@dataclass
class _ClientRows:
    """CSR pieces of one client: per-row nonzero counts, columns, values, labels, tag sets."""

    row_nnz: np.ndarray
    columns: np.ndarray
    values: np.ndarray
    labels: np.ndarray
    tag_nnz: np.ndarray
    tag_columns: np.ndarray
    dropped: int


def _feature(example: Mapping[str, list], name: str, where: str) -> bytes:
    """The single bytes value of a feature, or DataFormatError."""
    value = example.get(name)
    if not value or not isinstance(value[0], bytes):
        raise DataFormatError(f"{where}: missing or non-bytes feature {name!r}")
    return value[0]


def _client_rows(examples: Sequence[Mapping[str, list]], word_index: pd.Index,
                 tag_index: Mapping[bytes, int], no_tag: NoTag, where: str) -> _ClientRows:
    """Preprocesses the examples of one client into CSR pieces."""
    words: list[bytes] = []
    lengths: list[int] = []
    labels: list[int] = []
    tag_sets: list[list[int]] = []
    for j, example in enumerate(examples):
        context = f"{where}, example {j}"
        known = sorted({tag_index[t] for t in _feature(example, "tags", context).split(b"|")
                        if t in tag_index})
        if not known and no_tag == "drop":
            continue
        labels.append(known[0] if known else 0)
        tag_sets.append(known)
        text = (_feature(example, "tokens", context) + b" "
                + _feature(example, "title", context)).split()
        words.extend(text)
        lengths.append(len(text))

    n, vocab_size = len(labels), len(word_index)
    ids = word_index.get_indexer(words) if words else np.empty(0, np.int64)
    rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
    in_vocab = ids >= 0
    keys, counts = np.unique(rows[in_vocab] * vocab_size + ids[in_vocab], return_counts=True)
    key_rows = keys // vocab_size
    return _ClientRows(row_nnz=np.bincount(key_rows, minlength=n),
                       columns=(keys % vocab_size).astype(np.int32),
                       values=(counts / np.asarray(lengths, np.float64)[key_rows])
                       .astype(np.float32),
                       labels=np.asarray(labels, dtype=np.int64),
                       tag_nnz=np.fromiter(map(len, tag_sets), np.int64, n),
                       tag_columns=np.fromiter((t for ts in tag_sets for t in ts), np.int32),
                       dropped=len(examples) - n)


def _csr(row_nnz: np.ndarray, columns: np.ndarray, values: np.ndarray,
         width: int) -> sparse.csr_matrix:
    """A CSR matrix from per-row nonzero counts and the concatenated columns/values."""
    indptr = np.zeros(len(row_nnz) + 1, dtype=np.int64)
    np.cumsum(row_nnz, out=indptr[1:])
    return sparse.csr_matrix((values, columns, indptr), shape=(len(row_nnz), width))


def iter_tag_rows(source: ExampleSource, word_count_path: str | Path,
                  tag_count_path: str | Path, split: str, *, vocab_size: int, num_tags: int,
                  no_tag: NoTag, max_clients: int | None = None,
                  clients: Sequence[str] | None = None) -> Iterator[tuple[str, _ClientRows]]:
    """Streams ``(client_id, CSR pieces)`` per client in sorted client-id order.

    The arguments are those of :func:`load_tag_prediction` (validated there). One client is in
    memory at a time, so a caller that writes each client's pieces out (the streaming cache
    writer of :mod:`fedprivacy.data.prepared`) preprocesses in memory bounded by the largest
    client, not by the split.
    """
    words = [w.encode("utf-8") for w in read_word_counts(word_count_path, vocab_size)]
    word_index = pd.Index(words, dtype=object)
    tags = list(read_tag_counts(tag_count_path))[:num_tags]
    tag_index = {tag.encode("utf-8"): i for i, tag in enumerate(tags)}
    wanted = clients
    if max_clients is not None:
        wanted = source.client_ids(split)[:max_clients]
    where = source.split_file(split)
    for client, examples in source.iter_client_examples(split, wanted, features=_FEATURES):
        yield client, _client_rows(examples, word_index, tag_index, no_tag,
                                   f"{where}: client {client!r}")


def load_tag_prediction(source: ExampleSource | str | Path, word_count_path: str | Path,
                        tag_count_path: str | Path, split: str, *, vocab_size: int = 10_000,
                        num_tags: int = 500, no_tag: NoTag = "label0",
                        max_clients: int | None = None,
                        clients: Sequence[str] | None = None) -> FederatedTagData:
    """Loads a split of StackOverflow as federated tag-prediction data.

    Args:
        source: The examples (:class:`~fedprivacy.data.sources.ExampleSource`), or the path
            of a ``stackoverflow.sqlite`` (TFF's or synthetic).
        word_count_path: ``stackoverflow.word_count``.
        tag_count_path: ``stackoverflow.tag_count``.
        split: ``"train"``, ``"heldout"`` or ``"test"``.
        vocab_size: Number of most frequent words kept as features. If the
            word count file lists fewer, the remaining columns stay zero.
        num_tags: Number of most frequent tags kept as classes.
        no_tag: What to do with a post that has no in-vocabulary tag:
            ``"label0"`` (label 0, as the AdaDPS code) or ``"drop"``.
        max_clients: Keep only the first ``max_clients`` clients in sorted
            client-id order (AdaDPS uses the first 400 train clients);
            ``None`` keeps all.
        clients: Read exactly these clients (sorted on output) instead;
            not together with ``max_clients``.

    Returns:
        The preprocessed population. Clients left without examples (after
        dropping) keep an empty row range.

    Raises:
        FileNotFoundError: If a file does not exist.
        DataFormatError: If a file is malformed or an example lacks
            ``tokens``, ``title`` or ``tags``.
        ValueError: On an unknown split or an invalid argument.
    """
    if vocab_size < 1 or num_tags < 1:
        raise ValueError(f"vocab_size and num_tags must be >= 1, got {vocab_size}, {num_tags}")
    if no_tag not in ("label0", "drop"):
        raise ValueError(f"no_tag must be 'label0' or 'drop', got {no_tag!r}")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1 or None, got {max_clients}")
    if max_clients is not None and clients is not None:
        raise ValueError("pass max_clients or clients, not both")
    if not isinstance(source, ExampleSource):
        source = open_source("tff-sqlite", source)

    clients_rows = list(iter_tag_rows(source, word_count_path, tag_count_path, split,
                                      vocab_size=vocab_size, num_tags=num_tags, no_tag=no_tag,
                                      max_clients=max_clients, clients=clients))
    return assemble(clients_rows, vocab_size, num_tags)


def assemble(clients_rows: Sequence[tuple[str, _ClientRows]], vocab_size: int,
             num_tags: int) -> FederatedTagData:
    """Joins per-client CSR pieces, in the given order, into one :class:`FederatedTagData`."""
    parts = [rows for _, rows in clients_rows]

    def joined(name: str, dtype) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts] or [np.empty(0, dtype)])

    features = _csr(joined("row_nnz", np.int64), joined("columns", np.int32),
                    joined("values", np.float32), vocab_size)
    tag_columns = joined("tag_columns", np.int32)
    tags = _csr(joined("tag_nnz", np.int64), tag_columns, np.ones(len(tag_columns), np.float32),
                num_tags)
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p.labels) for p in parts], out=offsets[1:])
    return FederatedTagData(features=features, labels=joined("labels", np.int64), tags=tags,
                            offsets=offsets, client_ids=tuple(c for c, _ in clients_rows),
                            vocab_size=vocab_size, num_tags=num_tags,
                            num_dropped=sum(p.dropped for p in parts))
