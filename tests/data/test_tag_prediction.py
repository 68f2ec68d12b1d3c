"""Tests of the AdaDPS/TFF tag-prediction preprocessing."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from scipy import sparse

from fedprivacy.data.example_proto import encode_example
from fedprivacy.data.stackoverflow import DataFormatError, iter_client_examples
from fedprivacy.data.synthetic import SyntheticFiles
from fedprivacy.data.tag_prediction import FederatedTagData, load_tag_prediction

# Vocabulary (3 words): the=0, foo=1, bar=2; "baz" and "qux" are out of vocabulary.
WORD_COUNTS = "the 10\nfoo 5\nbar 3\nbaz 1\n"
# Tag order by count: python=0, java=1, rare=2; with num_tags=2 "rare" is unknown.
TAG_COUNTS = {"java": 5, "rare": 1, "python": 9}
POSTS = [  # (client, tokens, title, tags)
    ("a", "the foo qux", "bar the", "java|python"),   # 5 words: the 2/5, foo 1/5, bar 1/5
    ("a", "baz qux", "foo", "rare"),                  # no known tag
    ("a", "", "", "rare|java"),                       # no words at all
    ("b", "foo bar", "x", "rare"),                    # b has only an unknown-tag post
    ("c", "foo  foo\tbar", "qux", "java|java"),       # 4 words (whitespace runs), tag twice
]


@pytest.fixture()
def hand_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    db = tmp_path / "so.sqlite"
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT "
                           "NOT NULL, serialized_example_proto BLOB NOT NULL)")
        connection.execute("CREATE TABLE client_metadata (client_id TEXT NOT NULL, "
                           "split_name TEXT NOT NULL, num_examples INTEGER NOT NULL)")
        for client, tokens, title, tags in POSTS:
            blob = encode_example({"tokens": tokens, "title": title, "tags": tags,
                                   "type": "question", "score": 1,
                                   "creation_date": "2016-01-01 00:00:00 UTC"})
            connection.execute("INSERT INTO examples VALUES ('train', ?, ?)", (client, blob))
        connection.executemany("INSERT INTO client_metadata VALUES (?, 'train', ?)",
                               [("a", 3), ("b", 1), ("c", 1)])
    connection.close()
    word_count, tag_count = tmp_path / "wc", tmp_path / "tc"
    word_count.write_text(WORD_COUNTS)
    tag_count.write_text(json.dumps(TAG_COUNTS))
    return db, word_count, tag_count


def _load(files: tuple[Path, Path, Path], **kwargs) -> FederatedTagData:
    return load_tag_prediction(*files, "train", **{"vocab_size": 3, "num_tags": 2, **kwargs})


def test_features_and_labels_by_hand_label0(hand_files) -> None:
    data = _load(hand_files)
    expected = np.array([[2 / 5, 1 / 5, 1 / 5],
                         [0, 1 / 3, 0],
                         [0, 0, 0],
                         [0, 1 / 3, 1 / 3],
                         [0, 2 / 4, 1 / 4]], dtype=np.float32)
    assert isinstance(data.features, sparse.csr_matrix)
    assert data.features.dtype == np.float32 and data.features.shape == (5, 3)
    np.testing.assert_allclose(data.features.toarray(), expected, rtol=1e-6)
    assert data.labels.dtype == np.int64
    assert data.labels.tolist() == [0, 0, 1, 0, 1]
    assert data.offsets.tolist() == [0, 3, 4, 5]
    assert data.client_ids == ("a", "b", "c") and data.num_clients == 3
    assert (data.vocab_size, data.num_tags) == (3, 2)


def test_drop_keeps_clients_left_empty(hand_files) -> None:
    data = _load(hand_files, no_tag="drop")
    assert data.labels.tolist() == [0, 1, 1]
    assert data.offsets.tolist() == [0, 2, 2, 3]
    assert data.client_ids == ("a", "b", "c")
    features, labels = data.client(1)
    assert features.shape == (0, 3) and labels.shape == (0,)
    features, labels = data.client(2)
    np.testing.assert_allclose(features.toarray(), [[0, 2 / 4, 1 / 4]], rtol=1e-6)
    assert labels.tolist() == [1]


def test_wider_vocab_than_file_pads_columns_and_max_clients(hand_files) -> None:
    data = _load(hand_files, vocab_size=8, num_tags=500, max_clients=2)
    assert data.features.shape == (4, 8)
    assert data.features[:, 4:].nnz == 0
    # all 4 words of the file are known now: "baz" counts, "rare" is tag 2
    assert data.features[1, 3] == pytest.approx(1 / 3)
    assert data.labels.tolist() == [0, 2, 1, 2]
    assert data.client_ids == ("a", "b")


def test_invalid_arguments(hand_files) -> None:
    with pytest.raises(ValueError, match="no_tag"):
        _load(hand_files, no_tag="skip")
    with pytest.raises(ValueError, match="vocab_size"):
        _load(hand_files, vocab_size=0)
    with pytest.raises(ValueError, match="max_clients"):
        _load(hand_files, max_clients=0)


def test_example_without_tokens_is_a_format_error(tmp_path: Path, hand_files) -> None:
    db, word_count, tag_count = hand_files
    with sqlite3.connect(db) as connection:
        connection.execute("INSERT INTO examples VALUES ('train', 'c', ?)",
                           (encode_example({"title": "t", "tags": "java"}),))
    connection.close()
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(db))}: client 'c', example 1.*"
                                              "'tokens'"):
        load_tag_prediction(db, word_count, tag_count, "train")


@pytest.fixture(scope="module")
def synthetic_splits(so_files: SyntheticFiles) -> dict[str, FederatedTagData]:
    return {split: load_tag_prediction(so_files.sqlite, so_files.word_count,
                                       so_files.tag_count, split)
            for split in ("train", "test")}


def test_synthetic_rows_are_in_vocab_fractions(so_files: SyntheticFiles,
                                               synthetic_splits) -> None:
    data = synthetic_splits["train"]
    assert data.features.shape[1] == 10_000 and data.num_tags == 500
    sums = np.asarray(data.features.sum(axis=1)).ravel()
    assert sums.max() <= 1 + 1e-6 and data.features.min() >= 0
    assert 0 <= data.labels.min() and data.labels.max() < 500
    vocab = {w for w, _ in (line.split() for line in
                            so_files.word_count.read_text().splitlines()[:10_000])}
    client, examples = next(iter_client_examples(so_files.sqlite, "train"))
    assert client == data.client_ids[0]
    for row, example in enumerate(examples):
        words = (example["tokens"][0] + b" " + example["title"][0]).decode().split()
        assert sums[row] == pytest.approx(sum(w in vocab for w in words) / len(words),
                                          rel=1e-5)
    sizes = np.diff(data.offsets)
    with sqlite3.connect(so_files.sqlite) as connection:
        declared = dict(connection.execute("SELECT client_id, num_examples FROM "
                                           "client_metadata WHERE split_name = 'train'"))
    assert sizes.tolist() == [declared[c] for c in data.client_ids]


def test_synthetic_tags_are_learnable(synthetic_splits) -> None:
    """Nearest centroid (cosine) beats the majority label by a clear margin."""
    train, test = synthetic_splits["train"], synthetic_splits["test"]
    counts = np.bincount(train.labels, minlength=train.num_tags)
    assert counts.max() / len(train.labels) < 0.5
    one_hot = sparse.csr_matrix((np.ones(len(train.labels)),
                                 (train.labels, np.arange(len(train.labels)))),
                                shape=(train.num_tags, len(train.labels)))
    centroids = (one_hot @ train.features).toarray()
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True) + 1e-12
    predicted = np.asarray(test.features @ centroids.T).argmax(axis=1)
    accuracy = (predicted == test.labels).mean()
    majority = (test.labels == counts.argmax()).mean()
    assert accuracy > majority + 0.2
