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
drops such posts instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from scipy import sparse

from fedprivacy.data.stackoverflow import (
    DataFormatError,
    client_ids as split_client_ids,
    iter_client_examples,
    read_tag_counts,
    read_word_counts,
)

__all__ = ["FederatedTagData", "load_tag_prediction"]

NoTag = Literal["label0", "drop"]


@dataclass(frozen=True)
class FederatedTagData:
    """Preprocessed tag-prediction examples of a population of clients.

    Attributes:
        features: float32 CSR matrix, shape ``(num_examples, vocab_size)``:
            normalized bags of words.
        labels: int64 array, shape ``(num_examples,)``, values in
            ``[0, num_tags)``.
        offsets: int64 array, shape ``(num_clients + 1,)``: client ``i`` owns
            rows ``offsets[i]:offsets[i + 1]`` (possibly none).
        client_ids: The clients, in row order (sorted).
        vocab_size: Number of feature columns.
        num_tags: Number of classes.
    """

    features: sparse.csr_matrix
    labels: np.ndarray
    offsets: np.ndarray
    client_ids: tuple[str, ...]
    vocab_size: int
    num_tags: int

    def __post_init__(self) -> None:
        n = self.features.shape[0]
        if (self.features.shape[1] != self.vocab_size or self.labels.shape != (n,)
                or self.offsets.shape != (len(self.client_ids) + 1,)
                or self.offsets[0] != 0 or self.offsets[-1] != n
                or np.any(np.diff(self.offsets) < 0)):
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
    """CSR pieces of one client: per-row nonzero counts, columns, values, labels."""

    row_nnz: np.ndarray
    columns: np.ndarray
    values: np.ndarray
    labels: np.ndarray


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
    for j, example in enumerate(examples):
        context = f"{where}, example {j}"
        known = [tag_index[t] for t in _feature(example, "tags", context).split(b"|")
                 if t in tag_index]
        if not known and no_tag == "drop":
            continue
        labels.append(min(known, default=0))
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
                       labels=np.asarray(labels, dtype=np.int64))


def load_tag_prediction(sqlite_path: str | Path, word_count_path: str | Path,
                        tag_count_path: str | Path, split: str, *, vocab_size: int = 10_000,
                        num_tags: int = 500, no_tag: NoTag = "label0",
                        max_clients: int | None = None) -> FederatedTagData:
    """Loads a split of StackOverflow as federated tag-prediction data.

    Args:
        sqlite_path: ``stackoverflow.sqlite`` (TFF's or synthetic).
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

    words = [w.encode("utf-8") for w in read_word_counts(word_count_path, vocab_size)]
    word_index = pd.Index(words, dtype=object)
    tags = list(read_tag_counts(tag_count_path))[:num_tags]
    tag_index = {tag.encode("utf-8"): i for i, tag in enumerate(tags)}
    wanted = None
    if max_clients is not None:
        wanted = split_client_ids(sqlite_path, split)[:max_clients]

    ids: list[str] = []
    parts: list[_ClientRows] = []
    for client, examples in iter_client_examples(sqlite_path, split, wanted):
        ids.append(client)
        parts.append(_client_rows(examples, word_index, tag_index, no_tag,
                                  f"{sqlite_path}: client {client!r}"))

    row_nnz = np.concatenate([p.row_nnz for p in parts])
    indptr = np.zeros(len(row_nnz) + 1, dtype=np.int64)
    np.cumsum(row_nnz, out=indptr[1:])
    features = sparse.csr_matrix(
        (np.concatenate([p.values for p in parts]), np.concatenate([p.columns for p in parts]),
         indptr), shape=(len(row_nnz), vocab_size))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p.labels) for p in parts], out=offsets[1:])
    return FederatedTagData(features=features,
                            labels=np.concatenate([p.labels for p in parts]),
                            offsets=offsets, client_ids=tuple(ids), vocab_size=vocab_size,
                            num_tags=num_tags)
